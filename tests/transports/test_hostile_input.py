"""Input that once crashed the engine, sent the way it was found: raw frames on real pipes."""

from __future__ import annotations

import json
import sys

import anyio
import orjson
import pytest

from acp_once.transports.stdio import AgentProcess, spawn

pytestmark = pytest.mark.anyio

TIMEOUT = 30
AGENT = [sys.executable, "-m", "acp_once", "agent", "--store", "memory"]
SURROGATE = chr(0xD800)
SURROGATE_2 = chr(0xD801)
INITIALIZE = (
    b'{"jsonrpc":"2.0","id":0,"method":"initialize",'
    b'"params":{"protocolVersion":2,"info":{"name":"raw","version":"1"}}}'
)


async def answer(proc: AgentProcess) -> dict[str, object]:
    frame = await proc.frames.receive()
    assert isinstance(frame, bytes) and frame.isascii(), frame  # non-ASCII is escaped
    value = orjson.loads(frame)
    assert isinstance(value, dict)
    return value


async def test_a_lone_surrogate_in_an_id_or_method_is_answered_and_the_agent_lives_on() -> None:
    with anyio.fail_after(TIMEOUT):
        async with spawn(AGENT) as proc:
            await proc.frames.send(INITIALIZE)
            assert (await answer(proc))["id"] == 0
            # the frames of the finding: before the fix the agent exited 1 on the first one
            await proc.frames.send(b'{"jsonrpc":"2.0","id":"\\ud800","method":"session/list"}')
            await proc.frames.send(b'{"jsonrpc":"2.0","id":"\\ud801","method":"\\ud800"}')
            await proc.frames.send(b'{"jsonrpc":"2.0","id":7,"method":"session/list"}')
            answers: dict[object, dict[str, object]] = {}
            for _ in range(3):
                frame = await proc.frames.receive()
                assert isinstance(frame, bytes)
                answer_ = json.loads(frame)  # the stdlib reads escaped surrogates back
                answers[answer_["id"]] = answer_
            assert sorted(map(repr, answers)) == sorted(map(repr, [SURROGATE, SURROGATE_2, 7]))
            assert answers[SURROGATE]["result"] == {"sessions": []}
            assert answers[SURROGATE_2]["error"] == {
                "code": -32601,
                "message": f"Method not found: {SURROGATE}",
            }
            assert answers[7]["result"] == {"sessions": []}
            assert proc.returncode is None


async def test_a_last_frame_without_a_newline_at_eof_is_answered() -> None:
    # a client that writes its requests and closes the pipe: the last line has no newline
    session_new = b'{"jsonrpc":"2.0","id":1,"method":"session/new","params":{"cwd":"/tmp"}}'
    with anyio.fail_after(TIMEOUT):
        done = await anyio.run_process(AGENT, input=INITIALIZE + b"\n" + session_new, check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert [a["id"] for a in answers] == [0, 1]
    assert "sessionId" in answers[1]["result"]
