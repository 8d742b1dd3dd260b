"""The in-memory reference store: plain dicts, no lock.

It is the executable definition of the contract (every backend must behave like it) and the
default for stdio agents, where a record in memory is enough while the process lives (R39).

Each session keeps its timeline as a list of `(seq, message_id, update)` tuples in `seq` order
(a `TimelineEntry` is built when read: building one per write cost ~1 us, three times per echo
turn, and plain tuples of atomic values drop out of the garbage collector's sight) and a dict
from idempotency key to `KeyRecord`, so `find_key` is O(1) whatever the length of the history.
The key lives only in that dict, never in a timeline entry, and a fork starts with an empty
dict (R32, D15).

No lock: every method does all of its work synchronously, without awaiting, so on the
single-threaded event loop each call is atomic (no other task can run in the middle of it) and
a cancelled call either happened completely or not at all. (An anyio lock here cost three
acquisitions per echo turn for nothing.) The store must be used from one event loop thread.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from acp_once.storage.base import (
    ANY_TENANT,
    UNCHANGED,
    AnyTenant,
    InsertOutcome,
    KeyRecord,
    SessionExists,
    SessionMissing,
    SessionRecord,
    StorageError,
    TimelineEntry,
    Unchanged,
    check_limit,
    list_position,
    one_page,
)
from acp_once.support.opening import AsyncClosing

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["MemoryStore"]


_Row = tuple[int, str | None, bytes]  # seq, message_id, update


@dataclass(slots=True)
class _Session:
    stored: SessionRecord  # `updated_at` may be stale: the current value is `updated_at`
    updated_at: float
    timeline: list[_Row] = field(default_factory=list)
    keys: dict[str, KeyRecord] = field(default_factory=dict)
    user_messages: int = 0

    @classmethod
    def of(cls, record: SessionRecord) -> _Session:
        return cls(record, record.updated_at)

    @property
    def record(self) -> SessionRecord:
        # built when read, not at every write: a timeline write only bumps a float
        if self.stored.updated_at != self.updated_at:
            self.stored = replace(self.stored, updated_at=self.updated_at)
        return self.stored

    @record.setter
    def record(self, record: SessionRecord) -> None:
        self.stored = record
        self.updated_at = record.updated_at

    def append(self, message_id: str | None, update: bytes) -> int:
        seq = self.timeline[-1][0] + 1 if self.timeline else 1
        # A copy of its own size: orjson's output keeps the capacity it was built in (~4 KiB
        # for an update of ~150 bytes), which a store that keeps every update would keep too
        # (12 KiB of memory per echo turn instead of ~1).
        update = bytes(memoryview(update))
        self.timeline.append((seq, message_id, update))
        return seq

    def touch(self, now: float) -> None:
        if now > self.updated_at:
            self.updated_at = now


def _seq(row: _Row) -> int:
    return row[0]


def _order(record: SessionRecord) -> tuple[float, str]:
    return (-record.updated_at, record.session_id)


class MemoryStore(AsyncClosing):
    """A `SessionStore` that keeps everything in this process's memory.

    Usable right after construction; also an async context manager that closes it.

    Args:
        clock: returns "now" in seconds since the epoch, for bumping `updated_at`.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._sessions: dict[str, _Session] = {}
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._sessions)} sessions"
        return f"<MemoryStore {state}>"

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the store is closed")

    def _session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionMissing(session_id)
        return session

    # -- sessions --------------------------------------------------------------------------

    async def create_session(self, record: SessionRecord) -> None:
        self._check_open()
        if record.session_id in self._sessions:
            raise SessionExists(record.session_id)
        self._sessions[record.session_id] = _Session.of(record)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        self._check_open()
        session = self._sessions.get(session_id)
        return None if session is None else session.record

    async def list_sessions(
        self,
        *,
        cwd: str | None = None,
        cursor: str | None = None,
        limit: int = 100,
        tenant: str | AnyTenant | None = ANY_TENANT,
    ) -> tuple[list[SessionRecord], str | None]:
        after = list_position(cursor, limit)
        self._check_open()
        records = [
            s.record
            for s in self._sessions.values()
            if (cwd is None or s.record.cwd == cwd)
            and (isinstance(tenant, AnyTenant) or s.record.tenant == tenant)
        ]
        records.sort(key=_order)
        if after is not None:
            start = bisect.bisect_right(records, (-after[0], after[1]), key=_order)
            records = records[start:]
        return one_page(records, limit)

    async def delete_session(self, session_id: str) -> bool:
        self._check_open()
        return self._sessions.pop(session_id, None) is not None

    async def update_session(
        self,
        session_id: str,
        *,
        title: str | Unchanged | None = UNCHANGED,
        updated_at: float | Unchanged = UNCHANGED,
    ) -> SessionRecord:
        self._check_open()
        session = self._session(session_id)
        record = session.record
        if not isinstance(title, Unchanged):
            record = replace(record, title=title)
        if not isinstance(updated_at, Unchanged):
            record = replace(record, updated_at=updated_at)
        session.record = record
        return record

    async def fork_session(self, source_id: str, new_record: SessionRecord) -> None:
        self._check_open()
        source = self._session(source_id)
        if new_record.session_id in self._sessions:
            raise SessionExists(new_record.session_id)
        fork = _Session.of(new_record)
        fork.user_messages = source.user_messages
        fork.timeline = list(source.timeline)  # rows hold no session id: shared as they are
        # No keys: in the fork, a key of the source names an unrelated submission.
        self._sessions[new_record.session_id] = fork

    # -- timeline and keys -----------------------------------------------------------------

    async def insert_user_message(
        self,
        session_id: str,
        *,
        message_id: str,
        update: bytes,
        idempotency_key: str | None,
        prompt_digest: bytes | None,
    ) -> InsertOutcome:
        self._check_open()
        session = self._session(session_id)
        if idempotency_key is not None:
            recorded = session.keys.get(idempotency_key)
            if recorded is not None:
                return InsertOutcome(recorded.message_id, False, recorded.prompt_digest)
        session.append(message_id, update)
        session.user_messages += 1
        if idempotency_key is not None:
            session.keys[idempotency_key] = KeyRecord(message_id, prompt_digest)
        session.touch(self._clock())
        return InsertOutcome(message_id, True, prompt_digest)

    async def find_key(self, session_id: str, key: str) -> KeyRecord | None:
        self._check_open()
        session = self._sessions.get(session_id)
        return None if session is None else session.keys.get(key)

    async def append_update(
        self, session_id: str, update: bytes, *, message_id: str | None = None
    ) -> int:
        self._check_open()
        session = self._session(session_id)
        seq = session.append(message_id, update)
        session.touch(self._clock())
        return seq

    async def append_updates(
        self, session_id: str, updates: Sequence[tuple[bytes, str | None]]
    ) -> list[int]:
        self._check_open()
        session = self._session(session_id)
        seqs = [session.append(message_id, update) for update, message_id in updates]
        if seqs:
            session.touch(self._clock())
        return seqs

    async def read_timeline(
        self, session_id: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TimelineEntry]:
        check_limit(limit)
        self._check_open()
        session = self._sessions.get(session_id)
        if session is None:
            return []
        start = bisect.bisect_right(session.timeline, after_seq, key=_seq)
        return [TimelineEntry(session_id, *row) for row in session.timeline[start : start + limit]]

    async def read_timeline_tail(self, session_id: str, *, limit: int = 1) -> list[TimelineEntry]:
        check_limit(limit)
        self._check_open()
        session = self._sessions.get(session_id)
        if session is None:
            return []
        return [TimelineEntry(session_id, *row) for row in session.timeline[-limit:]]

    async def count_user_messages(
        self, session_id: str, *, idempotency_key: str | None = None
    ) -> int:
        self._check_open()
        session = self._sessions.get(session_id)
        if session is None:
            return 0
        if idempotency_key is None:
            return session.user_messages
        return int(idempotency_key in session.keys)

    async def aclose(self) -> None:
        self._closed = True
        self._sessions.clear()
