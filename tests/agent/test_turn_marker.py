"""A turn's last retained update and its closing marker are stored together (`emit(final=True)`).

With a store that has `append_updates` (memory, SQLite) both go in one write; with one that
has not, one after the other. Either way the timeline holds the answer followed by the marker,
and an agent started again on the same store finds every turn finished (no interrupted work).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from acp_once.agent.reference import ReferenceAgent
from acp_once.protocol import schema as s
from acp_once.storage import MemoryStore, SqliteStore
from acp_once.storage.base import TimelineEntry
from acp_once.testing import connected
from tests.helpers import UpdateRecorder

pytestmark = pytest.mark.anyio

_INIT = {"protocolVersion": 2, "info": {"name": "t", "version": "1"}}


class _OneByOne:
    """A store without `append_updates` (the runtime then writes one update at a time) that
    counts the timeline writes going to the wrapped store."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self.appends = 0
        self.batches = 0

    def __getattr__(self, name: str) -> Any:
        if name == "append_updates":
            raise AttributeError(name)
        return getattr(self._store, name)

    async def append_update(
        self, session_id: str, update: bytes, *, message_id: str | None = None
    ) -> int:
        self.appends += 1
        return await self._store.append_update(session_id, update, message_id=message_id)


class _Batched(_OneByOne):
    """The same, with the store's `append_updates`."""

    async def append_updates(
        self, session_id: str, updates: list[tuple[bytes, str | None]]
    ) -> list[int]:
        self.batches += 1
        return await self._store.append_updates(session_id, updates)


StoreOpener = Callable[[], AbstractAsyncContextManager[Any]]


def _openers(tmp_path: Path) -> dict[str, StoreOpener]:
    memory = MemoryStore()

    @asynccontextmanager
    async def batched() -> AsyncIterator[_Batched]:
        yield _Batched(memory)  # the same store for the "restarted" agent

    @asynccontextmanager
    async def one_by_one() -> AsyncIterator[_OneByOne]:
        yield _OneByOne(memory)

    return {
        "memory": batched,
        "sqlite": lambda: SqliteStore.open(tmp_path / "agent.sqlite3"),
        "without append_updates": one_by_one,
    }


async def _run_turns(store: Any, tmp_path: Path, texts: list[str]) -> tuple[str, list[str]]:
    recorder = UpdateRecorder()
    async with (
        ReferenceAgent(store, side_effects=tmp_path / "effects") as agent,
        connected(agent, recorder) as conn,
    ):
        await conn.agent.initialize(s.InitializeRequest.model_validate(_INIT))
        sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
        ids = []
        with anyio.fail_after(10):
            for n, text in enumerate(texts, 1):
                params = {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}
                ids.append((await conn.rpc.request("session/prompt", params))["messageId"])

                def turn_over(updates: list[dict[str, Any]], n: int = n) -> bool:
                    idle = sum(u.get("state") == "idle" for u in updates)
                    return idle == n and updates[-1].get("state") == "idle"

                await recorder.wait_for(turn_over)
        idle = [u for u in recorder.updates if u["sessionUpdate"] == "state_update"][1::2]
        assert all(
            u == {"sessionUpdate": "state_update", "state": "idle", "stopReason": "end_turn"}
            for u in idle
        )
    return sid, ids


def _decoded(entries: list[TimelineEntry]) -> list[dict[str, Any]]:
    return [orjson.loads(e.update) for e in entries]


@pytest.mark.parametrize("backend", ["memory", "sqlite", "without append_updates"])
async def test_answer_and_marker_are_stored_together_and_turns_count_as_finished(
    tmp_path: Path, backend: str
) -> None:
    opener = _openers(tmp_path)[backend]
    async with opener() as store:
        sid, ids = await _run_turns(store, tmp_path, ["first", "second"])
        if isinstance(store, _OneByOne):  # one write per turn, or answer then marker
            writes = (store.batches, store.appends)
            assert writes == ((2, 0) if backend == "memory" else (0, 4))
        entries = await store.read_timeline(sid)
    kinds = [(u["sessionUpdate"], u.get("messageId")) for u in _decoded(entries)]
    assert [k for k, _ in kinds] == [
        "user_message",
        "agent_message",
        "_acp_once_turn",
        "user_message",
        "agent_message",
        "_acp_once_turn",
    ]
    # each marker closes its own message's turn, right after the turn's answer
    assert [kinds[0][1], kinds[3][1]] == ids
    assert kinds[2][1] == ids[0] and kinds[5][1] == ids[1]
    assert [e.seq for e in entries] == list(range(entries[0].seq, entries[0].seq + 6))
    assert entries[1].message_id is not None and entries[2].message_id is None

    # an agent started again on the same store finds no interrupted work
    async with opener() as store:
        recorder = UpdateRecorder()
        async with (
            ReferenceAgent(store, side_effects=tmp_path / "effects") as agent,
            connected(agent, recorder) as conn,
        ):
            await conn.agent.initialize(s.InitializeRequest.model_validate(_INIT))
            with anyio.fail_after(10):
                await conn.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/w"))
                await recorder.wait_for(lambda updates: bool(updates))
        assert recorder.updates == [{"sessionUpdate": "state_update", "state": "idle"}]
