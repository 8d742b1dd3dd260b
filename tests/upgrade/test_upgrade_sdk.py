"""The upgrade runtime against a v1 agent written with the official Python SDK 0.12.1.

`acp-once agent --runtime v1 --store sqlite:... -- python tests/agents/sdk_v1_effects_agent.py`
runs over real pipes, driven by our v2 client; the SDK agent appends one line per prompt it
receives to its effects file, so the tests count how often work reached it. Each test checks
what the client sees, what the store holds and what the child was asked: the RFD's keyed
traces (T1 retry on one connection, T2 after resume on a new connection, T3 after SIGKILL and
restart, T4 while held, T5 after an error, T6 another session, T7 inserted during work),
cancel and a permission request round trip.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.agent.runtime import INTERRUPTED_MESSAGE
from acp_once.client import ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.protocol.errors import REQUEST_CANCELLED, AcpError
from acp_once.storage import open_store
from acp_once.transports.stdio import AgentProcess, spawn
from tests.helpers import UpdateRecorder, initialize_request

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 30
KEY = "upgrade-key-7d1c2b9e-0a4f"
SDK_AGENT = Path(__file__).parents[1] / "agents" / "sdk_v1_effects_agent.py"
CWD = "/tmp/project"


class PermissionClient(UpdateRecorder):
    """Records updates and answers every permission request with `choice`."""

    def __init__(self, choice: str = "allow_once") -> None:
        super().__init__()
        self.choice = choice
        self.asked: list[dict[str, Any]] = []

    async def request_permission(
        self, params: s.RequestPermissionRequest, connection: ClientSideConnection
    ) -> s.RequestPermissionResponse:
        self.asked.append(params.model_dump(by_alias=True, exclude_unset=True))
        return s.RequestPermissionResponse.model_validate(
            {"outcome": {"outcome": "selected", "optionId": self.choice}}
        )


class Env:
    def __init__(self, tmp: Path, *, load: bool) -> None:
        self.store = f"sqlite:{tmp / 'sessions.sqlite3'}"
        self.effects = tmp / "effects.log"
        self.state = tmp / "v1-state.json"
        self.gates = tmp / "gates"
        self.gates.mkdir()
        self.stderr = tmp / "agent.stderr"
        self.load = load

    def command(self, *extra: str) -> list[str]:
        child = [sys.executable, str(SDK_AGENT), "--effects", str(self.effects)]
        child += ["--gates", str(self.gates)]
        if self.load:
            child += ["--load", "--state", str(self.state)]
        return [
            sys.executable,
            "-m",
            "acp_once",
            "agent",
            "--runtime",
            "v1",
            "--store",
            self.store,
            *extra,
            "--",
            *child,
        ]

    def open_gate(self, name: str) -> None:
        (self.gates / name).touch()

    def effects_lines(self) -> list[str]:
        return self.effects.read_text().splitlines() if self.effects.exists() else []

    async def count(self, session_id: str, key: str | None = None) -> int:
        async with open_store(self.store) as store:
            return await store.count_user_messages(session_id, idempotency_key=key)


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path, load=True)


@asynccontextmanager
async def upgraded(
    env: Env, *extra: str, client: UpdateRecorder | None = None
) -> AsyncIterator[tuple[ClientSideConnection, UpdateRecorder, AgentProcess]]:
    recorder = client or UpdateRecorder()
    with open(env.stderr, "ab") as errfile:  # noqa: ASYNC230 (opening a log file for the child)
        async with (
            spawn(env.command(*extra), stderr=errfile.fileno()) as proc,
            ClientSideConnection(recorder, proc.frames) as conn,
        ):
            await conn.agent.initialize(initialize_request("upgrade-tests"))
            yield conn, recorder, proc


async def new_session(conn: ClientSideConnection) -> str:
    return (await conn.agent.new_session(s.NewSessionRequest(cwd=CWD))).session_id


async def resume(conn: ClientSideConnection, session_id: str, *, replay: bool = False) -> None:
    params: dict[str, Any] = {"sessionId": session_id, "cwd": CWD}
    if replay:
        params["replayFrom"] = {"type": "start"}
    await conn.agent.resume_session(s.ResumeSessionRequest.model_validate(params))


def prompt_params(session_id: str, text: str, key: str | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}
    if key is not None:
        params["idempotencyKey"] = key
    return params


async def prompt(
    conn: ClientSideConnection, session_id: str, text: str, key: str | None = None
) -> str:
    result = await conn.rpc.request("session/prompt", prompt_params(session_id, text, key))
    assert isinstance(result, dict)
    message_id = result["messageId"]
    assert isinstance(message_id, str)
    return message_id


def idles(rec: UpdateRecorder) -> list[dict[str, Any]]:
    """The idle updates that end a turn whose user message this recorder saw announced (a
    resume's snapshot repeats the end of an earlier turn: not counted)."""
    announced: set[str] = set()
    ends = []
    for u in rec.updates:
        if u["sessionUpdate"] == "user_message":
            announced.add(u["messageId"])
        elif (
            u["sessionUpdate"] == "state_update"
            and u["state"] == "idle"
            and "stopReason" in u
            and u.get("_meta", {}).get("acpOnce", {}).get("messageId") in announced
        ):
            ends.append(u)
    return ends


async def wait_idle(rec: UpdateRecorder, count: int = 1) -> list[dict[str, Any]]:
    await rec.wait_for(lambda _: len(idles(rec)) >= count)
    return idles(rec)


async def wait_text(rec: UpdateRecorder, text: str) -> None:
    def seen(updates: list[dict[str, Any]]) -> bool:
        return any(
            u["sessionUpdate"] == "agent_message_chunk" and u["content"].get("text") == text
            for u in updates
        )

    await rec.wait_for(seen)


def child_sessions(env: Env) -> list[str]:
    """The child's session id of each prompt it received, in order."""
    return [line.split(" ", 1)[0] for line in env.effects_lines()]


async def test_t1_keyed_retry_on_one_connection(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            sid = await new_session(conn)
            first = await prompt(conn, sid, "deploy [tool]", KEY)
            second = await prompt(conn, sid, "deploy [tool]", KEY)
            assert first == second and first.startswith("msg_user_")
            (idle,) = await wait_idle(rec)
            assert idle["stopReason"] == "end_turn"
            assert rec.user_messages() == [first]
            chunks = [u for u in rec.updates if u["sessionUpdate"] == "agent_message_chunk"]
            assert [c["content"]["text"] for c in chunks] == ["echo: ", "deploy [tool]"]
            assert len({c["messageId"] for c in chunks}) == 1  # one message, our id
            tools = [u for u in rec.updates if u["sessionUpdate"] == "tool_call_update"]
            assert [t.get("status") for t in tools] == ["in_progress", "completed"]
            # the stored conversation: the whole message, under the id its chunks had
            replay = UpdateRecorder()
            async with upgraded(env, client=replay) as (again, _, _):
                await resume(again, sid, replay=True)
            whole = [u for u in replay.updates if u["sessionUpdate"] == "agent_message"]
            assert whole == [
                {
                    "sessionUpdate": "agent_message",
                    "messageId": chunks[0]["messageId"],
                    "content": [{"type": "text", "text": "echo: deploy [tool]"}],
                }
            ]
            assert [u["sessionUpdate"] for u in replay.updates].count("user_message") == 1
    assert await env.count(sid) == 1
    assert await env.count(sid, KEY) == 1
    assert env.effects_lines() == [f"{child_sessions(env)[0]} deploy [tool]"]
    # the key never reached the child nor any log
    assert KEY not in env.effects.read_text() + env.stderr.read_text()


async def test_t2_keyed_retry_after_resume_on_a_new_connection(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            sid = await new_session(conn)
            first = await prompt(conn, sid, "hello", KEY)
            await wait_idle(rec)
        async with upgraded(env) as (conn, rec, _):
            await resume(conn, sid)
            assert await prompt(conn, sid, "hello", KEY) == first
            assert rec.user_messages() == []  # nothing new was inserted or announced
            await prompt(conn, sid, "next")
            await wait_idle(rec)
    assert await env.count(sid) == 2
    assert len(env.effects_lines()) == 2  # "hello" once, "next" once
    # the restarted child loaded the same v1 session (the SDK agent advertises loadSession)
    assert len(set(child_sessions(env))) == 1


@pytest.mark.parametrize("load", [True, False], ids=["loadSession", "no-loadSession"])
async def test_t3_keyed_retry_after_sigkill_and_restart(tmp_path: Path, load: bool) -> None:
    await sigkill_trace(Env(tmp_path, load=load), load)


@pytest.mark.postgres
async def test_t3_on_postgresql(tmp_path: Path, postgres_dsn: str, new_schema: Any) -> None:
    """The same trace on a PostgreSQL store (the v1 session id kept there too)."""
    env = Env(tmp_path, load=True)
    env.store = f"{postgres_dsn}?schema={new_schema()}"
    await sigkill_trace(env, True)


async def sigkill_trace(env: Env, load: bool) -> None:
    """T3: SIGKILL mid-turn, restart twice (the interrupted turn's end stored once, shown on
    every resume: A10), retry."""
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, proc):
            sid = await new_session(conn)
            first = await prompt(conn, sid, "work [wait:never]", KEY)
            await wait_text(rec, "waiting never")  # the child is in the turn
            proc.process.kill()  # SIGKILL the whole upgraded agent mid-turn
            await proc.process.wait()
        for _ in range(2):
            async with upgraded(env) as (conn, rec, _):
                await resume(conn, sid, replay=True)
                assert rec.user_messages() == [first]  # one user message in the history
                states = [u for u in rec.updates if u["sessionUpdate"] == "state_update"]
                assert len(states) == 2  # the replayed end record, then the snapshot
                for state in states:  # the documented error stop, on every resume
                    assert state["state"] == "idle"
                    assert state["stopReason"] == "error"
                    assert state["error"]["message"] == INTERRUPTED_MESSAGE
                    assert state["_meta"] == {"acpOnce": {"messageId": first}}
                assert await prompt(conn, sid, "work [wait:never]", KEY) == first
        async with upgraded(env) as (conn, rec, _):
            await resume(conn, sid)
            await prompt(conn, sid, "after")
            (idle,) = await wait_idle(rec)
            assert idle["stopReason"] == "end_turn"
    assert await env.count(sid) == 2
    assert await env.count(sid, KEY) == 1
    lines = env.effects_lines()
    assert [line.split(" ", 1)[1] for line in lines] == ["work [wait:never]", "after"]
    before, after = child_sessions(env)
    # with loadSession the child's session is re-attached; without it a new one is started
    assert (before == after) is load
    if not load:
        assert "without the earlier conversation" in env.stderr.read_text()


async def test_t4_retry_while_held_gets_the_same_outcome(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            sid = await new_session(conn)
            await prompt(conn, sid, "long [wait:g4]")
            await wait_text(rec, "waiting g4")
            first = await conn.rpc.start_request("session/prompt", prompt_params(sid, "held", KEY))
            retry = await conn.rpc.start_request("session/prompt", prompt_params(sid, "held", KEY))
            env.open_gate("g4")
            a, b = await first.result(), await retry.result()
            assert a == b
            await wait_text(rec, "held")
            # one idle, after both turns: the first one's is not sent while another waits
            await wait_idle(rec)
            assert len(rec.user_messages()) == 2
    assert await env.count(sid, KEY) == 1
    assert [line.split(" ", 1)[1] for line in env.effects_lines()] == ["long [wait:g4]", "held"]


async def test_t5_retry_after_an_error(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            sid = await new_session(conn)
            # an error before insertion (the held prompt withdrawn) leaves the key unused
            await prompt(conn, sid, "long [wait:g5]")
            await wait_text(rec, "waiting g5")
            held = await conn.rpc.start_request("session/prompt", prompt_params(sid, "x", KEY))
            await held.cancel()
            with pytest.raises(AcpError) as info:
                await held.result()
            assert info.value.code == REQUEST_CANCELLED
            env.open_gate("g5")
            await wait_idle(rec)
            inserted = await prompt(conn, sid, "x", KEY)
            await wait_idle(rec, 2)
            # an error after insertion (the child failed the turn): a retry is a retry
            failed = await prompt(conn, sid, "boom [fail]", KEY + "-2")
            idle = (await wait_idle(rec, 3))[-1]
            assert idle["stopReason"] == "error"
            assert idle["error"]["message"] == "The turn failed (V1TurnFailed)"
            assert await prompt(conn, sid, "boom [fail]", KEY + "-2") == failed
            assert await prompt(conn, sid, "x", KEY) == inserted
    assert await env.count(sid, KEY) == 1
    texts = [line.split(" ", 1)[1] for line in env.effects_lines()]
    assert texts == ["long [wait:g5]", "x", "boom [fail]"]


async def test_a_child_that_dies_is_started_again_and_its_session_loaded(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            sid = await new_session(conn)
            died = await prompt(conn, sid, "bye [die]", KEY)
            (idle,) = await wait_idle(rec)
            assert idle["stopReason"] == "error"
            assert idle["error"]["message"] == "The turn failed (V1AgentExited)"
            assert await prompt(conn, sid, "bye [die]", KEY) == died  # not sent again
            await prompt(conn, sid, "after")
            assert (await wait_idle(rec, 2))[-1]["stopReason"] == "end_turn"
    assert [line.split(" ", 1)[1] for line in env.effects_lines()] == ["bye [die]", "after"]
    assert len(set(child_sessions(env))) == 1  # the new child loaded the session
    assert "the v1 agent exited" in env.stderr.read_text()


async def test_a_keyed_slash_command_is_stored_and_reaches_the_child_once(env: Env) -> None:
    """A `/command` is the child's (v1 agents advertise them), not a live-only prompt: it is
    stored with its key like any prompt. Trace: a keyed `/compact now` runs its turn; the same
    key again on that connection; the upgrade runtime stops (its connection with it) and a new
    one starts on the same store; resume, the same key again. Property: every answer is the
    first message id, the store holds the message once with its key, and the child received
    the command once (a command kept only in memory would reach it again after the restart)."""
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            sid = await new_session(conn)
            first = await prompt(conn, sid, "/compact now", KEY)
            (idle,) = await wait_idle(rec)
            assert idle["stopReason"] == "end_turn"
            assert await prompt(conn, sid, "/compact now", KEY) == first
        async with upgraded(env) as (conn, rec, _):
            await resume(conn, sid)
            assert await prompt(conn, sid, "/compact now", KEY) == first
            assert rec.user_messages() == []  # nothing new was inserted or announced
    assert await env.count(sid, KEY) == 1
    assert [line.split(" ", 1)[1] for line in env.effects_lines()] == ["/compact now"]


async def test_t6_same_key_in_another_session(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            a, b = await new_session(conn), await new_session(conn)
            in_a = await prompt(conn, a, "same", KEY)
            in_b = await prompt(conn, b, "same", KEY)
            assert in_a != in_b
            await wait_idle(rec, 2)
    assert await env.count(a, KEY) == 1 and await env.count(b, KEY) == 1
    assert len(set(child_sessions(env))) == 2  # one v1 session per v2 session


async def test_t7_retry_of_a_prompt_steered_in_during_work(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env, "--policy", "steer") as (conn, rec, _):
            sid = await new_session(conn)
            long = await prompt(conn, sid, "long [wait:g7]")
            await wait_text(rec, "waiting g7")
            steered = await prompt(conn, sid, "steer [tool]", KEY)  # answered mid-turn
            assert await prompt(conn, sid, "steer [tool]", KEY) == steered
            env.open_gate("g7")
            await wait_text(rec, "steer [tool]")
            # each turn ends on its own, tagged with its message (A10)
            assert (await rec.turn_end(steered))["stopReason"] == "end_turn"
            assert (await rec.turn_end(long))["stopReason"] == "end_turn"
    assert await env.count(sid, KEY) == 1
    # the child got one prompt at a time: the steered one after the first turn ended
    assert [line.split(" ", 1)[1] for line in env.effects_lines()] == [
        "long [wait:g7]",
        "steer [tool]",
    ]


async def test_cancel_reaches_the_child_and_ends_the_turn_cancelled(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            sid = await new_session(conn)
            await prompt(conn, sid, "long [wait:never]", KEY)
            await wait_text(rec, "waiting never")
            await conn.agent.cancel(s.CancelSessionNotification(session_id=sid))
            (idle,) = await wait_idle(rec)
            assert idle["stopReason"] == "cancelled"
            await prompt(conn, sid, "next")
            assert (await wait_idle(rec, 2))[-1]["stopReason"] == "end_turn"
    assert len(env.effects_lines()) == 2


async def test_permission_request_round_trip(env: Env) -> None:
    client = PermissionClient("reject_once")
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env, client=client) as (conn, rec, _):
            sid = await new_session(conn)
            await prompt(conn, sid, "may I [permission]", KEY)
            (idle,) = await wait_idle(rec)
            assert idle["stopReason"] == "end_turn"
    (asked,) = client.asked
    assert asked["sessionId"] == sid  # the v2 session, not the child's
    assert asked["title"] == "write"
    assert [o["optionId"] for o in asked["options"]] == ["allow_once", "reject_once"]
    texts = [
        u["content"]["text"] for u in client.updates if u["sessionUpdate"] == "agent_message_chunk"
    ]
    assert texts == ["echo: ", "permission: reject_once"]


async def test_the_child_gets_no_file_system_from_the_client(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            sid = await new_session(conn)
            await prompt(conn, sid, "read [fs]")
            await wait_text(rec, "fs: error -32601")
            (idle,) = await wait_idle(rec)
            assert idle["stopReason"] == "end_turn"


async def test_a_missing_command_or_one_that_fails_is_reported(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "acp_once", "agent", "--runtime", "v1"]
    store = ["--store", f"sqlite:{tmp_path / 's.db'}"]
    with anyio.fail_after(TIMEOUT):
        missing = await anyio.run_process(base + store, check=False)
        assert missing.returncode == 2
        assert b"give the v1 agent's command after --" in missing.stderr
        broken = await anyio.run_process(
            [*base, *store, "--", sys.executable, "-c", "import sys; sys.exit(3)"],
            check=False,
            stdin=None,
        )
        assert broken.returncode == 1
        assert b"v1 agent" in broken.stderr
        stray = await anyio.run_process(
            [sys.executable, "-m", "acp_once", "agent", *store, "--", "x"], check=False
        )
        assert stray.returncode == 2
