"""The official Python SDK 0.12.1's v1 client in front of the upgrade runtime (served by
acp-once's v1 face), with an official-SDK v1 agent behind it: one v1 turn, then the same SQLite
session used by our v2 client (history replayed, a keyed prompt), both seeing one conversation.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import acp
import anyio
import pytest
from acp import schema

from acp_once.client import ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.transports.stdio import spawn
from tests.helpers import UpdateRecorder, initialize_request

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 30
SDK_AGENT = Path(__file__).parents[1] / "agents" / "sdk_v1_effects_agent.py"


class SdkClient:
    """The official SDK's client side: keeps the v1 updates it receives."""

    def __init__(self) -> None:
        self.updates: list[Any] = []

    def on_connect(self, conn: Any) -> None:
        return None

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        self.updates.append(update)

    async def request_permission(self, *args: Any, **kwargs: Any) -> Any:
        raise acp.RequestError.method_not_found("session/request_permission")


async def test_a_v1_client_then_a_v2_client_on_one_upgraded_session(tmp_path: Path) -> None:
    effects = tmp_path / "effects.log"
    command = [
        sys.executable, "-m", "acp_once", "agent", "--runtime", "v1",
        "--store", f"sqlite:{tmp_path / 'sessions.sqlite3'}",
        "--", sys.executable, str(SDK_AGENT), "--effects", str(effects),
        "--load", "--state", str(tmp_path / "v1-state.json"),
    ]  # fmt: skip
    client = SdkClient()
    with anyio.fail_after(TIMEOUT):
        spawned = acp.spawn_agent_process(cast(acp.Client, client), command[0], *command[1:])
        async with spawned as (conn, _process):
            init = await conn.initialize(protocol_version=1)
            assert init.protocol_version == 1
            sid = (await conn.new_session(cwd=str(tmp_path), mcp_servers=[])).session_id
            block = schema.TextContentBlock(type="text", text="hello [tool]")
            done = await conn.prompt(session_id=sid, prompt=[block])
            assert done.stop_reason == "end_turn"
        texts = [u.content.text for u in client.updates if isinstance(u, schema.AgentMessageChunk)]
        assert "".join(texts) == "echo: hello [tool]"
        assert any(
            isinstance(u, schema.ToolCallStart | schema.ToolCallProgress) for u in client.updates
        )

        rec = UpdateRecorder()
        async with (
            spawn(command) as proc,
            ClientSideConnection(rec, proc.frames) as v2,
        ):
            await v2.agent.initialize(initialize_request("v2-after-v1"))
            await v2.agent.resume_session(
                s.ResumeSessionRequest.model_validate(
                    {"sessionId": sid, "cwd": str(tmp_path), "replayFrom": {"type": "start"}}
                )
            )
            history = [(u["sessionUpdate"], u.get("content")) for u in rec.updates]
            assert ("user_message", [{"type": "text", "text": "hello [tool]"}]) in history
            assert ("agent_message", [{"type": "text", "text": "echo: hello [tool]"}]) in history
            params = {
                "sessionId": sid,
                "prompt": [{"type": "text", "text": "and v2"}],
                "idempotencyKey": "v2-after-v1-key",
            }
            first = await v2.rpc.request("session/prompt", params)
            assert await v2.rpc.request("session/prompt", params) == first
            # the end record naming this message (the replay holds the v1 turn's end)
            mine = {"acpOnce": {"messageId": first["messageId"]}}
            await rec.wait_for(lambda ups: any(u.get("_meta") == mine for u in ups))
    lines = effects.read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["hello [tool]", "and v2"]
    # one v1 session in the child for the whole conversation (loaded by the restarted child)
    assert len({line.split(" ", 1)[0] for line in lines}) == 1
