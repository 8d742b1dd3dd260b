"""The SQLite store's writes of the timeline: a user message with its key, retained updates,
and a batch of them in one transaction. Blocking functions of a connection, run by the store
(in-process) and by its writer process (`acp_once.storage.sqlite.writer`) alike, each with
the session tails (`Tail`) of the process that runs them.
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING, Final

from acp_once.storage.base import InsertOutcome, KeyRecord, SessionMissing, StorageError
from acp_once.support import sqlite as db

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from acp_once.support.sqlite import Connection

__all__ = [
    "BUMP_RESOLUTION",
    "FIND_KEY_SQL",
    "SESSION_EXISTS",
    "SESSION_NUMBER",
    "Tail",
    "Tails",
    "append_rows",
    "find_key",
    "insert_user_row",
    "write_together",
]

SESSION_EXISTS: Final = "SELECT 1 FROM sessions WHERE session_id = ?"
SESSION_NUMBER: Final = "(SELECT number FROM sessions WHERE session_id = ?)"
"""The timeline's key of a session (`sessions.number`), as a subquery of its text id."""
# A bump within a second of the last one is skipped: the session row and both of its indexes
# stay clean (3 of the ~5 pages a turn's transaction would write), and nothing visible changes,
# as `session/list` shows `updatedAt` in whole seconds.
BUMP_RESOLUTION: Final = 1.0
"""Seconds within which a write leaves `updated_at` as it is (see `_bump`)."""
# Never moves `updated_at` back: another connection (or a clock that went back) may have
# stored a later one than the store remembers.
_BUMP_SESSION: Final = "UPDATE sessions SET updated_at = ?1 WHERE number = ?2 AND updated_at < ?1"
# The session's number, `updated_at` and next `seq` in one statement (no row: no such
# session): what the store remembers of a session it writes to (`Tail`), read on its first
# write and after a conflict.
_SESSION_FOR_WRITE: Final = (
    "SELECT number, updated_at,"
    " (SELECT COALESCE(MAX(seq), 0) + 1 FROM timeline WHERE session = sessions.number)"
    " FROM sessions WHERE session_id = ?"
)


FIND_KEY_SQL: Final = (
    "SELECT message_id, prompt_digest FROM timeline"
    f" WHERE session = {SESSION_NUMBER} AND idempotency_key = ?"
)
# One INSERT per shape, with the absent values as literals: the stdlib module binds `None` and
# `bytes` parameters through its adaptation protocol, whose failed `__adapt__` lookup raises
# and clears an AttributeError each time (~2,500 instructions per parameter on 3.11).
_INSERT_KEYED_USER: Final = (
    "INSERT INTO timeline"
    " (session, seq, message_id, payload, is_user_message, idempotency_key, prompt_digest)"
    " VALUES (?, ?, ?, ?, 1, ?, ?)"
)
_INSERT_USER: Final = (
    "INSERT INTO timeline (session, seq, message_id, payload, is_user_message)"
    " VALUES (?, ?, ?, ?, 1)"
)
_INSERT_UPDATE: Final = (
    "INSERT INTO timeline (session, seq, message_id, payload) VALUES (?, ?, ?, ?)"
)
_INSERT_ANONYMOUS_UPDATE: Final = "INSERT INTO timeline (session, seq, payload) VALUES (?, ?, ?)"
_INSERT_UPDATES: dict[tuple[bool, ...], str] = {}
"""Multi-row INSERTs of retained updates, by which rows have a message id (`_append_sql`)."""
_BLOB_COPY_LIMIT: Final = 4096


def _blob(data: bytes) -> bytes | bytearray:
    """`data` as a parameter the stdlib module binds directly: a `bytearray` (bound as a BLOB
    without the adaptation lookup: copying a small payload costs less), or the bytes
    themselves when copying them would cost more than the lookup."""
    return bytearray(data) if len(data) <= _BLOB_COPY_LIMIT else data


class Tail:
    """What the store remembers of a session it writes to: its number (the timeline's key),
    the `seq` of its next entry and the `updated_at` it last stored (or read).

    Kept so that a write is one INSERT, with no SELECT before it. Read from the file on the
    session's first write (`_SESSION_FOR_WRITE`), and again whenever an INSERT fails: a second
    writer on the file (another process, another store) that appended meanwhile makes the
    remembered `seq` stale, and the INSERT then hits the primary key (seqs of a session have no
    gaps, so the stale one is always taken), writes nothing, and runs again with the `seq` read
    in a write transaction. A remembered `seq` is never ahead of the file: each write advances
    it only after its INSERT succeeded, and every path that rolls back forgets all of them
    (`SqliteStore._forget_tails`). A session deleted meanwhile (and perhaps created again under
    the same id) fails the foreign key: numbers are never given twice (AUTOINCREMENT), so a
    remembered number never names another session.
    """

    __slots__ = ("next_seq", "number", "updated_at")

    def __init__(self, number: int, next_seq: int, updated_at: float) -> None:
        self.number = number
        self.next_seq = next_seq
        self.updated_at = updated_at


