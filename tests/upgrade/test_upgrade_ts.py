"""The upgrade runtime in front of the TypeScript SDK 2.4.0's stable (v1) agent
(`tests/interop/ts_v1_agent.mjs`: the SDK's main entry `agent()` over `ndJsonStream`).

`acp-once agent --runtime v1 -- node ts_v1_agent.mjs LOG` is driven by our v2 client: one keyed
turn (the agent's chunks and tool call arrive as v2 updates under ids the runtime assigns,
`end_turn` ends it) and a keyed retry, on the same connection and after a restart of the whole
upgraded agent, answered from the store: the TypeScript agent's log of every byte it received
shows one prompt, and no key."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.client import ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.transports.stdio import spawn
from tests.helpers import UpdateRecorder, initialize_request
from tests.interop.node import NodeProject, install

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 30
KEY = "ts-upgrade-key-5e0c9a71"


@pytest.fixture(scope="module")
def node_project(tmp_path_factory: pytest.TempPathFactory) -> NodeProject:
    return install(tmp_path_factory.mktemp("ts-upgrade"))


def received(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line]


async def test_keyed_turn_and_retry_through_the_typescript_sdk_v1_agent(
    node_project: NodeProject, tmp_path: Path
) -> None:
    log = tmp_path / "received.jsonl"
    command = [
        sys.executable,
        "-m",
        "acp_once",
        "agent",
        "--runtime",
        "v1",
        "--store",
        f"sqlite:{tmp_path / 'sessions.sqlite3'}",
        "--",
        node_project.node,
        node_project.script("ts_v1_agent.mjs"),
        str(log),
    ]
    params: dict[str, Any] = {
        "prompt": [{"type": "text", "text": "hello from v2"}],
        "idempotencyKey": KEY,
    }
    with anyio.fail_after(TIMEOUT):
        async with (
            spawn(command, cwd=str(node_project.root)) as proc,
            ClientSideConnection(rec := UpdateRecorder(), proc.frames) as conn,
        ):
            init = await conn.agent.initialize(initialize_request("upgrade-ts"))
            assert init.protocol_version == 2
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd=str(tmp_path)))).session_id
            params["sessionId"] = sid
            first = await conn.rpc.request("session/prompt", params)
            assert await conn.rpc.request("session/prompt", params) == first
            await rec.wait_for(lambda ups: any(u.get("stopReason") for u in ups))
        kinds = [u["sessionUpdate"] for u in rec.updates]
        assert kinds == [
            "user_message",
            "state_update",  # running
            "agent_message_chunk",
            "tool_call_update",
            "tool_call_update",
            "agent_message_chunk",
            "state_update",  # idle
        ]
        assert rec.updates[-1]["stopReason"] == "end_turn"
        chunks = [u for u in rec.updates if u["sessionUpdate"] == "agent_message_chunk"]
        # a tool call between the chunks: two messages, each with an id of ours
        assert [c["content"]["text"] for c in chunks] == ["echo: ", "hello from v2"]
        assert chunks[0]["messageId"] != chunks[1]["messageId"]
        # the whole upgraded agent restarted: the retry is answered from the store
        async with (
            spawn(command, cwd=str(node_project.root)) as proc,
            ClientSideConnection(UpdateRecorder(), proc.frames) as conn,
        ):
            await conn.agent.initialize(initialize_request("upgrade-ts"))
            await conn.agent.resume_session(
                s.ResumeSessionRequest(session_id=sid, cwd=str(tmp_path))
            )
            assert await conn.rpc.request("session/prompt", params) == first
    prompts = [m for m in received(log) if m.get("method") == "session/prompt"]
    assert len(prompts) == 1  # the TypeScript agent was asked once
    assert prompts[0]["params"]["prompt"] == [{"type": "text", "text": "hello from v2"}]
    assert KEY not in log.read_text(encoding="utf-8")
    initialize = next(m for m in received(log) if m.get("method") == "initialize")
    assert initialize["params"]["protocolVersion"] == 1
    assert initialize["params"]["clientCapabilities"]["terminal"] is False
