"""The storage contract: our records, the `SessionStore` protocol, and the errors it raises.

The interface is deliberately at the level of *our* records (sessions, the retained timeline
of a session, the idempotency keys of user messages), never generic SQL: every backend keeps
its SQL to itself (the encode/databases lesson, style anchors 6 and 8.c.5).

The one operation the whole package exists for is `SessionStore.insert_user_message`: it looks
the key up and appends the user message *with* the key in one atomic step, so a key can never
be stored without its message or a message without its key (RFD "How long a key lasts", R38,
D14), and two concurrent inserts with the same new key produce exactly one message (R24).

Keys are private (R29). They are never part of a `TimelineEntry`, a `SessionRecord`, a
`KeyRecord`, a list cursor or an exception message. Callers pass `update` JSON that is already
free of the key; the store keeps the key in its own column or map.

Errors::

    StorageError
     ├── SessionMissing      the session does not exist (writes only; reads answer "empty")
     ├── SessionExists       create/fork onto an id that is already taken
     ├── FencingError        a fenced write by a node that lost the session's lease
     ├── InvalidCursor       also a ValueError: a malformed `list_sessions` cursor
     └── SchemaOutOfDate     the database needs `acp-once db migrate`
"""

from __future__ import annotations

import base64
import binascii
import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

import orjson

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "ANY_TENANT",
    "UNCHANGED",
    "AnyTenant",
    "AppendsUpdates",
    "FencingError",
    "InsertOutcome",
    "InvalidCursor",
    "KeyRecord",
    "SchemaOutOfDate",
    "SessionExists",
    "SessionMissing",
    "SessionRecord",
    "SessionStore",
    "StorageError",
    "TimelineEntry",
    "Unchanged",
    "check_limit",
    "decode_cursor",
    "encode_cursor",
    "list_position",
    "one_page",
]


# --------------------------------------------------------------------------------------------
# Errors


class StorageError(Exception):
    """Base class of every error a store raises (backend driver errors are wrapped in it)."""


class SessionMissing(StorageError):
    """A write named a session that does not exist."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} does not exist")
        self.session_id = session_id


class SessionExists(StorageError):
    """`create_session` or `fork_session` named a session id that is already taken."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} already exists")
        self.session_id = session_id


class FencingError(StorageError):
    """A fenced write (several nodes sharing one database) whose writer no longer holds the
    session's lease at its epoch: the lease was taken over or released. Nothing was written.
    """

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r}: this node no longer holds the session's lease")
        self.session_id = session_id


class InvalidCursor(StorageError, ValueError):
    """A `list_sessions` cursor that this store did not produce."""


class SchemaOutOfDate(StorageError):
    """The database schema is older than this version of acp-once needs."""

    def __init__(self, *, found: int, required: int, where: str) -> None:
        super().__init__(
            f"{where}: database schema version {found} is older than the required version "
            f"{required}; run `acp-once db migrate` (or open the store with migrate=True)"
        )
        self.found = found
        self.required = required


# --------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """One stored session. Never carries an idempotency key."""

    session_id: str
    cwd: str
    additional_directories: tuple[str, ...]
    title: str | None
    created_at: float
    """Seconds since the epoch."""
    updated_at: float
    """Seconds since the epoch; bumped to "now" by timeline writes, never moved back.
    `list_sessions` orders by it. A store may skip a bump less than a second after the last
    one (the SQLite and PostgreSQL stores do: the row, or its indexes, stay unwritten);
    `session/list` shows whole seconds."""
    forked_from: str | None = None
    tenant: str | None = None
    """The tenant that created the session (the name its token has in `serve --tokens`), or
    None for a session created without one (stdio, a single token). A fork carries its
    source's tenant. Stores keep it as given; who may see the session is the runtime's rule."""


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    """One retained item of a session's history, in order.

    `update` is the JSON (bytes, as produced by orjson) of a `session/update` `update`
    object, for instance a `user_message` upsert. `seq` is assigned by the store and is
    strictly increasing within a session.
    """

    session_id: str
    seq: int
    message_id: str | None
    update: bytes


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """What a recorded idempotency key maps to (the key itself is not repeated here)."""

    message_id: str
    prompt_digest: bytes | None


