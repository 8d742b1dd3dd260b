"""`acp-once agent` over stdio under hypothesis: one real process for the whole test, every
example's frames through its pipes. It never exits; each request gets exactly one answer with
its id (id null for what cannot be read); notifications, responses and garbage get none beyond
that; a refused request leaves the store as it was; no ERROR or traceback on stderr."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.logs import assert_clean
from tests.fuzz.strategies import CASES, ID_TEXT, Case, answer_ids

AGENT = [sys.executable, "-m", "acp_once", "agent", "--store", "memory"]
TIMEOUT = 50.0  # the whole test; each read waits at most until then
INITIALIZE = (
    b'{"jsonrpc":"2.0","id":"init","method":"initialize",'
    b'"params":{"protocolVersion":2,"info":{"name":"fuzz","version":"1"}}}'
)


class Agent:
    def __init__(self, stderr: Any) -> None:
        self.proc = subprocess.Popen(
            AGENT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.wfd, self.rfd = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        self.buffer = bytearray()
        self.deadline = time.monotonic() + TIMEOUT
        self.examples = 0

    def send(self, frame: bytes) -> None:
        os.write(self.wfd, frame + b"\n")  # blocking: the agent reads, as we read its answers

    def answer(self) -> Any:
        while b"\n" not in self.buffer:
            left = self.deadline - time.monotonic()
            assert left > 0 and select.select([self.rfd], [], [], left)[0], "no answer in time"
            chunk = os.read(self.rfd, 1 << 16)
            assert chunk, f"the agent exited: {self.proc.wait()}"
            self.buffer += chunk
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer[:] = rest
        value = json.loads(line)  # the stdlib reads escaped surrogates back
        assert isinstance(value, dict | list)  # an array: the answers to a batch
        if isinstance(value, dict) and "method" in value and "id" not in value:
            return self.answer()  # a notification of the agent's (the prompt's turn)
        return value

    def call(self, id: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.send(
            json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode()
        )
        answer: dict[str, Any] = self.answer()
        assert answer["id"] == id, answer
        return answer

    def sessions(self) -> list[Any]:
        self.examples += 1
        result = self.call(f"list-{self.examples}", "session/list", {})["result"]
        return sorted(json.dumps(s, sort_keys=True) for s in result["sessions"])


def test_the_agent_answers_each_request_once_and_lives_whatever_it_is_sent() -> None:
    with tempfile.TemporaryFile() as stderr:
        agent = Agent(stderr)
        try:
            agent.send(INITIALIZE)
            assert agent.answer()["id"] == "init"
            session = agent.call("new", "session/new", {"cwd": "/tmp"})["result"]["sessionId"]
            prompt = {"sessionId": session, "prompt": [{"type": "text", "text": "hi"}]}
            agent.call("prompt", "session/prompt", prompt)

            @settings(
                max_examples=120,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
                database=None,
            )
            @given(st.lists(st.tuples(CASES, ID_TEXT), min_size=1, max_size=6))
            def exchange(cases: list[tuple[Case, str]]) -> None:
                before = agent.sessions()
                n = agent.examples
                expected: Counter[str] = Counter()
                for i, (case, suffix) in enumerate(cases):
                    id = f"{n}.{i}:{suffix}"
                    agent.send(case.frame(id))
                    for answer_id in case.expected(id):
                        expected[repr(answer_id)] += 1
                got: Counter[str] = Counter()
                errors_only = True
                while got.total() < expected.total():
                    answer = agent.answer()
                    for answer_id in answer_ids(answer):
                        got[repr(answer_id)] += 1
                    answers = answer if isinstance(answer, list) else [answer]
                    errors_only = errors_only and all("error" in a for a in answers)
                assert got == expected
                after = agent.sessions()  # also: nothing more came before this answer
                if errors_only:
                    assert after == before, "a refused request changed the store"

            exchange()
            assert agent.examples >= 100  # many examples, all through this one process
            assert agent.proc.poll() is None
        finally:
            assert agent.proc.stdin is not None and agent.proc.stdout is not None
            agent.proc.stdin.close()
            try:
                agent.proc.wait(10)
            except subprocess.TimeoutExpired:
                agent.proc.kill()
                agent.proc.wait()
            agent.proc.stdout.close()
        stderr.seek(0)
        log = stderr.read().decode(errors="replace")
    assert agent.proc.returncode == 0, log[-3000:]
    assert_clean(log)
