"""Zed's Codex agent (codex-acp 0.16.0, a real third-party v1 agent) behind the upgrade runtime.

`acp-once agent --runtime v1 --store URL -- codex-acp` runs over real pipes, driven by our v2
client; Codex talks to the scripted model of `model_server.py` on 127.0.0.1 and really runs the
tools it is told to (`echo LINE >> log.txt` in the session's directory, an `apply_patch`). Each
test checks what the client sees, what the store holds, what the model was asked and what the
tool did: a keyed prompt is one user message with one id, and its tool runs once.

Codex does not exit on stdin EOF: `upgraded()` stops the Codex processes a runtime started
(see `tests/codex/harness.py`) before the runtime itself is stopped.
"""

from __future__ import annotations

import re
import shutil
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
from acp_once.storage import open_store
from acp_once.transports.stdio import AgentProcess, spawn
from tests.codex.harness import codex_env, codex_pids, stop_codex, wait_gone
from tests.codex.model_server import ModelServer, user_texts
from tests.helpers import UpdateRecorder, initialize_request
from tests.upgrade.test_upgrade_sdk import PermissionClient, prompt_params, wait_idle

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 30
KEY = "codex-key-3f9a61d0-5b2e"


class Env:
    """One test's files: the store, Codex's home, the session's directory with its log."""

    def __init__(self, tmp: Path, model: ModelServer, codex: str, store: str) -> None:
        self.home = tmp / "codex-home"
        self.work = tmp / "work"
        self.work.mkdir()
        self.log = self.work / "log.txt"
        self.store = store
        self.stderr = tmp / "runtime.stderr"
        self.model = model
        self.codex = codex
        self.env = codex_env(self.home, model.base_url)
        self.child = [codex]

    def command(self) -> list[str]:
        runtime = [sys.executable, "-m", "acp_once", "agent", "--runtime", "v1"]
        return [*runtime, "--store", self.store, "--", *self.child]

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    async def count(self, session_id: str, key: str | None = None) -> int:
        async with open_store(self.store) as store:
            return await store.count_user_messages(session_id, idempotency_key=key)

    async def blocked(self) -> None:
        """Wait until the model has stalled an answer (`block`, `run+block:`)."""
        assert await anyio.to_thread.run_sync(self.model.blocked.wait, TIMEOUT)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:{tmp_path / 'sessions.sqlite3'}"
    dsn = request.getfixturevalue("postgres_dsn")
    return f"{dsn}?schema={request.getfixturevalue('new_schema')()}"


@pytest.fixture
def env(tmp_path: Path, model: ModelServer, codex_bin: str) -> Env:
    return Env(tmp_path, model, codex_bin, f"sqlite:{tmp_path / 'sessions.sqlite3'}")


@asynccontextmanager
async def upgraded(
    env: Env, client: UpdateRecorder | None = None
) -> AsyncIterator[tuple[ClientSideConnection, UpdateRecorder, AgentProcess]]:
    recorder = client or UpdateRecorder()
    with open(env.stderr, "ab") as errfile:  # noqa: ASYNC230 (opening a log file for the child)
        async with spawn(env.command(), env=env.env, stderr=errfile.fileno()) as proc:
            try:
                async with ClientSideConnection(recorder, proc.frames) as conn:
                    await conn.agent.initialize(initialize_request("codex-tests"))
                    yield conn, recorder, proc
            finally:
                # Codex ignores its stdin's end: stopped here, or the runtime would wait for it
                await stop_codex(env.home)


async def new_session(conn: ClientSideConnection, env: Env) -> str:
    return (await conn.agent.new_session(s.NewSessionRequest(cwd=str(env.work)))).session_id


async def resume(conn: ClientSideConnection, env: Env, sid: str, *, replay: bool = False) -> None:
    params: dict[str, Any] = {"sessionId": sid, "cwd": str(env.work)}
    if replay:
        params["replayFrom"] = {"type": "start"}
    await conn.agent.resume_session(s.ResumeSessionRequest.model_validate(params))


async def prompt(conn: ClientSideConnection, sid: str, text: str, key: str | None = None) -> str:
    result = await conn.rpc.request("session/prompt", prompt_params(sid, text, key))
    assert isinstance(result, dict) and isinstance(result["messageId"], str)
    return result["messageId"]


def texts(rec: UpdateRecorder) -> str:
    return "".join(
        u["content"]["text"] for u in rec.updates if u["sessionUpdate"] == "agent_message_chunk"
    )


def assert_private(env: Env) -> None:
    """The key reached neither Codex, nor its model, nor a log."""
    assert KEY not in (env.model.log_path or Path()).read_text()
    assert KEY not in env.stderr.read_text()