Tails = dict[str, Tail]
_TAILS_KEPT: Final = 65_536
"""Sessions remembered at most: beyond, all are forgotten (each costs one SELECT again)."""


def _load_tail(cur: sqlite3.Cursor, tails: Tails, session_id: str) -> Tail:
    """Read what `Tail` remembers of a session (inside a write transaction).

    Raises:
        SessionMissing: no such session.
    """
    row: tuple[int, float, int] | None = cur.execute(_SESSION_FOR_WRITE, (session_id,)).fetchone()
    if row is None:
        tails.pop(session_id, None)
        raise SessionMissing(session_id)
    if len(tails) >= _TAILS_KEPT:
        tails.clear()
    tail = tails[session_id] = Tail(row[0], row[2], row[1])
    return tail


def _after_conflict(
    cur: sqlite3.Cursor, tails: Tails, session_id: str, exc: sqlite3.IntegrityError, fresh: bool
) -> None:
    """Return when the failed INSERT (which wrote nothing) met a stale `Tail` and should
    run again with the tail read in a write transaction; raise otherwise. Stale: its `seq`
    was taken by another writer (the primary key failed), or its number is of a session
    deleted since and created again under this id (the foreign key failed).

    Raises:
        SessionMissing: the session does not exist (the foreign key failed).
        sqlite3.IntegrityError: `exc`, any other failure.
    """
    tails.pop(session_id, None)
    code = exc.sqlite_errorcode
    if (
        code == sqlite3.SQLITE_CONSTRAINT_FOREIGNKEY
        and cur.execute(SESSION_EXISTS, (session_id,)).fetchone() is None
    ):
        raise SessionMissing(session_id) from None
    stale = code in (sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY, sqlite3.SQLITE_CONSTRAINT_FOREIGNKEY)
    if stale and not fresh:
        return
    raise exc


def _bump(cur: sqlite3.Cursor, tail: Tail, now: float) -> None:
    """Store `now` as the session's `updated_at` (the caller checked `BUMP_RESOLUTION`)."""
    cur.execute(_BUMP_SESSION, (now, tail.number))
    tail.updated_at = now


def find_key(cur: sqlite3.Cursor, session_id: str, key: str) -> KeyRecord | None:
    row: tuple[str, bytes | None] | None = cur.execute(FIND_KEY_SQL, (session_id, key)).fetchone()
    return None if row is None else KeyRecord(row[0], row[1])


def insert_user_row(
    conn: Connection,
    tails: Tails,
    session_id: str,
    message_id: str,
    update: bytes,
    key: str | None,
    digest: bytes | None,
    now: float,
    fresh: bool = False,
) -> InsertOutcome:
    """Insert a user message with its key: one INSERT at the session's remembered next `seq`
    (`Tail`), in a transaction of a batch, or alone (in autocommit mode on the inline
    connection: the statement is its own transaction). A write that needs more statements
    (the session's first write here, a bump of `updated_at`, a stale `seq`) runs in a write
    transaction of its own when it is not in one.

    A recorded key is found by the unique index itself (no lookup first): the INSERT fails
    before writing anything (SQLite undoes the failed statement alone) and the recorded row
    is read. Nothing has been written then, so a retry writes nothing (not even `updated_at`),
    and a transaction, which may hold other writes of a batch, goes on. `SessionMissing` is
    also raised before any write.
    """
    tail = tails.get(session_id)
    if tail is None or tail.updated_at <= now - BUMP_RESOLUTION:
        if not conn.in_transaction:
            return db.write(
                conn, insert_user_row, tails, session_id, message_id, update, key, digest, now
            )
        if tail is None:
            tail = _load_tail(conn.cur, tails, session_id)
    cur = conn.cur
    seq = tail.next_seq
    # `_blob`, inline (the hot path)
    payload = bytearray(update) if len(update) <= _BLOB_COPY_LIMIT else update
    try:
        if key is None:
            cur.execute(_INSERT_USER, (tail.number, seq, message_id, payload))
        else:
            blob_digest = None if digest is None else bytearray(digest)
            cur.execute(
                _INSERT_KEYED_USER, (tail.number, seq, message_id, payload, key, blob_digest)
            )
    except sqlite3.IntegrityError as exc:
        if key is not None and exc.sqlite_errorcode == sqlite3.SQLITE_CONSTRAINT_UNIQUE:
            recorded = find_key(cur, session_id, key)
            if recorded is not None:
                return InsertOutcome(recorded.message_id, False, recorded.prompt_digest)
        _after_conflict(cur, tails, session_id, exc, fresh)
        if not conn.in_transaction:
            return db.write(
                conn, insert_user_row, tails, session_id, message_id, update, key, digest, now
            )
        return insert_user_row(conn, tails, session_id, message_id, update, key, digest, now, True)
    tail.next_seq = seq + 1
    if tail.updated_at <= now - BUMP_RESOLUTION:  # after the INSERT: a key recorded bumps nothing
        _bump(cur, tail, now)
    return InsertOutcome(message_id, True, digest)