@dataclass(frozen=True, slots=True)
class InsertOutcome:
    """The result of `SessionStore.insert_user_message`.

    `inserted` is False when the key was already recorded: then `message_id` and
    `prompt_digest` are the recorded ones, not the ones passed in.
    """

    message_id: str
    inserted: bool
    prompt_digest: bytes | None


class Unchanged(enum.Enum):
    """Type of `UNCHANGED`, the "leave this field as it is" default of `update_session`."""

    UNCHANGED = "UNCHANGED"


UNCHANGED: Final = Unchanged.UNCHANGED


class AnyTenant(enum.Enum):
    """Type of `ANY_TENANT`, the "whichever tenant" default of `list_sessions`."""

    ANY_TENANT = "ANY_TENANT"


ANY_TENANT: Final = AnyTenant.ANY_TENANT


# --------------------------------------------------------------------------------------------
# The protocol


@runtime_checkable
class SessionStore(Protocol):
    """Where sessions, their retained timeline and their idempotency keys live.

    Every method is a coroutine and is safe to call concurrently from many tasks. Writes on a
    session that does not exist raise `SessionMissing`; reads of a missing session answer
    "nothing" (`None`, `[]`, `0`). Every error is a `StorageError`.
    """

    async def create_session(self, record: SessionRecord) -> None:
        """Store a new session with an empty timeline.

        Raises:
            SessionExists: a session with this id is already stored.
        """
        ...

    async def get_session(self, session_id: str) -> SessionRecord | None:
        """Return the session, or None if it does not exist."""
        ...

    async def list_sessions(
        self,
        *,
        cwd: str | None = None,
        cursor: str | None = None,
        limit: int = 100,
        tenant: str | AnyTenant | None = ANY_TENANT,
    ) -> tuple[list[SessionRecord], str | None]:
        """Return one page of sessions, newest `updated_at` first, then by id.

        `cwd` filters on exact equality. `tenant` filters on the record's tenant: a name lists
        that tenant's sessions only, None only the sessions without a tenant, and `ANY_TENANT`
        (the default) every session. The returned cursor is opaque and None on the last
        page. Paging is keyset-based, so sessions created while paging never make an older
        session repeat or vanish from the remaining pages.

        Raises:
            InvalidCursor: `cursor` was not produced by a store.
            ValueError: `limit` is below 1.
        """
        ...

    async def delete_session(self, session_id: str) -> bool:
        """Delete the session with its timeline and its keys; False if it did not exist."""
        ...

    async def update_session(
        self,
        session_id: str,
        *,
        title: str | Unchanged | None = UNCHANGED,
        updated_at: float | Unchanged = UNCHANGED,
    ) -> SessionRecord:
        """Change the given fields and return the stored record.

        Raises:
            SessionMissing: the session does not exist.
        """
        ...

    async def insert_user_message(
        self,
        session_id: str,
        *,
        message_id: str,
        update: bytes,
        idempotency_key: str | None,
        prompt_digest: bytes | None,
    ) -> InsertOutcome:
        """Insert a user message at most once per (session, key). Atomic.

        If `idempotency_key` is given and already recorded in this session, nothing is
        written and the recorded message id and digest come back with `inserted=False`.
        Otherwise the message is appended to the timeline and the key (if any) recorded with
        it in the same transaction, and `updated_at` is bumped.

        Cancellation: once the commit is under way, the caller must learn its outcome. A store
        whose insert can suspend shields its commit and what follows it, so a cancellation of
        the caller (its connection closed) is delivered after the call returns, or before
        anything was committed, never in between: a message stored without the caller knowing
        would keep its key with no turn ever started for it.

        Raises:
            SessionMissing: the session does not exist.
        """
        ...

    async def find_key(self, session_id: str, key: str) -> KeyRecord | None:
        """Look a key up in a session; an index lookup that never scans the timeline."""
        ...

    async def append_update(
        self, session_id: str, update: bytes, *, message_id: str | None = None
    ) -> int:
        """Append a retained update that is not a user message; return its `seq`.

        Bumps `updated_at`.

        Raises:
            SessionMissing: the session does not exist.
        """
        ...

    async def read_timeline(
        self, session_id: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TimelineEntry]:
        """Return up to `limit` entries with `seq > after_seq`, in order.

        Page by passing the last returned `seq` as `after_seq`; an empty list is the end.
        """
        ...

    async def read_timeline_tail(self, session_id: str, *, limit: int = 1) -> list[TimelineEntry]:
        """Return the last `limit` entries (in order); `[]` for an empty or missing session.

        Costs the same whatever the session's length (the runtime reads its turn marker here
        after a restart).
        """
        ...

    async def count_user_messages(
        self, session_id: str, *, idempotency_key: str | None = None
    ) -> int:
        """Count the user messages of a session, or those recorded with one key (0 or 1)."""
        ...

    async def fork_session(self, source_id: str, new_record: SessionRecord) -> None:
        """Create `new_record` with a copy of the source's timeline and none of its keys.

        A fork is a different session, so a key of the source names an unrelated submission
        there (R32, D15). Copied entries keep their `seq`, `message_id` and `update`.

        Raises:
            SessionMissing: the source does not exist.
            SessionExists: `new_record.session_id` is already taken.
        """
        ...

    async def aclose(self) -> None:
        """Release the store's resources. Idempotent; later calls raise StorageError."""
        ...


