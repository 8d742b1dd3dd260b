"""`FencedStore`: the agent's view of the PostgreSQL store on one node of a cluster."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from acp_once.storage.base import (
    ANY_TENANT,
    UNCHANGED,
    AnyTenant,
    FencingError,
    InsertOutcome,
    KeyRecord,
    SessionRecord,
    TimelineEntry,
    Unchanged,
)

if TYPE_CHECKING:
    from acp_once.cluster.fence import Fence
    from acp_once.storage.postgres import PostgresStore
    from acp_once.storage.sharded import CopiedEntry

__all__ = ["FencedStore", "Fencing"]


class Fencing(Protocol):
    """What the view needs of its node (`PostgresCoordinator`): a protocol, so that this module
    imports no coordinator (no import cycle, even for type checking)."""

    base_store: PostgresStore
    counters: collections.Counter[str]

    def fence(self, session_id: str) -> Fence:
        """The fencing token for a write on `session_id`; `FencingError` without the lease."""
        ...

    def fenced_out(self, session_id: str, fence: Fence) -> None:
        """A write under `fence` was refused (the lease moved on)."""
        ...

    async def insert_fenced(
        self,
        sid: str,
        mid: str,
        update: bytes,
        key: str | None,
        digest: bytes | None,
        row: int | None,
    ) -> InsertOutcome:
        """Insert under the node's fence for session `sid` (and count it)."""
        ...


class FencedStore:
    """The agent's view of a `PostgresStore` in a cluster: writes on a session carry the
    node's fencing token for it (`FencingError` without the lease), and inserts go through the
    coordinator (which counts them). Reads pass through."""

    def __init__(self, coordinator: Fencing) -> None:
        self._c = coordinator
        self._store = coordinator.base_store

    async def create_session(self, record: SessionRecord) -> None:
        await self._store.create_session(record)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        return await self._store.get_session(session_id)

    async def list_sessions(
        self,
        *,
        cwd: str | None = None,
        cursor: str | None = None,
        limit: int = 100,
        tenant: str | AnyTenant | None = ANY_TENANT,
    ) -> tuple[list[SessionRecord], str | None]:
        return await self._store.list_sessions(cwd=cwd, cursor=cursor, limit=limit, tenant=tenant)

    async def delete_session(self, session_id: str) -> bool:
        return await self._store.delete_session(session_id)

    async def update_session(
        self,
        session_id: str,
        *,
        title: str | Unchanged | None = UNCHANGED,
        updated_at: float | Unchanged = UNCHANGED,
    ) -> SessionRecord:
        return await self._store.update_session(session_id, title=title, updated_at=updated_at)

    async def insert_user_message(
        self,
        session_id: str,
        *,
        message_id: str,
        update: bytes,
        idempotency_key: str | None,
        prompt_digest: bytes | None,
    ) -> InsertOutcome:
        """Insert under the session's lease (fenced)."""
        return await self._c.insert_fenced(
            session_id, message_id, update, idempotency_key, prompt_digest, None
        )

    async def find_key(self, session_id: str, key: str) -> KeyRecord | None:
        found = await self._store.find_key(session_id, key)
        if found is not None:
            self._c.counters["dedup_hits"] += 1
        return found

    async def append_update(
        self, session_id: str, update: bytes, *, message_id: str | None = None
    ) -> int:
        fence = self._c.fence(session_id)
        try:
            return await self._store.append_update(
                session_id, update, message_id=message_id, guard=fence
            )
        except FencingError:
            self._c.fenced_out(session_id, fence)
            raise

    async def append_updates(
        self, session_id: str, updates: Sequence[tuple[bytes, str | None]]
    ) -> list[int]:
        """`AppendsUpdates.append_updates` under the session's lease (fenced), one trip."""
        fence = self._c.fence(session_id)
        try:
            return await self._store.append_updates(session_id, updates, guard=fence)
        except FencingError:
            self._c.fenced_out(session_id, fence)
            raise

    async def read_timeline(
        self, session_id: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TimelineEntry]:
        return await self._store.read_timeline(session_id, after_seq=after_seq, limit=limit)

    async def read_timeline_tail(self, session_id: str, *, limit: int = 1) -> list[TimelineEntry]:
        return await self._store.read_timeline_tail(session_id, limit=limit)

    async def count_user_messages(
        self, session_id: str, *, idempotency_key: str | None = None
    ) -> int:
        return await self._store.count_user_messages(session_id, idempotency_key=idempotency_key)

    async def fork_session(self, source_id: str, new_record: SessionRecord) -> None:
        await self._store.fork_session(source_id, new_record)

    async def export_timeline(self, session_id: str) -> tuple[list[CopiedEntry], int] | None:
        """`CopiesSessions.export_timeline` (a fork onto another shard reads its source)."""
        return await self._store.export_timeline(session_id)

    async def import_session(
        self, record: SessionRecord, entries: Sequence[CopiedEntry], next_seq: int
    ) -> None:
        """`CopiesSessions.import_session`: a new session, unfenced as `fork_session`."""
        await self._store.import_session(record, entries, next_seq)

    async def aclose(self) -> None:
        """The store belongs to the caller: closing the view closes nothing."""
        return None
