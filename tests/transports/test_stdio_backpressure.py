"""A peer that sends requests and never reads the answers: the agent stops reading it.

Found (issue 20, finding 5): the engine gave a request's in-flight slot back before its answer
was written, so 60,000 `session/list` requests from a peer that never read stdout took
`acp-once agent` from 47 to 665 MB: it read every request and kept every answer. Sent the way
it was found: raw bytes on the real pipes of a real `acp-once agent` process.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time

import orjson

AGENT = [sys.executable, "-m", "acp_once", "agent", "--store", "memory"]
INITIALIZE = (
    b'{"jsonrpc":"2.0","id":"init","method":"initialize",'
    b'"params":{"protocolVersion":2,"info":{"name":"raw","version":"1"}}}\n'
)
# Long ids make each request and each answer ~550 bytes, so a few thousand requests are
# megabytes: what the agent may hold is measured in bytes (pipe buffers, its 1 MiB read-ahead,
# 256 requests in flight and their answers, the 64 KiB outbox), well under TAKEN_LIMIT.
PAD = "x" * 500
REQUESTS = 14_000  # ~7.9 MB: before the fix the agent read all of it
TAKEN_LIMIT = 3_000_000
# a writable wait this long with the pipe full means the agent stopped reading; a slower agent
# only makes the test stop writing sooner, which cannot make it pass wrongly
STALL = 2.0
TIMEOUT = 30.0


def _request(i: int) -> bytes:
    return b'{"jsonrpc":"2.0","id":"%06d%s","method":"session/list"}\n' % (i, PAD.encode())


def _read_lines(fd: int, buffer: bytearray, deadline: float) -> list[bytes]:
    """Wait (bounded) for what the agent wrote and return the complete lines."""
    left = deadline - time.monotonic()
    assert left > 0 and select.select([fd], [], [], left)[0], "no answer in time"
    chunk = os.read(fd, 1 << 20)
    assert chunk, "the agent closed its stdout"
    buffer += chunk
    *lines, rest = bytes(buffer).split(b"\n")
    buffer[:] = rest
    return lines


def test_a_peer_that_never_reads_is_no_longer_read_and_every_request_is_answered_once() -> None:
    agent = subprocess.Popen(AGENT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert agent.stdin is not None and agent.stdout is not None
    wfd, rfd = agent.stdin.fileno(), agent.stdout.fileno()
    deadline = time.monotonic() + TIMEOUT
    buffer = bytearray()
    try:
        os.write(wfd, INITIALIZE)
        assert orjson.loads(_read_lines(rfd, buffer, deadline)[0])["id"] == "init"

        data = b"".join(_request(i) for i in range(REQUESTS))
        view = memoryview(data)
        os.set_blocking(wfd, False)
        # write without reading a byte of stdout until the pipe stays full
        while view and select.select([], [wfd], [], STALL)[1]:
            try:
                view = view[os.write(wfd, view) :]
            except BlockingIOError:
                continue
            assert time.monotonic() < deadline
        taken = len(data) - len(view)
        assert view, "the agent read every request although nobody read its answers"
        assert taken < TAKEN_LIMIT, f"the agent took {taken:,} bytes of requests"

        # now read: the agent goes on, and every request gets exactly one answer, with its id
        answers: dict[str, int] = {}
        while len(answers) < REQUESTS:
            if view and select.select([], [wfd], [], 0)[1]:
                with contextlib.suppress(BlockingIOError):
                    view = view[os.write(wfd, view) :]
            for line in _read_lines(rfd, buffer, deadline):
                answer = orjson.loads(line)
                assert answer["result"] == {"sessions": []}, answer
                answers[answer["id"]] = answers.get(answer["id"], 0) + 1
        assert answers == {f"{i:06d}{PAD}": 1 for i in range(REQUESTS)}
        assert agent.poll() is None
        agent.stdin.close()  # the agent ends; nothing more may come before its stdout closes
        rest = bytes(buffer)
        while select.select([rfd], [], [], max(deadline - time.monotonic(), 0))[0]:
            chunk = os.read(rfd, 1 << 16)
            if not chunk:
                break
            rest += chunk
        assert rest == b"", "an answer came twice"
    finally:
        if not agent.stdin.closed:
            agent.stdin.close()
        try:
            agent.wait(10)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        agent.stdout.close()
    assert agent.returncode == 0