def _append_sql(shape: tuple[bool, ...]) -> str:
    """One INSERT of len(shape) retained updates at seqs ?2, ?2 + 1, ... of session number ?1; each
    row takes its message id (when `shape` says it has one) and its payload, in order."""
    rows: list[str] = []
    n = 2
    for i, named in enumerate(shape):
        seq = "?2" if i == 0 else f"?2 + {i}"
        if named:
            rows.append(f"(?1, {seq}, ?{n + 1}, ?{n + 2})")
            n += 2
        else:
            rows.append(f"(?1, {seq}, NULL, ?{n + 1})")
            n += 1
    return "INSERT INTO timeline (session, seq, message_id, payload) VALUES " + ", ".join(rows)


def _append_statement(
    number: int, first: int, entries: Sequence[tuple[bytes, str | None]]
) -> tuple[str, tuple[object, ...]]:
    """The one INSERT that appends `entries` to session `number` from seq `first`, with its
    parameters."""
    if len(entries) == 1:
        update, message_id = entries[0]
        if message_id is None:
            return _INSERT_ANONYMOUS_UPDATE, (number, first, _blob(update))
        return _INSERT_UPDATE, (number, first, message_id, _blob(update))
    params: list[object] = [number, first]
    shape: list[bool] = []
    for update, message_id in entries:
        if message_id is None:
            shape.append(False)
        else:
            shape.append(True)
            params.append(message_id)
        params.append(bytearray(update) if len(update) <= _BLOB_COPY_LIMIT else update)
    key = tuple(shape)
    sql = _INSERT_UPDATES.get(key)
    if sql is None:
        sql = _INSERT_UPDATES[key] = _append_sql(key)
    return sql, tuple(params)


def append_rows(
    conn: Connection,
    tails: Tails,
    session_id: str,
    entries: Sequence[tuple[bytes, str | None]],
    now: float,
    fresh: bool = False,
) -> int:
    """Append `entries` in one INSERT (its own transaction or a batch's, as
    `insert_user_row` writes); return the seq of the first."""
    tail = tails.get(session_id)
    if tail is None or tail.updated_at <= now - BUMP_RESOLUTION:
        if not conn.in_transaction:
            return db.write(conn, append_rows, tails, session_id, entries, now)
        if tail is None:
            tail = _load_tail(conn.cur, tails, session_id)
    cur = conn.cur
    first = tail.next_seq
    try:
        cur.execute(*_append_statement(tail.number, first, entries))
    except sqlite3.IntegrityError as exc:
        _after_conflict(cur, tails, session_id, exc, fresh)
        if not conn.in_transaction:
            return db.write(conn, append_rows, tails, session_id, entries, now)
        return append_rows(conn, tails, session_id, entries, now, True)
    tail.next_seq = first + len(entries)
    if tail.updated_at <= now - BUMP_RESOLUTION:
        _bump(cur, tail, now)
    return first


_Outcome = tuple[bool, object]
"""What one write of a batch came to: (True, its result) or (False, its error)."""


def write_together(
    conn: Connection,
    works: Sequence[Callable[[Connection], object]],
    path: str,
    tails: Tails,
) -> list[_Outcome]:
    """Write a batch in one `BEGIN IMMEDIATE` transaction (in the worker thread); return each
    write's outcome, in order.

    A write that raises a `StorageError` (`SessionMissing`) has written nothing (see
    `insert_user_row`, `append_rows`): that is its answer, and the others go on. A SQLite
    error inside a write leaves the transaction in doubt: it is rolled back (and `tails`, which
    the rolled-back writes advanced, forgotten) and each write runs alone, so only the one at
    fault fails. A failure to begin or to commit fails all.
    """
    cur = conn.cur
    cur.execute("BEGIN IMMEDIATE")
    outcomes: list[_Outcome] = []
    try:
        for work in works:
            try:
                outcomes.append((True, work(conn)))
            except StorageError as exc:
                outcomes.append((False, exc))
    except sqlite3.Error:
        tails.clear()
        cur.execute("ROLLBACK")
    except BaseException:
        tails.clear()
        cur.execute("ROLLBACK")
        raise
    else:
        try:
            cur.execute("COMMIT")
        except BaseException:
            tails.clear()
            if conn.in_transaction:
                cur.execute("ROLLBACK")
            raise
        return outcomes
    outcomes = []
    for work in works:
        try:
            outcomes.append((True, db.write(conn, work)))
        except StorageError as exc:
            outcomes.append((False, exc))
        except sqlite3.Error as exc:
            tails.clear()
            outcomes.append((False, StorageError(f"{path}: {exc}")))
    return outcomes
