"""`acp-once bridge -- acp-once agent --runtime v1 -- <an official Python SDK 0.12.1 agent>`: an
upgraded v1 agent served over WebSocket and Streamable HTTP. One keyed turn, its retry on the
same connection and after the connection dropped (a new one, `session/resume`): one user
message, one `messageId`, one prompt reaching the SDK agent."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.storage import open_store
from tests.helpers import UpdateRecorder
from tests.remote.test_bridge import TRANSPORTS, bridge_process, connection, new_session, resume

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 60
KEY = "bridge-upgrade-key-2b8e"
SDK_AGENT = Path(__file__).parents[1] / "agents" / "sdk_v1_effects_agent.py"


def prompt_params(session_id: str, text: str) -> dict[str, Any]:
    return {
        "sessionId": session_id,
        "prompt": [{"type": "text", "text": text}],
        "idempotencyKey": KEY,
    }


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_keyed_turn_through_the_bridge(tmp_path: Path, transport: str) -> None:
    effects = tmp_path / "effects.log"
    db = tmp_path / "sessions.sqlite3"
    upgraded = [
        sys.executable, "-m", "acp_once", "agent", "--runtime", "v1", "--store", f"sqlite:{db}",
        "--", sys.executable, str(SDK_AGENT), "--effects", str(effects),
    ]  # fmt: skip
    with anyio.fail_after(TIMEOUT):
        async with bridge_process(upgraded) as bridge:
            url = bridge.target(transport)
            async with connection(transport, url, rec := UpdateRecorder()) as (frames, conn):
                sid = await new_session(conn)
                first = await conn.rpc.request("session/prompt", prompt_params(sid, "hi"))
                assert await conn.rpc.request("session/prompt", prompt_params(sid, "hi")) == first
                await rec.wait_for(lambda ups: any(u.get("stopReason") == "end_turn" for u in ups))
                texts = [
                    u["content"]["text"]
                    for u in rec.updates
                    if u["sessionUpdate"] == "agent_message_chunk"
                ]
                assert texts == ["echo: ", "hi"]
            assert not [f for f in frames.received if KEY.encode() in f]
            async with connection(transport, url) as (_, conn):
                await resume(conn, sid)
                assert await conn.rpc.request("session/prompt", prompt_params(sid, "hi")) == first
    async with open_store(f"sqlite:{db}") as store:
        assert await store.count_user_messages(sid) == 1
    assert len(effects.read_text().splitlines()) == 1
