"""`acp-once serve` over WebSocket under hypothesis: one real server process for the whole test,
every example's frames sent as WebSocket text frames (binary frames mixed in), then text frames
that are not UTF-8. The server never exits; each request gets exactly one answer with its id;
binary frames get none; a refused request leaves `session/list` as it was; a second connection,
with a session of its own, keeps working throughout; no ERROR or traceback on stderr."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.fuzz.logs import assert_clean
from tests.fuzz.strategies import CASES, ID_TEXT, Case, _parses, answer_ids
from tests.fuzz.test_stdio_fuzz import INITIALIZE
from tests.remote.harness import listening_socket

TIMEOUT = 50.0  # the whole test; each read waits at most until then
BINARY = st.binary(max_size=64).map(lambda b: Case("binary", lambda _: b, "none"))
# text frames whose bytes are not UTF-8: the WebSocket layer closes that connection (1007)
NOT_UTF8 = [b"\xff", b'{"jsonrpc":"2.0","id":1,"method":"session/list"\xc3}', b"\xed\xa0\x80"]


def _as_text(frame: bytes) -> bytes:
    """`frame` as a text frame can carry it: garbage that is not UTF-8 (closed with 1007, tried
    apart below) has its bad bytes replaced, and stays garbage."""
    try:
        frame.decode("utf-8")
    except UnicodeDecodeError:
        frame = frame.decode("utf-8", "replace").encode()
        assume(not _parses(frame))
    return frame


class Peer:
    """One WebSocket connection to the server, initialized."""

    def __init__(self, url: str, deadline: float, stack: ExitStack) -> None:
        self.ws: ClientConnection = stack.enter_context(
            connect(url, max_size=None, open_timeout=10)
        )
        self.deadline = deadline
        self.calls = 0
        self.send(INITIALIZE)
        assert self.answer()["id"] == "init"

    def send(self, frame: bytes, *, binary: bool = False) -> None:
        # text=True: the bytes go out as a text frame whatever they are
        self.ws.send(frame, text=not binary)

    def answer(self) -> Any:
        while True:
            left = self.deadline - time.monotonic()
            assert left > 0, "no answer in time"
            message = self.ws.recv(timeout=left)
            value = json.loads(message)  # the stdlib reads escaped surrogates back
            assert isinstance(value, dict | list)  # an array: the answers to a batch
            if isinstance(value, dict) and "method" in value and "id" not in value:
                continue  # a notification of the agent's (a prompt's turn)
            return value

    def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        id = f"{method}-{self.calls}"
        self.send(
            json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode()
        )
        answer: dict[str, Any] = self.answer()
        assert answer["id"] == id, answer
        return answer

    def sessions(self) -> list[str]:
        result = self.call("session/list", {})["result"]
        return sorted(json.dumps(s, sort_keys=True) for s in result["sessions"])

    def prompt(self, session: str, text: str) -> None:
        params = {"sessionId": session, "prompt": [{"type": "text", "text": text}]}
        assert "messageId" in self.call("session/prompt", params)["result"]

    def exchange(self, example: int, cases: list[tuple[Case, str]]) -> bool:
        """Send one example's frames (binary ones as binary frames, the rest as text) and read
        their answers: exactly one per request, by id (None for what cannot be read). Whether
        every answer was an error."""
        expected: Counter[str] = Counter()
        for i, (case, suffix) in enumerate(cases):
            id = f"{example}.{i}:{suffix}"
            frame = case.frame(id)
            if case.kind != "binary":
                frame = _as_text(frame)
            self.send(frame, binary=case.kind == "binary")
            for answer_id in case.expected(id):
                expected[repr(answer_id)] += 1
        got: Counter[str] = Counter()
        errors_only = True
        while got.total() < expected.total():
            answer = self.answer()
            for answer_id in answer_ids(answer):
                got[repr(answer_id)] += 1
            answers = answer if isinstance(answer, list) else [answer]
            errors_only = errors_only and all("error" in a for a in answers)
        assert got == expected
        return errors_only


def test_serve_answers_each_frame_once_and_keeps_other_connections() -> None:
    sock = listening_socket()
    port, fd = sock.getsockname()[1], sock.fileno()
    url = f"ws://127.0.0.1:{port}/acp"
    deadline = time.monotonic() + TIMEOUT
    with (
        tempfile.TemporaryFile() as stderr,
        tempfile.TemporaryDirectory() as tmp,
        ExitStack() as stack,
    ):
        command = [
            sys.executable, "-m", "acp_once", "serve", "--store", "memory",
            "--side-effects", tmp, "--fd", str(fd),
        ]  # fmt: skip
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, pass_fds=(fd,)
        )
        sock.close()  # the server holds it; a client connecting now waits in the backlog
        try:
            other = Peer(url, deadline, stack)
            mine = other.call("session/new", {"cwd": "/tmp"})["result"]["sessionId"]
            other.prompt(mine, "before")
            fuzzer = Peer(url, deadline, stack)
            examples = 0

            @settings(
                max_examples=100,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
                database=None,
            )
            @given(st.lists(st.tuples(CASES | BINARY, ID_TEXT), min_size=1, max_size=6))
            def exchange(cases: list[tuple[Case, str]]) -> None:
                nonlocal examples
                examples += 1
                before = fuzzer.sessions()
                errors_only = fuzzer.exchange(examples, cases)
                after = fuzzer.sessions()  # also: nothing more came before this answer
                if errors_only:
                    assert after == before, "a refused request changed the store"
                if examples % 10 == 0:
                    other.prompt(mine, f"during {examples}")

            exchange()
            assert examples >= 80  # many examples, all through this one process and connection

            for frame in NOT_UTF8:
                peer = Peer(url, deadline, stack)
                peer.send(frame)
                try:
                    peer.answer()
                    raise AssertionError("a text frame that is not UTF-8 was answered")
                except ConnectionClosed as closed:
                    assert closed.rcvd is not None and closed.rcvd.code == 1007, closed
            # the first connections and their session outlived all of it
            other.prompt(mine, "after")
            assert fuzzer.sessions() == other.sessions()
            assert proc.poll() is None
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        stderr.seek(0)
        log = stderr.read().decode(errors="replace")
    assert proc.returncode == 0, log[-3000:]
    assert_clean(log)
