"""A turn's last retained update and its end record are stored together (`emit(final=True)`).

With a store that has `append_updates` (memory, SQLite) both go in one write; with one that
has not, one after the other. Either way the timeline holds the answer followed by the end
record (A10), and an agent started again on the same store finds every turn ended (no
interrupted work) and repeats the last end record as its idle snapshot.
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
        assert idle == [_end(mid) for mid in ids]
    return sid, ids


def _end(message_id: str) -> dict[str, Any]:
    return {
        "sessionUpdate": "state_update",
        "state": "idle",
        "stopReason": "end_turn",
        "_meta": {"acpOnce": {"messageId": message_id}},
    }


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
    decoded = _decoded(entries)
    assert [u["sessionUpdate"] for u in decoded] == [
        "user_message",
        "agent_message",
        "state_update",
        "user_message",
        "agent_message",
        "state_update",
    ]
    # each end record closes its own message's turn, right after the turn's answer
    assert [decoded[0]["messageId"], decoded[3]["messageId"]] == ids
    assert decoded[2] == _end(ids[0]) and decoded[5] == _end(ids[1])
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
        assert recorder.updates == [_end(ids[1])]
