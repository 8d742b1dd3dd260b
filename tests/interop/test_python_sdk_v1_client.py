"""The official Python SDK's client (`agent-client-protocol` 0.12.1, import `acp`, ACP v1) against
`acp-once agent` (the reference agent, a real subprocess over its stdin and stdout): the
agent negotiates v1 at `initialize` and serves the SDK in v1 (its v1 face).

Also: a v1 client (the SDK) and a v2 client (acp-once's `ClientSideConnection`) use one SQLite
session in turn, each in a process of its own, and see the same conversation; and the
LangGraph adapter (`acp-once agent --runtime langgraph`) serves the SDK in v1 as well.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import acp
import anyio
import pytest
from acp import schema

from acp_once.client import ClientSideConnection
from acp_once.client.launchers import StdioLauncher
from acp_once.protocol import schema as s
from tests.helpers import UpdateRecorder, initialize_request

pytestmark = pytest.mark.anyio

TIMEOUT = 30
KEY = "python-sdk-v1-interop-key"


class SdkClient:
    """What the SDK's client needs of us: it keeps every update (as v1 wire dicts)."""

    def __init__(self) -> None:
        self.updates: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()

    def on_connect(self, conn: Any) -> None:
        return None

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        self.updates.append(update.model_dump(by_alias=True, exclude_none=True, mode="json"))
        self.arrived.set()

    async def request_permission(self, *args: Any, **kwargs: Any) -> Any:
        raise acp.RequestError.method_not_found("session/request_permission")

    async def wait_for(self, kind: str, **fields: Any) -> dict[str, Any]:
        while True:
            for update in self.updates:
                if update["sessionUpdate"] == kind and all(
                    update.get(k) == v for k, v in fields.items()
                ):
                    return update
            self.arrived.clear()
            await self.arrived.wait()

    def texts(self, kind: str) -> list[str]:
        return [u["content"]["text"] for u in self.updates if u["sessionUpdate"] == kind]


def agent_command(store: str, tmp_path: Path) -> list[str]:
    effects = str(tmp_path / "effects")
    return [sys.executable, "-m", "acp_once", "agent", "--store", store, "--side-effects", effects]


@asynccontextmanager
async def sdk_client(
    command: list[str], client: SdkClient
) -> AsyncIterator[acp.client.ClientSideConnection]:
    # the SDK's `Client` protocol lists every client method; the reference agent calls only
    # the two this one implements
    spawned = acp.spawn_agent_process(cast(acp.Client, client), command[0], *command[1:])
    async with spawned as (conn, _process):
        init = await conn.initialize(
            protocol_version=1,
            client_info=schema.Implementation(name="sdk-client", version="0.12.1"),
        )
        assert init.protocol_version == 1
        yield conn


def text_prompt(text: str) -> list[Any]:
    return [schema.TextContentBlock(type="text", text=text)]


async def test_the_sdk_client_runs_a_whole_turn_with_streamed_chunks(tmp_path: Path) -> None:
    client = SdkClient()
    with anyio.fail_after(TIMEOUT):
        async with sdk_client(agent_command("memory", tmp_path), client) as conn:
            init = await conn.initialize(protocol_version=1)
            assert init.agent_capabilities is not None
            assert init.agent_capabilities.load_session is True
            assert init.agent_info is not None and init.agent_info.name == "acp-once-reference"
            session = await conn.new_session(cwd=str(tmp_path))
            done = await conn.prompt(session_id=session.session_id, prompt=text_prompt("hi [tool]"))
            assert done.stop_reason == "end_turn"
    kinds = [u["sessionUpdate"] for u in client.updates]
    # the tool call is created, then updated; the reply is a streamed chunk; the user's own
    # message is not echoed and v2's state updates are not sent
    assert kinds == ["tool_call", "tool_call_update", "agent_message_chunk"]
    assert client.updates[0]["title"] == "append to the side-effect log"
    assert client.updates[1]["status"] == "completed"
    assert client.texts("agent_message_chunk") == ["hi [tool]"]
    (log,) = (tmp_path / "effects").iterdir()
    assert len(log.read_text().split()) == 1  # the tool ran once


async def test_the_sdk_clients_cancel_ends_the_turn_cancelled(tmp_path: Path) -> None:
    client = SdkClient()
    with anyio.fail_after(TIMEOUT):
        async with sdk_client(agent_command("memory", tmp_path), client) as conn:
            session = await conn.new_session(cwd=str(tmp_path))
            turn = asyncio.ensure_future(
                conn.prompt(session_id=session.session_id, prompt=text_prompt("[tool] [work:60]"))
            )
            # the tool call completes before the turn's long work starts
            await client.wait_for("tool_call_update", status="completed")
            assert not turn.done()
            await conn.cancel(session_id=session.session_id)
            assert (await turn).stop_reason == "cancelled"
            again = await conn.prompt(session_id=session.session_id, prompt=text_prompt("after"))
            assert again.stop_reason == "end_turn"


