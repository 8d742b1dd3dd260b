"""The RFD's traces against the reference agent over real stdio, with its SQLite store.

Each test checks what the client sees and what was stored: the number of user messages in the
stored session and the lines in the side-effect log.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from acp_once.agent.runtime import INTERRUPTED_MESSAGE
from acp_once.client import ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.protocol.errors import (
    INVALID_PARAMS,
    REQUEST_CANCELLED,
    RESOURCE_NOT_FOUND,
    AcpError,
)
from acp_once.protocol.framing import FrameEvent
from acp_once.rpc.errors import ConnectionClosed
from acp_once.storage import open_store
from acp_once.transports.stdio import ByteStreamFrames, spawn
from tests.helpers import UpdateRecorder, initialize_request

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 30
KEY = "0b6f3c1e-8d2a-4c57-9a41-5e2f7d90c3ab"


class Tap:
    """Wraps a frame stream and keeps every received frame, for the privacy scan."""

    def __init__(self, inner: ByteStreamFrames) -> None:
        self.inner = inner
        self.frames: list[bytes] = []
        self._arrived = anyio.Event()

    async def receive(self) -> FrameEvent:
        frame = await self.inner.receive()
        if isinstance(frame, bytes):
            self.frames.append(frame)
            self._arrived.set()
            self._arrived = anyio.Event()
        return frame

    async def wait_for(self, needle: bytes) -> bytes:
        """The first received frame containing `needle` (bounded by the caller's fail_after)."""
        while True:
            for frame in self.frames:
                if needle in frame:
                    return frame
            await self._arrived.wait()

    async def send(self, frame: bytes) -> None:
        await self.inner.send(frame)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Env:
    def __init__(self, tmp: Path) -> None:
        self.db = tmp / "sessions.sqlite3"
        self.effects = tmp / "effects"
        self.stderr = tmp / "agent.stderr"

    def command(self, *extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "acp_once",
            "agent",
            "--store",
            f"sqlite:{self.db}",
            "--side-effects",
            str(self.effects),
            *extra,
        ]

    async def count(self, session_id: str, key: str | None = None) -> int:
        async with open_store(f"sqlite:{self.db}") as store:
            return await store.count_user_messages(session_id, idempotency_key=key)

    def effect_lines(self, session_id: str) -> int:
        log = self.effects / f"{session_id}.log"
        return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


@asynccontextmanager
async def agent(
    env: Env, *extra: str, crash: str | None = None
) -> AsyncIterator[tuple[ClientSideConnection, UpdateRecorder, Tap]]:
    import os

    child_env = dict(os.environ)
    if crash:
        child_env["ACP_ONCE_CRASH"] = crash
    recorder = UpdateRecorder()
    with open(env.stderr, "ab") as errfile:  # noqa: ASYNC230 (opening a log file for the child)
        async with spawn(env.command(*extra), env=child_env, stderr=errfile.fileno()) as proc:
            tap = Tap(proc.frames)
            async with ClientSideConnection(recorder, tap) as conn:
                await conn.agent.initialize(initialize_request("tests"))
                yield conn, recorder, tap


async def new_session(conn: ClientSideConnection, cwd: str = "/tmp/project") -> str:
    return (await conn.agent.new_session(s.NewSessionRequest(cwd=cwd))).session_id


def prompt_params(session_id: str, text: str, key: Any = ..., **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}
    if key is not ...:
        params["idempotencyKey"] = key
    params.update(extra)
    return params


async def prompt(conn: ClientSideConnection, session_id: str, text: str, key: Any = ...) -> str:
    result = await conn.rpc.request("session/prompt", prompt_params(session_id, text, key))
    assert isinstance(result, dict)
    message_id = result["messageId"]
    assert isinstance(message_id, str)
    return message_id


async def test_t1_retry_on_the_same_connection(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, rec, _):
            sid = await new_session(conn)
            first = await prompt(conn, sid, "deploy [tool]", KEY)
            second = await prompt(conn, sid, "deploy [tool]", KEY)
            assert first == second
            assert rec.user_messages() == [first]  # no second user_message echo (D8)
    assert await env.count(sid) == 1
    assert env.effect_lines(sid) == 1


@pytest.mark.parametrize(
    "bad",
    ["", "k" * 256, 123, 1.5, True, {}, [], {"k": "v"}, ["k"]],
    ids=["empty", "256", "int", "float", "bool", "obj", "list", "obj2", "list2"],
)
async def test_invalid_keys_are_refused_and_nothing_is_inserted(env: Env, bad: Any) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, rec, _):
            sid = await new_session(conn)
            with pytest.raises(AcpError) as info:
                await prompt(conn, sid, "hello", bad)
            assert info.value.code == INVALID_PARAMS
            assert rec.user_messages() == []
            # the connection and session keep working
            assert await prompt(conn, sid, "after", "k" * 255)
    assert await env.count(sid) == 1


