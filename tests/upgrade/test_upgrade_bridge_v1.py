"""An ACP v1 client of `acp-once bridge -- acp-once agent --runtime v1 -- <SDK v1 agent>`: the
bridge serves it through the v1 face (it used to refuse it: -32602 `info` missing, or -32022
`supported: [2]`). Raw v1 frames over WebSocket and Streamable HTTP: `initialize`,
`session/new`, a prompt answered at the end of its turn with the chunks before it, and
`session/load` on a new connection replaying the history."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.rpc.streams import FrameStream
from tests.remote.test_bridge import TRANSPORTS, _frames, bridge_process

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 60
SDK_AGENT = Path(__file__).parents[1] / "agents" / "sdk_v1_effects_agent.py"
V1_INIT = {
    "protocolVersion": 1,
    "clientCapabilities": {},
    "clientInfo": {"name": "v1", "version": "1"},
}


class RawV1:
    """Sends requests as raw frames and keeps every message received, in order."""

    def __init__(self, frames: FrameStream) -> None:
        self.frames = frames
        self.received: list[dict[str, Any]] = []
        self._next = 0

    async def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self._next += 1
        request = {"jsonrpc": "2.0", "id": self._next, "method": method, "params": params}
        await self.frames.send(json.dumps(request).encode())
        while True:
            frame = await self.frames.receive()
            assert isinstance(frame, bytes)
            message: dict[str, Any] = json.loads(frame)
            self.received.append(message)
            if message.get("id") == self._next and "method" not in message:
                return message

    def updates(self) -> list[dict[str, Any]]:
        return [m["params"]["update"] for m in self.received if m.get("method") == "session/update"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_v1_client_is_served_through_the_bridge(tmp_path: Path, transport: str) -> None:
    effects = tmp_path / "effects.log"
    upgraded = [
        sys.executable, "-m", "acp_once", "agent", "--runtime", "v1",
        "--store", f"sqlite:{tmp_path / 'sessions.sqlite3'}",
        "--", sys.executable, str(SDK_AGENT), "--effects", str(effects),
        "--load", "--state", str(tmp_path / "v1-state.json"),
    ]  # fmt: skip
    with anyio.fail_after(TIMEOUT):
        async with bridge_process(upgraded) as bridge:
            url = bridge.target(transport)
            async with _frames(transport, url, None) as frames:
                peer = RawV1(frames)
                init = (await peer.call("initialize", V1_INIT))["result"]
                assert init["protocolVersion"] == 1
                assert init["agentCapabilities"]["loadSession"] is True
                new = await peer.call("session/new", {"cwd": "/w", "mcpServers": []})
                sid = new["result"]["sessionId"]
                answer = await peer.call(
                    "session/prompt", {"sessionId": sid, "prompt": [{"type": "text", "text": "hi"}]}
                )
                assert answer["result"] == {"stopReason": "end_turn"}
                texts = [
                    u["content"]["text"]
                    for u in peer.updates()
                    if u["sessionUpdate"] == "agent_message_chunk"
                ]
                assert texts == ["echo: ", "hi"]
                assert "state_update" not in {u["sessionUpdate"] for u in peer.updates()}
            async with _frames(transport, url, None) as frames:
                again = RawV1(frames)
                await again.call("initialize", V1_INIT)
                loaded = await again.call(
                    "session/load", {"sessionId": sid, "cwd": "/w", "mcpServers": []}
                )
                assert loaded["result"] == {}
                replayed = [(u["sessionUpdate"], u["content"]["text"]) for u in again.updates()]
                assert replayed == [
                    ("user_message_chunk", "hi"),
                    ("agent_message_chunk", "echo: hi"),
                ]
    assert len(effects.read_text().splitlines()) == 1
