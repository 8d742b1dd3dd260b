"""A turn's `running` state: sent once per turn, before anything the turn sends. For a prompt
on an idle session it is sent by the inbox with the prompt's answer (the worker that would
send it later starts a round after the answer, and its first update may wait for a commit);
for a prompt that waits behind another turn it is sent when that turn starts."""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from acp_once.agent import StopReason
from acp_once.agent.connection import AgentSideConnection
from acp_once.agent.runtime import SessionAgent, Turn, TurnContext
from acp_once.rpc.streams import MemoryFrameStream, memory_pair
from acp_once.storage import MemoryStore, SessionStore, SqliteStore
from tests.helpers import initialize_request

pytestmark = pytest.mark.anyio

TIMEOUT = 10.0
INITIALIZE = initialize_request("tests").model_dump(by_alias=True, exclude_unset=True)


class GatedAgent(SessionAgent):
    """Each turn waits for its gate, then sends one retained message and ends."""

    def __init__(self, store: SessionStore) -> None:
        super().__init__(store)
        self.gate = anyio.Event()
        self.started: list[str] = []

    async def run_turn(self, turn: Turn, emit: TurnContext) -> StopReason:
        self.started.append(turn.message_id)
        await self.gate.wait()
        await emit.emit(
            {
                "sessionUpdate": "agent_message",
                "messageId": f"reply-{turn.message_id}",
                "content": [{"type": "text", "text": "done"}],
            },
            final=True,
        )
        return "end_turn"


class Peer:
    """The client's end, as raw JSON-RPC frames in the order they arrived."""

    def __init__(self, end: MemoryFrameStream) -> None:
        self.end = end
        self.frames: list[dict[str, Any]] = []
        self._next_id = 0

    async def request(self, method: str, params: dict[str, Any]) -> int:
        self._next_id += 1
        frame = {"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params}
        await self.end.send(orjson.dumps(frame))
        return self._next_id

    async def until(self, done: Any) -> None:
        """Read frames until `done(frame)` holds for one; bounded by the caller."""
        while True:
            event = await self.end.receive()
            assert isinstance(event, bytes)
            frame = orjson.loads(event)
            self.frames.append(frame)
            if done(frame):
                return

    async def open_session(self) -> str:
        """Initialize, open a session and forget the frames so far; the session's id."""
        await self.call("initialize", INITIALIZE)
        opened = await self.call("session/new", {"cwd": "/tmp", "additionalDirectories": []})
        self.frames.clear()
        return str(opened["sessionId"])

    async def call(self, method: str, params: dict[str, Any]) -> Any:
        rid = await self.request(method, params)
        await self.until(lambda f: f.get("id") == rid and "method" not in f)
        answer = self.frames[-1]
        assert "result" in answer, answer
        return answer["result"]


def _kinds(frames: list[dict[str, Any]], rid: int) -> list[str]:
    """What arrived, in order: the response to `rid` as "answer", each update by its kind
    (a state by its state)."""
    out: list[str] = []
    for f in frames:
        if f.get("id") == rid and "method" not in f:
            out.append("answer")
        elif f.get("method") == "session/update":
            update = f["params"]["update"]
            out.append(update.get("state") or update["sessionUpdate"])
    return out


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "memory":
        yield MemoryStore()
    else:
        async with await SqliteStore.open(tmp_path / "s.sqlite3") as opened:
            yield opened


async def test_an_idle_sessions_prompt_has_its_running_state_before_its_answer(
    store: SessionStore,
) -> None:
    """Trace: a prompt on an idle session whose turn waits on a gate. Property: `running` is
    sent after the user message and before the answer, while the turn has not sent anything;
    once the gate opens, the turn's message and its end follow, with no second `running`."""
    agent = GatedAgent(store)
    agent_end, client_end = memory_pair(64)
    peer = Peer(client_end)
    with anyio.fail_after(TIMEOUT):
        async with aclosing(client_end), agent, AgentSideConnection(agent, agent_end):
            sid = await peer.open_session()
            rid = await peer.request(
                "session/prompt",
                {"sessionId": sid, "prompt": [{"type": "text", "text": "hi"}]},
            )
            await peer.until(lambda f: f.get("id") == rid)
            assert _kinds(peer.frames, rid) == ["user_message", "running", "answer"]
            agent.gate.set()
            await peer.until(lambda f: f.get("params", {}).get("update", {}).get("state") == "idle")
    assert _kinds(peer.frames, rid) == [
        "user_message",
        "running",
        "answer",
        "agent_message",
        "idle",
    ]


async def test_a_prompt_behind_a_turn_has_its_running_state_when_its_turn_starts(
    store: SessionStore,
) -> None:
    """Trace: a second prompt while the first turn waits on its gate (the hold policy: it is
    inserted when the first turn ends). Property: each turn has exactly one `running`, sent
    before the turn's own message, and the second turn's comes after the first turn's end."""
    agent = GatedAgent(store)
    agent_end, client_end = memory_pair(64)
    peer = Peer(client_end)
    prompt = [{"type": "text", "text": "hi"}]
    with anyio.fail_after(TIMEOUT):
        async with aclosing(client_end), agent, AgentSideConnection(agent, agent_end):
            sid = await peer.open_session()
            first = await peer.request("session/prompt", {"sessionId": sid, "prompt": prompt})
            await peer.until(lambda f: f.get("id") == first)
            second = await peer.request("session/prompt", {"sessionId": sid, "prompt": prompt})
            agent.gate.set()
            idles = 0

            def second_idle(f: dict[str, Any]) -> bool:
                nonlocal idles
                idles += f.get("params", {}).get("update", {}).get("state") == "idle"
                return bool(idles == 2)

            await peer.until(second_idle)
    kinds = [
        k for k in _kinds(peer.frames, first) if k in ("running", "idle", "agent_message", "answer")
    ]
    first_turn = ["running", "answer", "agent_message", "idle"]
    assert kinds == [*first_turn, "running", "agent_message", "idle"]
    assert any(f.get("id") == second and "result" in f for f in peer.frames)
    assert len(agent.started) == 2