async def test_lone_surrogate_key_is_invalid_params_not_parse_error(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, _rec, tap):
            sid = await new_session(conn)
            raw = orjson.dumps(prompt_params(sid, "x", "KEYPLACEHOLDER")).replace(
                b"KEYPLACEHOLDER", b"\\ud800"
            )
            frame = (
                b'{"jsonrpc":"2.0","id":"raw-1","method":"session/prompt","params":' + raw + b"}"
            )
            await tap.inner.send(frame)
            answer = orjson.loads(await tap.wait_for(b'"raw-1"'))
    assert answer["error"]["code"] == INVALID_PARAMS
    assert await env.count(sid) == 0


async def test_no_key_or_null_key_inserts_each_time_and_keys_are_case_sensitive(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, _, _):
            sid = await new_session(conn)
            ids = {
                await prompt(conn, sid, "same"),
                await prompt(conn, sid, "same"),
                await prompt(conn, sid, "same", None),
                await prompt(conn, sid, "same", "K"),
                await prompt(conn, sid, "same", "k"),
            }
            assert len(ids) == 5
    assert await env.count(sid) == 5


async def test_t3_retry_after_agent_crash_with_stored_message(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, _, _):
            sid = await new_session(conn)
        # the agent commits the message and dies before answering
        async with agent(env, crash="after-insert") as (conn, _, _):
            await conn.agent.resume_session(
                s.ResumeSessionRequest(session_id=sid, cwd="/tmp/project")
            )
            with pytest.raises(ConnectionClosed):
                await prompt(conn, sid, "migrate the database [tool]", KEY)
        assert await env.count(sid) == 1
        async with agent(env) as (conn, rec, _):
            # T2': before resume the session is not active on this connection
            with pytest.raises(AcpError) as info:
                await prompt(conn, sid, "migrate the database [tool]", KEY)
            assert info.value.code == RESOURCE_NOT_FOUND
            await conn.agent.resume_session(
                s.ResumeSessionRequest(session_id=sid, cwd="/tmp/project")
            )
            states = [u for u in rec.updates if u["sessionUpdate"] == "state_update"]
            assert states and states[-1]["state"] == "idle"
            message_id = await prompt(conn, sid, "migrate the database [tool]", KEY)
            assert message_id.startswith("msg_user_")
    assert await env.count(sid) == 1
    assert env.effect_lines(sid) == 0  # a retry starts no second round of work (R21)


async def test_without_keys_the_same_crash_inserts_twice(env: Env) -> None:
    """The harness can see the failure keys prevent."""
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, _, _):
            sid = await new_session(conn)
        async with agent(env, crash="after-insert") as (conn, _, _):
            await conn.agent.resume_session(
                s.ResumeSessionRequest(session_id=sid, cwd="/tmp/project")
            )
            with pytest.raises(ConnectionClosed):
                await prompt(conn, sid, "migrate")
        async with agent(env) as (conn, _, _):
            await conn.agent.resume_session(
                s.ResumeSessionRequest(session_id=sid, cwd="/tmp/project")
            )
            await prompt(conn, sid, "migrate")
    assert await env.count(sid) == 2