class AppendsUpdates(Protocol):
    """An optional capability of a `SessionStore`: several retained updates in one write.

    The runtime uses it, when the store has it, to write a turn's last retained update and
    the turn's closing marker in one transaction instead of two (`MemoryStore`, `SqliteStore`);
    with a store without it, it calls `append_update` once per update.
    """

    async def append_updates(
        self, session_id: str, updates: Sequence[tuple[bytes, str | None]]
    ) -> list[int]:
        """Append `(update, message_id)` pairs in order, atomically; return their `seq`s.

        All of them are written or none is; `updated_at` is bumped once. Like
        `append_update`, these are never user messages.

        Raises:
            SessionMissing: the session does not exist (nothing is written).
        """
        ...


# --------------------------------------------------------------------------------------------
# Helpers shared by the backends


_CURSOR_TAG: Final = "s1"


def encode_cursor(updated_at: float, session_id: str) -> str:
    """Return the opaque cursor that resumes a listing after this (updated_at, id) position."""
    raw = orjson.dumps([_CURSOR_TAG, updated_at, session_id])
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    """Inverse of `encode_cursor`.

    Raises:
        InvalidCursor: the string is not a cursor produced by `encode_cursor`.
    """
    try:
        raw = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_", validate=True)
        value: Any = orjson.loads(raw)
    except (ValueError, binascii.Error) as exc:  # JSONDecodeError and UnicodeError included
        raise InvalidCursor("invalid session list cursor") from exc
    if (
        isinstance(value, list)
        and len(value) == 3
        and value[0] == _CURSOR_TAG
        and isinstance(value[1], (int, float))
        and not isinstance(value[1], bool)
        and math.isfinite(value[1])
        and isinstance(value[2], str)
    ):
        return float(value[1]), value[2]
    raise InvalidCursor("invalid session list cursor")


def check_limit(limit: int) -> None:
    """Raise ValueError for a page size below 1."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")


def list_position(cursor: str | None, limit: int) -> tuple[float, str] | None:
    """Check the arguments of `list_sessions`; return the (updated_at, session_id) position
    its page starts after, None for the first page.

    Raises:
        InvalidCursor: `cursor` was not produced by `encode_cursor`.
        ValueError: `limit` is below 1.
    """
    check_limit(limit)
    return None if cursor is None else decode_cursor(cursor)


def one_page(records: list[SessionRecord], limit: int) -> tuple[list[SessionRecord], str | None]:
    """The page of `list_sessions` from `records`, listed in page order with up to one more
    than `limit` (that one says a next page exists): its first `limit` records, and the cursor
    of the next page, None on the last."""
    page = records[:limit]
    if len(records) <= limit:
        return page, None
    return page, encode_cursor(page[-1].updated_at, page[-1].session_id)