async def test_a_keyed_tool_turn_retried_and_resumed_runs_its_tool_once(
    tmp_path: Path, model: ModelServer, codex_bin: str, store: str
) -> None:
    """Retried on the same connection, then after `session/resume` on a new connection (a
    restarted runtime whose Codex loads the session): one user message, one id, one line; the
    next turn's model request holds the earlier conversation."""
    env = Env(tmp_path, model, codex_bin, store)
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            sid = await new_session(conn, env)
            first = await prompt(conn, sid, "run: echo one >> log.txt", KEY)
            assert await prompt(conn, sid, "run: echo one >> log.txt", KEY) == first
            (idle,) = await wait_idle(rec)
            assert idle["stopReason"] == "end_turn"
            assert rec.user_messages() == [first]
            assert texts(rec) == "ran: echo one >> log.txt"
            tools = [u for u in rec.updates if u["sessionUpdate"] == "tool_call_update"]
            assert [(t.get("kind"), t["status"]) for t in tools] == [
                ("execute", "in_progress"),
                (None, "completed"),
            ]
        assert len(model.requests) == 2  # the tool call, then the answer after its output
        async with upgraded(env) as (conn, rec, _):
            await resume(conn, env, sid)
            assert await prompt(conn, sid, "run: echo one >> log.txt", KEY) == first
            assert rec.user_messages() == []  # nothing new inserted or announced
            await prompt(conn, sid, "second")
            (idle,) = await wait_idle(rec)
            assert idle["stopReason"] == "end_turn"
    assert env.lines() == ["one"]
    assert await env.count(sid) == 2 and await env.count(sid, KEY) == 1
    # Codex was re-attached with session/load: its model sees the earlier conversation
    assert user_texts(model.requests[-1])[-2:] == ["run: echo one >> log.txt", "second"]
    assert_private(env)


async def test_a_keyed_tool_turn_after_sigkill_and_restart_runs_its_tool_once(
    tmp_path: Path, model: ModelServer, codex_bin: str, store: str
) -> None:
    """SIGKILL of the runtime after the tool ran, mid-turn; restart, resume, retry: the same id,
    the interrupted turn reported once, the line appended once; Codex loads the session and the
    next turn's model request holds the interrupted one."""
    env = Env(tmp_path, model, codex_bin, store)
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, proc):
            sid = await new_session(conn, env)
            first = await prompt(conn, sid, "run+block: echo two >> log.txt", KEY)
            await env.blocked()  # the tool ran, the model's answer stalls
            assert env.lines() == ["two"]
            running = codex_pids(env.home)
            assert running  # Codex, stuck in its turn
            proc.process.kill()
            await proc.process.wait()
            # Codex's group dies with the runtime (the launcher's parent-death signal), although
            # Codex ignores the end of its stdin: gone within the acceptance bound of 5 s
            await wait_gone(running, 5.0)
        model.release()
        async with upgraded(env) as (conn, rec, _):
            await resume(conn, env, sid, replay=True)
            assert rec.user_messages() == [first]
            state = [u for u in rec.updates if u["sessionUpdate"] == "state_update"][-1]
            assert state["stopReason"] == "error"
            assert state["error"]["message"] == INTERRUPTED_MESSAGE
            assert await prompt(conn, sid, "run+block: echo two >> log.txt", KEY) == first
            after = await prompt(conn, sid, "after")
            # the replay and the snapshot hold the interrupted turn's end; this turn ends its own
            assert (await rec.turn_end(after))["stopReason"] == "end_turn"
            assert texts(rec).endswith("ok: after")
    assert env.lines() == ["two"]
    assert await env.count(sid) == 2 and await env.count(sid, KEY) == 1
    assert user_texts(model.requests[-1])[-2:] == ["run+block: echo two >> log.txt", "after"]
    assert_private(env)