async def test_t4_retry_while_held_gets_the_same_outcome(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, rec, _):
            sid = await new_session(conn)
            await prompt(conn, sid, "long [work:1]")
            first = await conn.rpc.start_request(
                "session/prompt", prompt_params(sid, "held [tool]", KEY)
            )
            retry = await conn.rpc.start_request(
                "session/prompt", prompt_params(sid, "held [tool]", KEY)
            )
            a, b = await first.result(), await retry.result()
            assert a == b
            assert len(rec.user_messages()) == 2
            await rec.wait_for(lambda ups: any(u.get("status") == "completed" for u in ups))
    assert await env.count(sid) == 2
    assert await env.count(sid, KEY) == 1
    assert env.effect_lines(sid) == 1


async def test_cancel_request_on_a_retry_withdraws_the_held_prompt_for_all(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, _, _):
            sid = await new_session(conn)
            await prompt(conn, sid, "long [work:2]")
            first = await conn.rpc.start_request("session/prompt", prompt_params(sid, "held", KEY))
            retry = await conn.rpc.start_request("session/prompt", prompt_params(sid, "held", KEY))
            await retry.cancel()
            for call in (first, retry):
                with pytest.raises(AcpError) as info:
                    await call.result()
                assert info.value.code == REQUEST_CANCELLED
            assert await env.count(sid, KEY) == 0
            # T5: the key stayed unused, so the next attempt inserts exactly once
            again = await prompt(conn, sid, "held", KEY)
            assert again == await prompt(conn, sid, "held", KEY)
    assert await env.count(sid, KEY) == 1


async def test_session_cancel_answers_held_prompts_and_leaves_the_key_unused(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, rec, _):
            sid = await new_session(conn)
            await prompt(conn, sid, "long [work:5]")
            held = await conn.rpc.start_request("session/prompt", prompt_params(sid, "held", KEY))
            await conn.agent.cancel(s.CancelSessionNotification(session_id=sid))
            with pytest.raises(AcpError) as info:
                await held.result()
            assert info.value.code == REQUEST_CANCELLED
            await prompt(conn, sid, "held", KEY)
            idle = [
                u
                for u in rec.updates
                if u["sessionUpdate"] == "state_update" and u["state"] == "idle"
            ]
            assert idle[0].get("stopReason") == "cancelled"
    assert await env.count(sid, KEY) == 1


async def test_session_close_answers_held_prompts_with_request_cancelled(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, _, _):
            sid = await new_session(conn)
            await prompt(conn, sid, "long [work:5]")
            held = await conn.rpc.start_request("session/prompt", prompt_params(sid, "held", KEY))
            await conn.agent.close_session(s.CloseSessionRequest(session_id=sid))
            with pytest.raises(AcpError) as info:
                await held.result()
            assert info.value.code == REQUEST_CANCELLED
            # closing again, or a missing session, succeeds
            await conn.agent.close_session(s.CloseSessionRequest(session_id=sid))
            await conn.agent.close_session(s.CloseSessionRequest(session_id="sess_missing"))
    assert await env.count(sid, KEY) == 0


async def test_t6_same_key_in_another_session_and_in_a_fork(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, _, _):
            a = await new_session(conn)
            b = await new_session(conn)
            in_a = await prompt(conn, a, "same", KEY)
            in_b = await prompt(conn, b, "same", KEY)
            fork = await conn.agent.fork_session(
                s.ForkSessionRequest(session_id=a, cwd="/tmp/project")
            )
            in_fork = await prompt(conn, fork.session_id, "same", KEY)
            assert len({in_a, in_b, in_fork}) == 3
            assert await prompt(conn, a, "same", KEY) == in_a
    assert await env.count(a) == 1
    assert await env.count(b) == 1
    assert await env.count(fork.session_id) == 2  # the copied message and the new one


async def test_t7_retry_of_a_prompt_inserted_during_active_work(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env, "--policy", "steer") as (conn, rec, _):
            sid = await new_session(conn)
            await prompt(conn, sid, "long [work:2]")
            steered = await prompt(conn, sid, "steer this [tool]", KEY)  # answered mid-turn
            assert await prompt(conn, sid, "steer this [tool]", KEY) == steered
            await rec.wait_for(lambda ups: any(u.get("stopReason") == "end_turn" for u in ups))
    assert await env.count(sid, KEY) == 1
    assert env.effect_lines(sid) == 1


