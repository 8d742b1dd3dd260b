"""`acp-once bridge -- acp-once agent` with one client sending garbage: two WebSocket clients
with sessions on one real bridge; one sends the fuzz frames (a lone surrogate in `method` and in
the id first: that once killed the shared child and closed everyone with 1001), the other's
session keeps working throughout, every request of the fuzzer gets exactly one answer with its
id, and the child is never restarted."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from typing import IO

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed

from tests.fuzz.logs import assert_clean
from tests.fuzz.strategies import CASES, ID_TEXT, Case
from tests.fuzz.test_serve_fuzz import BINARY, NOT_UTF8, TIMEOUT, Peer

AGENT = [sys.executable, "-m", "acp_once", "agent", "--store", "memory"]
# surrogates written escaped, as a peer would send them
SURROGATES = [
    ("s1", b'{"jsonrpc":"2.0","id":"s1","method":"\\ud800"}'),
    ("s2", b'{"jsonrpc":"2.0","id":"s2","method":"session/\\udfff","params":{}}'),
    ("\ud800", b'{"jsonrpc":"2.0","id":"\\ud800","method":"session/list"}'),
    ("s3", b'{"jsonrpc":"2.0","id":"s3","method":"session/new","params":{"cwd":"/\\ud800"}}'),
]


class Log:
    """The bridge's stderr, line by line, read by a thread (a pipe read cannot be bounded)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        for raw in stream:
            with self._changed:
                self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.lines.append("<eof>")
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    found = re.search(pattern, line)
                    if found:
                        return found
                left = deadline - time.monotonic()
                assert left > 0 and self.lines[-1:] != ["<eof>"], "\n".join(self.lines)
                self._changed.wait(left)

    def starts(self) -> list[str]:
        with self._changed:
            return [line for line in self.lines if re.search(r"agent started \(pid", line)]

    def join(self, timeout: float) -> str:
        self._thread.join(timeout)
        with self._changed:
            return "\n".join(self.lines)


def test_one_clients_garbage_leaves_the_other_client_and_the_child_alone() -> None:
    command = [sys.executable, "-m", "acp_once", "bridge", "--port", "0", "--", *AGENT]
    proc = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    log = Log(proc.stderr)
    deadline = time.monotonic() + TIMEOUT
    try:
        with ExitStack() as stack:
            url = log.wait_for(r"ACP over WebSocket at (ws://\S+/acp)", 30).group(1)
            other = Peer(url, deadline, stack)
            mine = other.call("session/new", {"cwd": "/tmp"})["result"]["sessionId"]
            other.prompt(mine, "before")
            fuzzer = Peer(url, deadline, stack)
            theirs = fuzzer.call("session/new", {"cwd": "/tmp"})["result"]["sessionId"]
            child = log.wait_for(r"agent started \(pid (\d+)\)", 10).group(1)

            for id, frame in SURROGATES:
                fuzzer.send(frame)
                answer = fuzzer.answer()
                assert answer["id"] == id, answer
                # a method with a surrogate does not exist; a cwd with one cannot be stored
                assert "error" in answer or id == "\ud800", answer
            other.prompt(mine, "after the surrogates")
            examples = 0

            @settings(
                max_examples=60,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
                database=None,
            )
            @given(st.lists(st.tuples(CASES | BINARY, ID_TEXT), min_size=1, max_size=6))
            def exchange(cases: list[tuple[Case, str]]) -> None:
                nonlocal examples
                examples += 1
                fuzzer.exchange(examples, cases)
                fuzzer.sessions()  # nothing more came before this answer
                if examples % 10 == 0:
                    other.prompt(mine, f"during {examples}")

            exchange()
            assert examples >= 40
            for frame in NOT_UTF8:  # each closes its own connection (1007), nobody else's
                peer = Peer(url, deadline, stack)
                peer.send(frame)
                with pytest.raises(ConnectionClosed) as closed:
                    peer.answer()
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1007
            other.prompt(mine, "after")
            fuzzer.prompt(theirs, "the fuzzer's own session works too")
            assert len(log.starts()) == 1, log.starts()  # never restarted
            assert f"pid {child}" in log.starts()[0]
            assert proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log.join(10)
    proc.stderr.close()
    assert proc.returncode == 0, text[-3000:]
    assert_clean(text)