async def test_the_sdk_clients_session_load_replays_the_history(tmp_path: Path) -> None:
    store = f"sqlite:{tmp_path / 'sessions.db'}"
    first, second = SdkClient(), SdkClient()
    with anyio.fail_after(TIMEOUT):
        async with sdk_client(agent_command(store, tmp_path), first) as conn:
            sid = (await conn.new_session(cwd=str(tmp_path))).session_id
            for text in ("one", "two"):
                done = await conn.prompt(session_id=sid, prompt=text_prompt(text))
                assert done.stop_reason == "end_turn"
        # a new agent process on the same store
        async with sdk_client(agent_command(store, tmp_path), second) as conn:
            loaded = await conn.load_session(cwd=str(tmp_path), session_id=sid)
            assert loaded is not None
            assert second.texts("user_message_chunk") == ["one", "two"]
            assert second.texts("agent_message_chunk") == ["one", "two"]
            kinds = [u["sessionUpdate"] for u in second.updates]
            assert kinds == ["user_message_chunk", "agent_message_chunk"] * 2
            done = await conn.prompt(session_id=sid, prompt=text_prompt("three"))
            assert done.stop_reason == "end_turn"


def conversation_v2(updates: list[dict[str, Any]]) -> list[tuple[str, str]]:
    roles = {"user_message": "user", "agent_message": "agent"}
    return [
        (roles[u["sessionUpdate"]], u["content"][0]["text"])
        for u in updates
        if u["sessionUpdate"] in roles
    ]


def conversation_v1(updates: list[dict[str, Any]]) -> list[tuple[str, str]]:
    roles = {"user_message_chunk": "user", "agent_message_chunk": "agent"}
    return [
        (roles[u["sessionUpdate"]], u["content"]["text"])
        for u in updates
        if u["sessionUpdate"] in roles
    ]


async def test_a_v1_client_and_a_v2_client_use_one_sqlite_session_in_turn(tmp_path: Path) -> None:
    store = f"sqlite:{tmp_path / 'sessions.db'}"
    command = agent_command(store, tmp_path)
    with anyio.fail_after(TIMEOUT):
        # 1. the official SDK (v1) starts the conversation
        async with sdk_client(command, SdkClient()) as conn:
            sid = (await conn.new_session(cwd=str(tmp_path))).session_id
            await conn.prompt(session_id=sid, prompt=text_prompt("from v1"))
        # 2. acp-once's v2 client resumes it in another agent process, sees it, and goes on
        # with a keyed prompt
        recorder = UpdateRecorder()
        async with (
            StdioLauncher(command).connect() as frames,
            ClientSideConnection(recorder, frames) as v2,
        ):
            init = await v2.agent.initialize(initialize_request("v2-client"))
            assert init.protocol_version == 2
            resume = {"sessionId": sid, "cwd": str(tmp_path), "replayFrom": {"type": "start"}}
            await v2.agent.resume_session(s.ResumeSessionRequest.model_validate(resume))
            prompt = {
                "sessionId": sid,
                "prompt": [{"type": "text", "text": "from v2"}],
                "idempotencyKey": KEY,
            }
            await v2.agent.prompt(s.PromptRequest.model_validate(prompt))
            await recorder.wait_for(
                lambda updates: ("agent", "from v2") in conversation_v2(updates)
            )
            seen_by_v2 = conversation_v2(recorder.updates)
        # 3. the SDK loads it again in a third process: the same conversation
        last = SdkClient()
        async with sdk_client(command, last) as conn:
            await conn.load_session(cwd=str(tmp_path), session_id=sid)
            seen_by_v1 = conversation_v1(last.updates)
    expected = [
        ("user", "from v1"),
        ("agent", "from v1"),
        ("user", "from v2"),
        ("agent", "from v2"),
    ]
    assert seen_by_v2 == seen_by_v1 == expected
    assert all(KEY not in str(update) for update in last.updates)


async def test_the_sdk_client_drives_the_langgraph_adapter_in_v1(tmp_path: Path) -> None:
    """`acp-once agent --runtime langgraph` (a LangGraph thread per session) gets v1 the same
    way: the SDK's client runs a turn, and a new process loads the thread's history."""
    command = agent_command(f"sqlite:{tmp_path / 'threads.sqlite3'}", tmp_path)
    command[4:4] = ["--runtime", "langgraph"]
    first, second = SdkClient(), SdkClient()
    with anyio.fail_after(TIMEOUT):
        async with sdk_client(command, first) as conn:
            sid = (await conn.new_session(cwd=str(tmp_path))).session_id
            done = await conn.prompt(session_id=sid, prompt=text_prompt("graph turn"))
            assert done.stop_reason == "end_turn"
            assert first.texts("agent_message_chunk") == ["graph turn"]
        async with sdk_client(command, second) as conn:
            await conn.load_session(cwd=str(tmp_path), session_id=sid)
    assert conversation_v1(second.updates) == [("user", "graph turn"), ("agent", "graph turn")]


async def test_an_idempotency_key_in_a_v1_prompt_is_ignored(tmp_path: Path) -> None:
    """v1 has no keys: the same `idempotencyKey` sent twice in v1 prompts (through the SDK's
    raw request, its typed API has no such field) is two messages, and is echoed nowhere."""
    store = f"sqlite:{tmp_path / 'sessions.db'}"
    command = agent_command(store, tmp_path)
    client, later = SdkClient(), SdkClient()
    with anyio.fail_after(TIMEOUT):
        async with sdk_client(command, client) as conn:
            sid = (await conn.new_session(cwd=str(tmp_path))).session_id
            params = {
                "sessionId": sid,
                "prompt": [{"type": "text", "text": "twice"}],
                "idempotencyKey": KEY,
            }
            for _ in range(2):
                answer = await conn._conn.send_request("session/prompt", params)
                assert answer == {"stopReason": "end_turn"}
        async with sdk_client(command, later) as conn:
            await conn.load_session(cwd=str(tmp_path), session_id=sid)
    assert later.texts("user_message_chunk") == ["twice", "twice"]
    assert KEY not in str(client.updates) + str(later.updates)