async def test_reused_key_with_a_different_prompt(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, _, _):
            sid = await new_session(conn)
            original = await prompt(conn, sid, "first", KEY)
            with pytest.raises(AcpError) as info:
                await prompt(conn, sid, "second", KEY)
            assert info.value.code == INVALID_PARAMS
            assert KEY not in info.value.message
            assert await prompt(conn, sid, "first", KEY) == original
        async with agent(env, "--no-compare-prompts") as (conn, _, _):
            await conn.agent.resume_session(
                s.ResumeSessionRequest(session_id=sid, cwd="/tmp/project")
            )
            assert await prompt(conn, sid, "second", KEY) == original
    assert await env.count(sid) == 1


async def test_live_only_command_keys_are_recognised_while_active(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, rec, _):
            sid = await new_session(conn)
            first = await prompt(conn, sid, "/status", KEY)
            assert await prompt(conn, sid, "/status", KEY) == first
            assert rec.user_messages() == [first]  # echoed live once
    assert await env.count(sid) == 0  # not retained


async def test_keys_never_leave_the_agent(env: Env) -> None:
    secret = "SECRET-KEY-4f1d9a"
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, _, tap):
            sid = await new_session(conn)
            await prompt(conn, sid, "one [tool]", secret + "1")
            await prompt(conn, sid, "/cmd", secret + "2")
            await prompt(conn, sid, "long [work:1]")
            held = await conn.rpc.start_request(
                "session/prompt", prompt_params(sid, "h", secret + "3")
            )
            await held.result()
            with pytest.raises(AcpError):
                await prompt(conn, sid, "different", secret + "1")
            await conn.agent.list_sessions(s.ListSessionsRequest())
            await conn.agent.resume_session(
                s.ResumeSessionRequest.model_validate(
                    {"sessionId": sid, "cwd": "/tmp/project", "replayFrom": {"type": "start"}}
                )
            )
    assert tap.frames, "nothing was received"
    assert not [f for f in tap.frames if secret.encode() in f]
    assert secret not in env.stderr.read_text()


async def test_resume_replays_history_then_state_then_responds(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, _, _):
            sid = await new_session(conn)
            m1 = await prompt(conn, sid, "hello", KEY)
        async with agent(env) as (conn, rec, _):
            await conn.agent.resume_session(
                s.ResumeSessionRequest.model_validate(
                    {"sessionId": sid, "cwd": "/tmp/project", "replayFrom": {"type": "start"}}
                )
            )
            kinds = [u["sessionUpdate"] for u in rec.updates]
            assert kinds[0] == "user_message" and rec.updates[0]["messageId"] == m1
            assert "agent_message" in kinds
            assert kinds[-1] == "state_update"
            with pytest.raises(AcpError) as info:
                await conn.agent.resume_session(
                    s.ResumeSessionRequest.model_validate(
                        {
                            "sessionId": sid,
                            "cwd": "/tmp/project",
                            "replayFrom": {"type": "seq", "at": 3},
                        }
                    )
                )
            assert info.value.code == INVALID_PARAMS
            listed = await conn.agent.list_sessions(s.ListSessionsRequest())
            assert sid in [x.session_id for x in listed.sessions]
            await conn.agent.delete_session(s.DeleteSessionRequest(session_id=sid))
            await conn.agent.delete_session(s.DeleteSessionRequest(session_id=sid))
            listed = await conn.agent.list_sessions(s.ListSessionsRequest())
            assert sid not in [x.session_id for x in listed.sessions]


async def _ends_stored(env: Env, session_id: str) -> list[dict[str, Any]]:
    """The end records (A10) in the stored timeline of `session_id`."""
    async with open_store(f"sqlite:{env.db}") as store:
        entries = await store.read_timeline(session_id)
    updates = [orjson.loads(e.update) for e in entries]
    return [u for u in updates if u.get("sessionUpdate") == "state_update"]


