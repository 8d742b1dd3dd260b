"""`ShardedStore`: one `SessionStore` over several, each session kept whole in one of them.

A session is placed by a stable hash of its id (`shard_of`: the first 8 bytes of the SHA-256
of its UTF-8 bytes, big-endian, modulo the number of shards), so every process that is given
the same shards in the same order finds every session at the same place, and a session's
timeline, keys and prompt queue live in one database: an insert and its key stay one
transaction of one shard (R24, R38). The placement depends on the number of shards and their
order: the PostgreSQL shards record both (`acp_once.storage.postgres.shards`) and refuse to be
opened in another set.

Every call naming a session goes to its shard. `list_sessions` merges: each shard is asked for
the page after the same cursor position and the pages are merged in list order (newest
`updated_at` first, then by id), so the cursor format, its ordering and the keyset paging are
exactly those of one store. A fork whose new id hashes to another shard than its source is
copied between them (`CopiesSessions`): the source's timeline as of one transaction, then the
new session with it in one transaction of its own shard.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import anyio

from acp_once.storage.base import (
    ANY_TENANT,
    UNCHANGED,
    AnyTenant,
    InsertOutcome,
    KeyRecord,
    SessionMissing,
    SessionRecord,
    SessionStore,
    StorageError,
    TimelineEntry,
    Unchanged,
    encode_cursor,
    list_position,
)
from acp_once.support.opening import AsyncClosing

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["CopiedEntry", "CopiesSessions", "ShardedStore", "shard_of"]


def shard_of(session_id: str, shards: int) -> int:
    """The index (0 to `shards - 1`) of the shard that keeps `session_id`: the first 8 bytes
    of the SHA-256 of its UTF-8 bytes, as a big-endian integer, modulo `shards`. Stable across
    processes, machines and versions (it is part of the stored data's layout).

    Raises:
        ValueError: `shards` is below 1.
    """
    if shards < 1:
        raise ValueError("a sharded store needs at least one shard")
    digest = hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % shards


@dataclass(frozen=True, slots=True)
class CopiedEntry:
    """One timeline entry as a fork copies it between shards (never with its key)."""

    seq: int
    message_id: str | None
    update: bytes
    user_message: bool


@runtime_checkable
class CopiesSessions(Protocol):
    """What a shard needs for a fork onto another shard: its timeline out, a new session in."""

    async def export_timeline(self, session_id: str) -> tuple[list[CopiedEntry], int] | None:
        """The session's whole timeline in `seq` order, as of one transaction, without keys,
        and the `seq` its next entry would take; None when the session does not exist."""
        ...

    async def import_session(
        self, record: SessionRecord, entries: Sequence[CopiedEntry], next_seq: int
    ) -> None:
        """Create `record` with `entries` (seqs kept; no keys) in one transaction; the next
        entry takes `next_seq`.

        Raises:
            SessionExists: the session id is taken (nothing is written).
        """
        ...


class ShardedStore(AsyncClosing):
    """A `SessionStore` over `shards` (see the module docstring). The shards belong to the
    caller unless `on_close` is given: `aclose` then awaits it once.

    The optional capability `append_updates` (`AppendsUpdates`) is offered when every shard
    has it.
    """

    def __init__(
        self,
        shards: Sequence[SessionStore],
        *,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        if not shards:
            raise ValueError("a sharded store needs at least one shard")
        self.shards: tuple[SessionStore, ...] = tuple(shards)
        self._on_close = on_close
        self._closed = False

    def shard(self, session_id: str) -> SessionStore:
        """The shard that keeps `session_id`."""
        return self.shards[shard_of(session_id, len(self.shards))]

    def _live(self) -> None:
        if self._closed:
            raise StorageError("the store is closed")

    # -- sessions -------------------------------------------------------------------------

    async def create_session(self, record: SessionRecord) -> None:
        self._live()
        await self.shard(record.session_id).create_session(record)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        self._live()
        return await self.shard(session_id).get_session(session_id)

    async def list_sessions(
        self,
        *,
        cwd: str | None = None,
        cursor: str | None = None,
        limit: int = 100,
        tenant: str | AnyTenant | None = ANY_TENANT,
    ) -> tuple[list[SessionRecord], str | None]:
        """`SessionStore.list_sessions` over every shard: each shard's page after the same
        position, merged in list order. The first `limit` of the union are the first `limit`
        of all sessions after the position, since each shard gave its own first `limit`."""
        self._live()
        list_position(cursor, limit)  # InvalidCursor or ValueError before any shard is asked
        pages: list[tuple[list[SessionRecord], str | None]] = [([], None)] * len(self.shards)

        async def one(index: int, shard: SessionStore) -> None:
            pages[index] = await shard.list_sessions(
                cwd=cwd, cursor=cursor, limit=limit, tenant=tenant
            )

        async with anyio.create_task_group() as tg:
            for index, shard in enumerate(self.shards):
                tg.start_soon(one, index, shard)
        merged = sorted(
            (record for records, _ in pages for record in records),
            key=lambda record: (-record.updated_at, record.session_id),
        )
        page = merged[:limit]
        more = len(merged) > limit or any(next_cursor is not None for _, next_cursor in pages)
        if not more or not page:
            return page, None
        return page, encode_cursor(page[-1].updated_at, page[-1].session_id)

    async def delete_session(self, session_id: str) -> bool:
        self._live()
        return await self.shard(session_id).delete_session(session_id)

    async def update_session(
        self,
        session_id: str,
        *,
        title: str | Unchanged | None = UNCHANGED,
        updated_at: float | Unchanged = UNCHANGED,
    ) -> SessionRecord:
        self._live()
        return await self.shard(session_id).update_session(
            session_id, title=title, updated_at=updated_at
        )

    async def fork_session(self, source_id: str, new_record: SessionRecord) -> None:
        """`SessionStore.fork_session`; across shards when the new id hashes elsewhere.

        Raises:
            SessionMissing: the source does not exist.
            SessionExists: the new id is taken.
            StorageError: the shards cannot copy sessions between them (`CopiesSessions`).
        """
        self._live()
        source = self.shard(source_id)
        target = self.shard(new_record.session_id)
        if source is target:
            await source.fork_session(source_id, new_record)
            return
        if not isinstance(source, CopiesSessions) or not isinstance(target, CopiesSessions):
            raise StorageError("these shards cannot fork a session onto another shard")
        exported = await source.export_timeline(source_id)
        if exported is None:
            raise SessionMissing(source_id)
        entries, next_seq = exported
        await target.import_session(new_record, entries, next_seq)

    # -- timeline and keys ----------------------------------------------------------------

    async def insert_user_message(
        self,
        session_id: str,
        *,
        message_id: str,
        update: bytes,
        idempotency_key: str | None,
        prompt_digest: bytes | None,
    ) -> InsertOutcome:
        self._live()
        return await self.shard(session_id).insert_user_message(
            session_id,
            message_id=message_id,
            update=update,
            idempotency_key=idempotency_key,
            prompt_digest=prompt_digest,
        )

    async def find_key(self, session_id: str, key: str) -> KeyRecord | None:
        self._live()
        return await self.shard(session_id).find_key(session_id, key)

    async def append_update(
        self, session_id: str, update: bytes, *, message_id: str | None = None
    ) -> int:
        self._live()
        return await self.shard(session_id).append_update(session_id, update, message_id=message_id)

    async def append_updates(
        self, session_id: str, updates: Sequence[tuple[bytes, str | None]]
    ) -> list[int]:
        """`AppendsUpdates.append_updates` on the session's shard; one `append_update` per
        update (not atomic) on a shard without the capability."""
        self._live()
        shard = self.shard(session_id)
        many = getattr(shard, "append_updates", None)
        if many is not None:
            seqs: list[int] = await many(session_id, updates)
            return seqs
        return [
            await shard.append_update(session_id, update, message_id=mid) for update, mid in updates
        ]

    async def read_timeline(
        self, session_id: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TimelineEntry]:
        self._live()
        return await self.shard(session_id).read_timeline(
            session_id, after_seq=after_seq, limit=limit
        )

    async def read_timeline_tail(self, session_id: str, *, limit: int = 1) -> list[TimelineEntry]:
        self._live()
        return await self.shard(session_id).read_timeline_tail(session_id, limit=limit)

    async def count_user_messages(
        self, session_id: str, *, idempotency_key: str | None = None
    ) -> int:
        self._live()
        return await self.shard(session_id).count_user_messages(
            session_id, idempotency_key=idempotency_key
        )

    async def aclose(self) -> None:
        """Close: with `on_close`, await it (once); the shards are the caller's otherwise."""
        if self._closed:
            return
        self._closed = True
        if self._on_close is not None:
            await self._on_close()
