"""acp-once's `AcpClient` against the TypeScript SDK 2.4.0's stable (v1) agent, over stdio.

`ts_v1_agent.mjs` is an echo agent on the SDK's main entry (`agent()` with typed handlers,
`ndJsonStream` on stdin and stdout). The client offers v2, the agent answers v1, and the
client runs the connection with v1 semantics: one turn whose v1 updates arrive as typed v2
updates and which ends with the answer's `end_turn`; a cancelled turn; no key on the wire
(read from the agent's side: it logs every byte it receives)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.client import AcpClient, SessionUpdate, StdioLauncher
from acp_once.protocol import schema as s
from tests.interop.node import NodeProject

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 30


def ts_agent(node_project: NodeProject, log: Path) -> StdioLauncher:
    command = [node_project.node, node_project.script("ts_v1_agent.mjs"), str(log)]
    return StdioLauncher(command, cwd=str(node_project.root))


def received(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line]


async def test_one_v1_turn_against_the_typescript_sdk_agent(
    node_project: NodeProject, tmp_path: Path
) -> None:
    log = tmp_path / "received.jsonl"
    seen: list[SessionUpdate] = []
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(ts_agent(node_project, log), on_unaware="trust") as client:
            assert client.protocol_version == 1
            assert client.agent_info_v1 is not None
            assert client.agent_info_v1.agent_info is not None
            assert client.agent_info_v1.agent_info.name == "ts-v1-echo"
            session = await client.new_session(str(tmp_path))
            session.on_update(seen.append)
            result = await session.prompt("hello from python").finished()

    assert result.stop_reason == "end_turn"
    assert result.text == "echo: hello from python"
    assert [type(u) for u in seen] == [
        s.SessionUpdateUserMessage,
        s.SessionUpdateStateUpdate2,  # running
        s.SessionUpdateAgentMessageChunk,
        s.SessionUpdateToolCallUpdate,
        s.SessionUpdateToolCallUpdate,
        s.SessionUpdateAgentMessageChunk,
        s.SessionUpdateStateUpdate3,  # idle
    ]
    messages = received(log)
    assert [m.get("method") for m in messages] == ["initialize", "session/new", "session/prompt"]
    assert messages[2]["params"] == {
        "sessionId": session.session_id,
        "prompt": [{"type": "text", "text": "hello from python"}],
    }
    assert "idempotencyKey" not in log.read_text(encoding="utf-8")


async def test_a_cancelled_v1_turn_against_the_typescript_sdk_agent(
    node_project: NodeProject, tmp_path: Path
) -> None:
    log = tmp_path / "received.jsonl"
    tool_done = anyio.Event()

    def on_update(update: SessionUpdate) -> None:
        if isinstance(update, s.SessionUpdateToolCallUpdate) and update.status == "completed":
            tool_done.set()

    with anyio.fail_after(TIMEOUT):
        async with AcpClient(ts_agent(node_project, log), on_unaware="trust") as client:
            session = await client.new_session(str(tmp_path))
            session.on_update(on_update)
            turn = session.prompt("[wait]")
            await tool_done.wait()
            await session.cancel()
            result = await turn.finished()

    assert result.stop_reason == "cancelled"
    assert [m.get("method") for m in received(log)][-1] == "session/cancel"