def _end(message_id: str) -> dict[str, Any]:
    return {
        "sessionUpdate": "state_update",
        "state": "idle",
        "stopReason": "error",
        "error": {"code": -32603, "message": INTERRUPTED_MESSAGE},
        "_meta": {"acpOnce": {"messageId": message_id}},
    }


async def test_an_interrupted_turn_shows_the_same_outcome_on_every_later_resume(env: Env) -> None:
    """A turn whose agent was SIGKILLed mid-turn has one stored end record, written by the
    restarted process; three fresh processes resuming with `replayFrom: start` each replay it
    after the user message, and their idle snapshot repeats it (A3, A10)."""
    with anyio.fail_after(TIMEOUT):
        async with (
            spawn(env.command()) as proc,
            ClientSideConnection(first := UpdateRecorder(), proc.frames) as conn,
        ):
            await conn.agent.initialize(initialize_request("tests"))
            sid = await new_session(conn)
            mid = await prompt(conn, sid, "long [work:60]", KEY)
            await first.wait_for(lambda ups: any(u.get("state") == "running" for u in ups))
            proc.process.kill()  # SIGKILL in the middle of the turn
            await proc.process.wait()
        assert await _ends_stored(env, sid) == []
        for _ in range(3):
            async with agent(env) as (conn, rec, _):
                await conn.agent.resume_session(
                    s.ResumeSessionRequest.model_validate(
                        {"sessionId": sid, "cwd": "/tmp/project", "replayFrom": {"type": "start"}}
                    )
                )
                kinds = [u["sessionUpdate"] for u in rec.updates]
                assert kinds == ["user_message", "state_update", "state_update"]
                assert rec.updates[0]["messageId"] == mid
                assert rec.updates[1] == _end(mid)  # replayed
                assert rec.updates[2] == _end(mid)  # the snapshot agrees
                assert await prompt(conn, sid, "long [work:60]", KEY) == mid  # still recognised
            assert await _ends_stored(env, sid) == [_end(mid)]  # stored once
    assert await env.count(sid) == 1
    assert env.effect_lines(sid) == 0


async def test_a_tool_turn_replays_its_tool_call_on_a_fresh_process(env: Env) -> None:
    """The tool call of a `[tool]` turn and its update are retained with their `toolCallId`
    (A11): a fresh process replays them, in order, with the answer and the turn's end."""
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, live, _):
            sid = await new_session(conn)
            mid = await prompt(conn, sid, "deploy [tool]", KEY)
            await live.wait_for(lambda ups: any(u.get("stopReason") for u in ups))
        async with agent(env) as (conn, rec, _):
            await conn.agent.resume_session(
                s.ResumeSessionRequest.model_validate(
                    {"sessionId": sid, "cwd": "/tmp/project", "replayFrom": {"type": "start"}}
                )
            )
            replayed = rec.updates[:-1]  # the last one is the snapshot
    # what was sent live, less the transient `running` state, is what a replay shows
    expected = [u for u in live.updates if u.get("state") != "running"]
    assert replayed == expected
    kinds = [u["sessionUpdate"] for u in replayed]
    assert kinds == [
        "user_message",
        "tool_call_update",
        "tool_call_update",
        "agent_message",
        "state_update",
    ]
    tool_ids = {replayed[1]["toolCallId"], replayed[2]["toolCallId"]}
    assert len(tool_ids) == 1 and replayed[2]["status"] == "completed"
    assert replayed[4] == {
        "sessionUpdate": "state_update",
        "state": "idle",
        "stopReason": "end_turn",
        "_meta": {"acpOnce": {"messageId": mid}},
    }
    assert rec.updates[-1] == replayed[4]
    assert env.effect_lines(sid) == 1


