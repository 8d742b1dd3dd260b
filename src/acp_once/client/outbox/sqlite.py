"""The SQLite outbox: stdlib `sqlite3`, one connection, one worker thread at a time.

One table, `outbox_submissions`, one row per pending submission. `seq` is an
`INTEGER PRIMARY KEY AUTOINCREMENT`, so it is strictly increasing across sessions and never
reused, even after the newest submission was completed or the client restarted: it is the
original order a restarted client resends in (`pending()` is `ORDER BY seq`). A unique
index on `(session_id, idempotency_key)` makes one key name at most one pending submission
of a session. The tables are prefixed `outbox_`, so the outbox may share a file with other
data; it is still best kept in its own file, one per client identity.

Durability: `add` commits before it returns, so the caller sends the first attempt only once
the submission is on disk.

* `synchronous=NORMAL` (default) in WAL mode: a committed transaction survives a crash of the
  client process, SIGKILL included (the WAL is written before COMMIT returns and lives in the
  OS page cache; the tests kill a child process right after `add` and find the submission).
  A power loss or an OS crash may lose the last few commits, never corrupting the file.
* `synchronous="FULL"` also fsyncs the WAL at every commit: durable against power loss, at the
  price of one fsync per write.

Concurrency: every call runs in a worker thread through `anyio.to_thread.run_sync` with a
`CapacityLimiter(1)` owned by the outbox, so calls on one outbox are serialised on its one
connection. Writes are `BEGIN IMMEDIATE ... COMMIT`, with `busy_timeout` (5000 ms by default)
so that two outboxes (or processes) on one file wait for each other instead of failing.

The schema is migrated when the outbox opens: `MIGRATIONS` is append-only, and the applied
versions are rows of `outbox_schema_version`. A file with a newer schema is refused.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Final, TypeVar

import anyio
import anyio.to_thread

from acp_once.client.outbox.base import (
    OutboxError,
    Submission,
    SubmissionNotFound,
    new_submission,
    replayed,
)
from acp_once.support import sqlite as db
from acp_once.support.migrations import Migration, Migrations
from acp_once.support.opening import AsyncClosing, Opening
from acp_once.support.sqlite import Connection, Synchronous

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["LATEST_VERSION", "MIGRATIONS", "SqliteOutbox", "Synchronous", "current_version"]

_T = TypeVar("_T")

# -- schema -------------------------------------------------------------------------------------

MIGRATIONS: Final = Migrations(
    (
        Migration(
            "pending prompt submissions with their idempotency keys",
            (
                """
                CREATE TABLE outbox_submissions (
                    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
                    submission_id   TEXT NOT NULL UNIQUE,
                    session_id      TEXT NOT NULL,
                    idempotency_key TEXT NOT NULL,
                    prompt          BLOB NOT NULL,    -- the prompt content-block array (JSON)
                    created_at      REAL NOT NULL,
                    attempts        INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0)
                )
                """,
                """
                CREATE UNIQUE INDEX outbox_submissions_by_key
                ON outbox_submissions (session_id, idempotency_key)
                """,
            ),
        ),
    ),
    version_table="outbox_schema_version",
)

LATEST_VERSION: Final = MIGRATIONS.latest
"""The schema version this code needs."""

# -- SQL ----------------------------------------------------------------------------------------

_COLUMNS: Final = "submission_id, session_id, idempotency_key, prompt, created_at, seq, attempts"
_SELECT: Final = f"SELECT {_COLUMNS} FROM outbox_submissions"
_PENDING: Final = f"{_SELECT} ORDER BY seq"
_PENDING_IN_SESSION: Final = f"{_SELECT} WHERE session_id = ? ORDER BY seq"
_GET: Final = f"{_SELECT} WHERE submission_id = ?"
_FIND_KEY: Final = f"{_SELECT} WHERE session_id = ? AND idempotency_key = ?"
_INSERT: Final = (
    "INSERT INTO outbox_submissions"
    " (submission_id, session_id, idempotency_key, prompt, created_at, attempts)"
    " VALUES (?, ?, ?, ?, ?, 0)"
)
_COUNT_ATTEMPT: Final = (
    "UPDATE outbox_submissions SET attempts = attempts + 1 WHERE submission_id = ?"
)
_DELETE: Final = "DELETE FROM outbox_submissions WHERE submission_id = ?"

_Row = tuple[str, str, str, bytes, float, int, int]


def _from_row(row: _Row) -> Submission:
    return Submission(*row)


# -- synchronous helpers (run in the worker thread) ---------------------------------------------


def current_version(conn: sqlite3.Connection) -> int:
    """Return the highest applied outbox schema version; 0 for a file without the table."""
    return db.current_version(conn, MIGRATIONS)


def _connect(path: str, synchronous: Synchronous, busy_timeout_ms: int) -> Connection:
    conn = db.connect(path, synchronous, busy_timeout_ms)
    try:
        if current_version(conn) < LATEST_VERSION:
            db.apply_migrations(conn, MIGRATIONS)  # reads the version again under the lock
        message = MIGRATIONS.too_new(current_version(conn), path, "outbox")
        if message is not None:
            raise OutboxError(message)
    except BaseException:
        conn.close()
        raise
    return conn


class SqliteOutbox(AsyncClosing):
    """An `Outbox` in one SQLite file. Create it with `SqliteOutbox.open(path)`."""

    def __init__(
        self,
        conn: Connection,
        limiter: anyio.CapacityLimiter,
        *,
        path: str,
        clock: Callable[[], float],
    ) -> None:
        """Wrap an open, migrated connection; use `SqliteOutbox.open` instead."""
        self._conn: Connection | None = conn
        self._limiter = limiter
        self._path = path
        self._clock = clock

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        synchronous: Synchronous = "NORMAL",
        busy_timeout_ms: int = 5000,
        clock: Callable[[], float] = time.time,
    ) -> Opening[SqliteOutbox]:
        """Open (creating and migrating if needed) the outbox at `path`.

        `outbox = await SqliteOutbox.open(path)` (then `await outbox.aclose()`), or
        `async with SqliteOutbox.open(path) as outbox:`.

        Args:
            path: the database file (`":memory:"` gives a private in-memory database).
            synchronous: `"NORMAL"` survives crashes of the process (SIGKILL included);
                `"FULL"` also power loss.
            busy_timeout_ms: how long a write waits for another connection's write lock.
            clock: "now" in seconds since the epoch, for `created_at`.

        Raises:
            OutboxError: the file cannot be opened, or its schema is newer than supported.
        """
        db.check_options(synchronous, busy_timeout_ms)
        where = os.path.expanduser(os.fspath(path))  # `~` is the home directory

        def connect() -> Connection:
            try:
                db.prepare_file(where)
                return _connect(where, synchronous, busy_timeout_ms)
            except OSError as exc:
                raise OutboxError(f"{where}: cannot create the outbox: {exc}") from exc
            except sqlite3.Error as exc:
                raise OutboxError(f"{where}: cannot open the outbox: {exc}") from exc

        async def open_() -> SqliteOutbox:
            limiter = anyio.CapacityLimiter(1)
            conn = await anyio.to_thread.run_sync(connect, limiter=limiter)
            return cls(conn, limiter, path=where, clock=clock)

        return Opening(open_, SqliteOutbox.aclose)

    def __repr__(self) -> str:
        state = "closed" if self._conn is None else "open"
        return f"<SqliteOutbox {self._path!r} {state}>"

    async def _call(self, fn: Callable[[Connection], _T]) -> _T:
        """Run `fn(connection)` in the outbox's worker thread, one call at a time.

        Cancellation: `to_thread.run_sync`'s default `abandon_on_cancel=False`. A call
        cancelled before its turn does nothing; a cancelled caller whose call already runs
        waits until its transaction has committed or rolled back. Abandoning the thread would
        let the next call use the connection in the middle of a transaction. So a cancelled
        `add` may still have stored the submission: it is then in `pending()`, and the
        recovery loop sends it like any other.
        """
        return await anyio.to_thread.run_sync(
            functools.partial(self._in_thread, fn), limiter=self._limiter
        )

    def _in_thread(self, fn: Callable[[Connection], _T]) -> _T:
        conn = self._conn
        if conn is None:
            raise OutboxError("the outbox is closed")
        try:
            return fn(conn)
        except sqlite3.Error as exc:
            # SQLite messages name tables and columns, never the values (so never a key).
            raise OutboxError(f"{self._path}: {exc}") from exc

    async def add(
        self,
        session_id: str,
        prompt: bytes,
        *,
        idempotency_key: str | None = None,
        now: float | None = None,
    ) -> Submission:
        new = new_submission(session_id, prompt, idempotency_key, now, self._clock)
        insert = (new.submission_id, session_id, new.idempotency_key, new.prompt, new.created_at)

        def work(conn: Connection) -> Submission:
            row: _Row | None = conn.execute(_FIND_KEY, insert[1:3]).fetchone()
            if row is not None:
                return replayed(_from_row(row), new.prompt)
            seq = conn.execute(_INSERT, insert).lastrowid
            assert seq is not None
            return replace(new, seq=seq)

        return await self._call(functools.partial(db.write, work=work))

    async def record_attempt(self, submission_id: str) -> None:
        def work(conn: Connection) -> None:
            if conn.execute(_COUNT_ATTEMPT, (submission_id,)).rowcount == 0:
                raise SubmissionNotFound(submission_id)

        await self._call(functools.partial(db.write, work=work))

    async def complete(self, submission_id: str) -> None:
        def work(conn: Connection) -> None:
            conn.execute(_DELETE, (submission_id,))

        await self._call(functools.partial(db.write, work=work))

    async def pending(self, session_id: str | None = None) -> list[Submission]:
        def work(conn: Connection) -> list[Submission]:
            if session_id is None:
                rows: list[_Row] = conn.execute(_PENDING).fetchall()
            else:
                rows = conn.execute(_PENDING_IN_SESSION, (session_id,)).fetchall()
            return [_from_row(row) for row in rows]

        return await self._call(work)

    async def get(self, submission_id: str) -> Submission | None:
        def work(conn: Connection) -> Submission | None:
            row: _Row | None = conn.execute(_GET, (submission_id,)).fetchone()
            return None if row is None else _from_row(row)

        return await self._call(work)

    async def aclose(self) -> None:
        """Close the connection after the call in progress (if any). Idempotent."""

        def close(conn: Connection) -> None:
            self._conn = None
            conn.close()

        if self._conn is None:
            return
        # Bounded cleanup: waits for at most the one call in flight, so shielding is safe and
        # guarantees the connection is closed even if the closing task is being cancelled.
        with anyio.CancelScope(shield=True), contextlib.suppress(OutboxError):
            await self._call(close)