async def test_a_keyed_tool_turn_held_behind_another_runs_its_tool_once(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            sid = await new_session(conn, env)
            await prompt(conn, sid, "block")
            await env.blocked()
            params = prompt_params(sid, "run: echo held >> log.txt", KEY)
            first = await conn.rpc.start_request("session/prompt", params)
            retry = await conn.rpc.start_request("session/prompt", params)
            env.model.release()
            a, b = await first.result(), await retry.result()
            assert a == b
            await rec.wait_for(lambda _: "ran: echo held" in texts(rec))
            assert (await rec.turn_end(a["messageId"]))["stopReason"] == "end_turn"  # A10
            assert len(rec.user_messages()) == 2
    assert env.lines() == ["held"]
    assert await env.count(sid, KEY) == 1
    assert_private(env)


async def test_apply_patch_creates_a_file_once(env: Env) -> None:
    patch = "patch: *** Begin Patch\n*** Add File: made.txt\n+made by codex\n*** End Patch"
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            sid = await new_session(conn, env)
            first = await prompt(conn, sid, patch, KEY)
            (idle,) = await wait_idle(rec)
            assert idle["stopReason"] == "end_turn"
            assert await prompt(conn, sid, patch, KEY) == first
    assert (env.work / "made.txt").read_text() == "made by codex\n"
    tools = [u for u in rec.updates if u["sessionUpdate"] == "tool_call_update"]
    assert [(t.get("kind"), t["status"]) for t in tools] == [
        ("edit", "in_progress"),
        (None, "completed"),
    ]
    assert texts(rec) == "patched"
    outputs = [i for r in env.model.requests for i in r["input"]]
    done = [i for i in outputs if i.get("type") == "custom_tool_call_output"]
    assert len(done) == 1 and "A made.txt" in done[0]["output"]


async def test_a_permission_request_is_approved_through_the_v2_face(
    tmp_path: Path, model: ModelServer, codex_bin: str
) -> None:
    env = Env(tmp_path, model, codex_bin, f"sqlite:{tmp_path / 'sessions.sqlite3'}")
    env.env = codex_env(env.home, model.base_url, approval_policy="untrusted")
    client = PermissionClient("approved")
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env, client=client) as (conn, rec, _):
            sid = await new_session(conn, env)
            await prompt(conn, sid, "run: echo allowed >> log.txt", KEY)
            (idle,) = await wait_idle(rec)
            assert idle["stopReason"] == "end_turn"
    (asked,) = client.asked
    assert asked["sessionId"] == sid  # the v2 session, not Codex's
    assert asked["title"] == "echo allowed >> log.txt"
    assert "approved" in [o["optionId"] for o in asked["options"]]
    assert env.lines() == ["allowed"]  # run only after the approval


async def test_cancel_mid_turn_ends_it_cancelled_and_the_session_goes_on(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            sid = await new_session(conn, env)
            await prompt(conn, sid, "block", KEY)
            await env.blocked()
            await conn.agent.cancel(s.CancelSessionNotification(session_id=sid))
            (idle,) = await wait_idle(rec)
            assert idle["stopReason"] == "cancelled"
            await prompt(conn, sid, "run: echo after >> log.txt")
            assert (await wait_idle(rec, 2))[-1]["stopReason"] == "end_turn"
    assert env.lines() == ["after"]
    assert "released" not in texts(rec)  # the stalled answer never reached the client


async def test_codex_connects_to_the_loopback_model_only(env: Env) -> None:
    """Every connect() of Codex and its tools, traced by strace: IP ones go to 127.0.0.1."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.fail("strace is needed (.ci/run installs it: apt-get install -y strace)")
    trace = env.work.parent / "connect.trace"
    env.child = [strace, "-f", "-qq", "-e", "trace=connect", "-o", str(trace), env.codex]
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env) as (conn, rec, _):
            sid = await new_session(conn, env)
            await prompt(conn, sid, "run: echo traced >> log.txt")
            (idle,) = await wait_idle(rec)
            assert idle["stopReason"] == "end_turn"
    assert env.lines() == ["traced"]
    calls = [line for line in trace.read_text().splitlines() if "connect(" in line]
    ip = [line for line in calls if "AF_INET" in line]
    port = env.model.base_url.split(":")[2].split("/")[0]
    assert ip and all('inet_addr("127.0.0.1")' in line for line in ip), ip
    assert any(f"htons({port})" in line for line in ip)
    others = {re.sub(r"^\d+ ", "", line).split("{")[1].split(",")[0] for line in calls}
    assert others <= {"sa_family=AF_INET", "sa_family=AF_UNIX"}, others


async def test_a_permission_request_rejected_through_the_v2_face_runs_nothing(
    tmp_path: Path, model: ModelServer, codex_bin: str
) -> None:
    env = Env(tmp_path, model, codex_bin, f"sqlite:{tmp_path / 'sessions.sqlite3'}")
    env.env = codex_env(env.home, model.base_url, approval_policy="untrusted")
    client = PermissionClient("abort")
    with anyio.fail_after(TIMEOUT):
        async with upgraded(env, client=client) as (conn, rec, _):
            sid = await new_session(conn, env)
            await prompt(conn, sid, "run: echo refused >> log.txt", KEY)
            (idle,) = await wait_idle(rec)
    assert len(client.asked) == 1
    assert env.lines() == []  # the command never ran
    assert idle["stopReason"] == "cancelled"  # Codex's "abort" ends its turn