async def test_a_tool_turn_replays_through_the_v1_face_on_a_fresh_process(env: Env) -> None:
    """The same history loaded by a v1 client (`session/load` on a fresh process): the tool
    call is replayed as v1's `tool_call` then `tool_call_update`, with the stored id."""
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, live, _):
            sid = await new_session(conn)
            await prompt(conn, sid, "deploy [tool]", KEY)
            await live.wait_for(lambda ups: any(u.get("stopReason") for u in ups))
        tool_id = next(u["toolCallId"] for u in live.updates if "toolCallId" in u)
        async with spawn(env.command()) as proc:
            frames = proc.frames

            async def call(id: int, method: str, params: dict[str, Any]) -> list[dict[str, Any]]:
                """Send one v1 request; every message received up to its answer."""
                request = {"jsonrpc": "2.0", "id": id, "method": method, "params": params}
                await frames.send(orjson.dumps(request))
                received = []
                while True:
                    frame = await frames.receive()
                    assert isinstance(frame, bytes)
                    received.append(orjson.loads(frame))
                    if received[-1].get("id") == id:
                        return received

            init = {"protocolVersion": 1, "clientCapabilities": {}}
            assert (await call(1, "initialize", init))[-1]["result"]["protocolVersion"] == 1
            load = {"sessionId": sid, "cwd": "/tmp/project", "mcpServers": []}
            received = await call(2, "session/load", load)
    assert received[-1] == {"jsonrpc": "2.0", "id": 2, "result": {}}
    updates = [m["params"]["update"] for m in received[:-1]]
    assert all(m["method"] == "session/update" for m in received[:-1])
    assert [u["sessionUpdate"] for u in updates] == [
        "user_message_chunk",
        "tool_call",
        "tool_call_update",
        "agent_message_chunk",
    ]
    assert updates[1]["toolCallId"] == updates[2]["toolCallId"] == tool_id
    assert updates[1]["status"] == "in_progress" and updates[2]["status"] == "completed"
    assert KEY.encode() not in orjson.dumps(received)


@pytest.mark.parametrize("interrupted", ["report", "continue"])
async def test_the_recovery_policy_over_stdio(env: Env, interrupted: str) -> None:
    """The agent dies right after inserting a keyed `[tool]` prompt (its turn never ran).
    `--interrupted continue`: the restarted agent runs the turn again, once (the tool's line
    written once, the turn ends `end_turn`), and a later restart runs nothing; `report`: the
    turn never runs, its interrupted end is the outcome every resume shows (A3)."""
    with anyio.fail_after(TIMEOUT):
        async with agent(env) as (conn, _, _):
            sid = await new_session(conn)
        async with agent(env, crash="after-insert") as (conn, _, _):
            await resume_start(conn, sid)
            with pytest.raises(ConnectionClosed):
                await prompt(conn, sid, "migrate [tool]", KEY)
        flag = ("--interrupted", interrupted)
        outcomes = []
        for _ in range(2):
            async with agent(env, *flag) as (conn, rec, _):
                await resume_start(conn, sid)
                mid = rec.user_messages()[0]
                # replayed, or sent live when the turn run again ends after the resume
                await rec.wait_for(lambda ups: bool(_ends(ups)))
                outcomes.append(_ends(rec.updates)[-1])
                assert await prompt(conn, sid, "migrate [tool]", KEY) == mid  # still recognised
    assert await env.count(sid) == 1
    if interrupted == "continue":
        done = {"sessionUpdate": "state_update", "state": "idle", "stopReason": "end_turn"}
        assert outcomes == [{**done, "_meta": {"acpOnce": {"messageId": mid}}}] * 2
        assert env.effect_lines(sid) == 1  # run again once, never after it ended
    else:
        assert outcomes == [_end(mid)] * 2
        assert env.effect_lines(sid) == 0  # never run
    assert await _ends_stored(env, sid) == [outcomes[0]]


async def resume_start(conn: ClientSideConnection, sid: str) -> None:
    await conn.agent.resume_session(
        s.ResumeSessionRequest.model_validate(
            {"sessionId": sid, "cwd": "/tmp/project", "replayFrom": {"type": "start"}}
        )
    )


def _ends(updates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [u for u in updates if u["sessionUpdate"] == "state_update" and "_meta" in u]
