"""The SQLite store: stdlib `sqlite3`, one connection, one worker thread at a time.

Layout (see `schema.py`): a `sessions` table, each session with a number that is never
given twice, and a `timeline` table whose rows are the retained `session/update` objects of
each session in `seq` order, keyed by that number (`session`; the text id stays in
`sessions`). **The idempotency key is a nullable column of the user-message row itself**,
next to the prompt digest, guarded by the partial unique index `timeline_user_keys (session,
idempotency_key) WHERE idempotency_key IS NOT NULL`. We chose this over a separate
`user_keys` table because:

* the key and its message are one row, written by one INSERT, so no crash, bug or missing
  transaction can ever store one without the other (R38, D14): "store the key in the same
  step as the message";
* the key lives exactly as long as the message (R34, D13): deleting or compacting rows
  forgets their keys with no second table to keep in step;
* a fork copies rows with `idempotency_key = NULL`, so it cannot inherit keys (R32, D15);
* `find_key` is one probe of the partial index, whatever the length of the history (proven
  with `EXPLAIN QUERY PLAN` in the tests), and the key column is never selected into a record.

Concurrency and durability:

* Every call runs in a worker thread through `anyio.to_thread.run_sync` with a
  `CapacityLimiter(1)` owned by the store, so calls on one store are serialised on its one
  connection (opened with `check_same_thread=False` for exactly this reason).
* A user message or a set of retained updates is one INSERT statement at the session's next
  `seq`, which the store remembers between writes (`Tail`; read on the session's first
  write, and again when an INSERT meets a primary key taken by another writer on the file):
  the key and its message are one row of that statement, and a turn's final update and end
  record two rows of one. Inline, on a free database, a lone write is that statement alone
  in autocommit mode (its own transaction). Every other write is a `BEGIN IMMEDIATE ...
  COMMIT` transaction: the write lock is taken up front, so what it reads cannot change
  before it writes, even from another process using the same file (the agent restarted
  while a test counts messages, or two stores on one file). `busy_timeout` (5000 ms by
  default) makes the second writer wait instead of failing with "database is locked" (the
  LangGraph #8136 lesson).
* Group commit (`group_commit=True`, the default; `acp_once.storage.grouping`): user
  messages and retained updates go through one queue with one writer. A lone write is
  written at once, as above. Writes of several sessions that queue together (while the
  writer lets the other ready tasks run once because the sessions interleave, or while a
  batch waits in the worker thread for another connection's lock) are written in one
  `BEGIN IMMEDIATE` transaction, like a lone write (inline when the database is free); each
  caller is answered after that COMMIT, with its own outcome. A write that fails in a batch
  has written nothing (`SessionMissing` is found before any write, a recorded key by the
  failed INSERT alone), so the others commit.
* WAL journal mode, so readers never block the writer and vice versa.
* Checkpoints (copying the WAL back into the database file, with an fsync) run in a thread
  of their own (`Checkpointer`), never on a caller's path.
* `synchronous=NORMAL` (default): in WAL mode a committed transaction survives a crash of
  the process, SIGKILL included, because the WAL is in the OS page cache; a power loss or
  OS crash may lose the last few commits (never corrupting the file). `synchronous="FULL"`
  fsyncs the WAL at every commit: durable against power loss, at the price of one fsync per
  insert (several times slower on most disks, see `benchmarks/bench_store.py`).
* Foreign keys are on (`ON DELETE CASCADE` from sessions to timeline); deletes also remove
  the timeline explicitly, so a connection without the pragma cannot leave orphans.

The schema is migrated explicitly (`schema.py`): `SqliteStore.open(path)` applies the
pending migrations by default; with `migrate=False` an out-of-date file raises
`SchemaOutOfDate`, which tells the user to run `acp-once db migrate` (see
`schema.migrate_database`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import time
from typing import TYPE_CHECKING, Any, Final, TypeAlias, TypeVar, cast

import anyio
import anyio.to_thread
import orjson

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
from acp_once.storage.grouping import GroupCommit, GroupStats, Write, settle_each
from acp_once.storage.sqlite.checkpoint import (
    CHECKPOINT_EVERY,
    CHECKPOINT_LAG_LIMIT,
    Checkpointer,
    truncate_checkpoint,
)
from acp_once.storage.sqlite.schema import connect, prepare_schema
from acp_once.storage.sqlite.writer import WriterOp, WriterProcess
from acp_once.storage.sqlite.writes import (
    BUMP_RESOLUTION,
    FIND_KEY_SQL,
    SESSION_EXISTS,
    SESSION_NUMBER,
    Tail,
    Tails,
    append_rows,
    find_key,
    insert_user_row,
    write_together,
)
from acp_once.support import sqlite as db
from acp_once.support.busypoll import DEFAULT_LIMIT_S, check_busy_poll
from acp_once.support.opening import AsyncClosing, Opening
from acp_once.support.sqlite import Connection, Synchronous, prepare_file

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

__all__ = ["BUMP_RESOLUTION", "FIND_KEY_SQL", "SqliteStore", "Synchronous"]

_T = TypeVar("_T")

# -- SQL ----------------------------------------------------------------------------------------
# Module constants so that the tests can run `EXPLAIN QUERY PLAN` on the exact statements.

_SESSION_COLUMNS: Final = (
    "session_id, cwd, additional_directories, title, created_at, updated_at, forked_from, tenant"
)
_INSERT_SESSION: Final = (
    f"INSERT INTO sessions ({_SESSION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_GET_SESSION: Final = f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE session_id = ?"
_LIST_ORDER: Final = " ORDER BY updated_at DESC, session_id ASC LIMIT ?"
_AFTER_CURSOR: Final = "(updated_at < ? OR (updated_at = ? AND session_id > ?))"
_READ_TIMELINE: Final = (
    "SELECT seq, message_id, payload FROM timeline"
    f" WHERE session = {SESSION_NUMBER} AND seq > ? ORDER BY seq LIMIT ?"
)
_READ_TAIL: Final = (
    "SELECT seq, message_id, payload FROM timeline"
    f" WHERE session = {SESSION_NUMBER} ORDER BY seq DESC LIMIT ?"
)
_COUNT_USER: Final = (
    f"SELECT COUNT(*) FROM timeline WHERE session = {SESSION_NUMBER} AND is_user_message = 1"
)
_COUNT_KEY: Final = (
    f"SELECT COUNT(*) FROM timeline WHERE session = {SESSION_NUMBER} AND idempotency_key = ?"
)
# Keys (and digests, which belong to them) are deliberately not copied into a fork.
_COPY_TIMELINE: Final = (
    "INSERT INTO timeline (session, seq, message_id, payload, is_user_message)"
    f" SELECT {SESSION_NUMBER}, seq, message_id, payload, is_user_message FROM timeline"
    f" WHERE session = {SESSION_NUMBER} ORDER BY seq"
)
_DELETE_TIMELINE: Final = f"DELETE FROM timeline WHERE session = {SESSION_NUMBER}"

_SessionRow = tuple[str, str, bytes, str | None, float, float, str | None, str | None]


def _to_row(record: SessionRecord) -> _SessionRow:
    return (
        record.session_id,
        record.cwd,
        orjson.dumps(list(record.additional_directories)),
        record.title,
        record.created_at,
        record.updated_at,
        record.forked_from,
        record.tenant,
    )


def _from_row(row: _SessionRow) -> SessionRecord:
    session_id, cwd, dirs, title, created_at, updated_at, forked_from, tenant = row
    return SessionRecord(
        session_id=session_id,
        cwd=cwd,
        additional_directories=tuple(orjson.loads(dirs)),
        title=title,
        created_at=created_at,
        updated_at=updated_at,
        forked_from=forked_from,
        tenant=tenant,
    )


def _insert_session(conn: Connection, record: SessionRecord) -> int:
    """Insert the session's row; return its number (`sessions.number`)."""
    try:
        number = conn.execute(_INSERT_SESSION, _to_row(record)).lastrowid
    except sqlite3.IntegrityError as exc:
        if "UNIQUE" not in str(exc):
            raise
        raise SessionExists(record.session_id) from None
    assert number is not None
    return number


def _find_key_call(conn: Connection, session_id: str, key: str) -> KeyRecord | None:
    return find_key(conn.cur, session_id, key)


def _close_all(*conns: Connection | None) -> None:
    for conn in conns:
        if conn is not None:
            conn.close()


_Work: TypeAlias = "Callable[[Connection], object]"
"""A grouped write: a function of the connection."""


class SqliteStore(AsyncClosing):
    """A `SessionStore` in one SQLite file. Create it with `SqliteStore.open(path)`."""

    def __init__(
        self,
        conn: Connection,
        limiter: anyio.CapacityLimiter,
        *,
        path: str,
        clock: Callable[[], float],
        fast: Connection | None = None,
        checkpointer: Checkpointer | None = None,
        group_commit: bool = False,
        writer: WriterProcess | None = None,
    ) -> None:
        """Wrap an open, migrated connection; use `SqliteStore.open` instead."""
        self._conn: Connection | None = conn
        self._writer = writer
        self._group: GroupCommit[_Work] | None = (
            GroupCommit(self._write_alone, self._write_batch, gather=True) if group_commit else None
        )
        self._fast = fast
        self._fast_calls = 0
        self._checkpointer = checkpointer
        self._thread_calls = 0  # calls running in, or waiting for, the worker thread
        self._limiter = limiter
        self._path = path
        self._clock = clock
        self._tails: Tails = {}
        """What the store remembers of each session it writes to (`Tail`)."""

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        migrate: bool = True,
        synchronous: Synchronous = "NORMAL",
        busy_timeout_ms: int = 5000,
        clock: Callable[[], float] = time.time,
        inline: bool = True,
        group_commit: bool = True,
        writer_process: bool = False,
        busy_poll_s: float = DEFAULT_LIMIT_S,
    ) -> Opening[SqliteStore]:
        """Open (creating if needed) the database at `path`; await it or `async with` it.

        Args:
            path: the database file (`":memory:"` gives a private in-memory database).
            migrate: apply pending schema migrations. With False, an out-of-date database
                raises `SchemaOutOfDate` instead.
            synchronous: `"NORMAL"` survives process crashes; `"FULL"` also power loss.
            busy_timeout_ms: how long a write waits for another connection's write lock.
            clock: "now" in seconds since the epoch, for bumping `updated_at`.
            inline: run small calls on the event loop when the database is free (see
                `_call`); False sends every call to the worker thread.
            group_commit: write user messages and retained updates of many sessions that
                arrive together in one transaction (see `_write`); False gives every write
                a transaction of its own.
            writer_process: write user messages and retained updates in a process of the
                store's own (`acp_once.storage.sqlite.writer`), with group commit, so that
                SQLite's work runs beside the event loop: for a server with many busy
                connections. Ignored for an in-memory database.
            busy_poll_s: with `writer_process`, how long the event loop keeps polling for
                the writer's answers instead of sleeping, after each batch it sends
                (`acp_once.support.busypoll`: lower latency for some CPU); 0: never.

        Raises:
            ValueError: an unknown `synchronous` level, or a negative `busy_timeout_ms` or
                `busy_poll_s`.
            SchemaOutOfDate: `migrate=False` and the schema is older than required.
            StorageError: the file cannot be opened, or its schema is newer than supported.
        """
        db.check_options(synchronous, busy_timeout_ms)
        check_busy_poll(busy_poll_s)
        where = os.path.expanduser(os.fspath(path))  # also for the connections opened below

        def connect_and_prepare() -> Connection:
            try:
                conn = connect(prepare_file(where), synchronous, busy_timeout_ms)
            except (sqlite3.Error, OSError) as exc:
                raise StorageError(f"{where}: cannot open the database: {exc}") from exc
            try:
                prepare_schema(conn, migrate=migrate, where=where)
            except BaseException as exc:
                conn.close()
                if isinstance(exc, sqlite3.Error):
                    raise StorageError(f"{where}: {exc}") from exc
                raise
            return conn

        def connect_fast() -> Connection | None:
            if not inline or where == ":memory:" or where.startswith("file::memory:"):
                return None  # a second connection would be a different database
            # set up with the normal timeout (another opener may be migrating the file), then
            # never wait: a busy inline call goes to the thread instead
            fast = connect(where, synchronous, busy_timeout_ms)
            fast.execute("PRAGMA busy_timeout = 0")
            fast.execute("PRAGMA wal_autocheckpoint = 0")  # checkpoints run in the thread
            return fast

        async def open_() -> SqliteStore:
            limiter = anyio.CapacityLimiter(1)
            conn = await anyio.to_thread.run_sync(connect_and_prepare, limiter=limiter)
            fast = await anyio.to_thread.run_sync(connect_fast, limiter=limiter)
            checkpointer = None
            writer = None
            if writer_process and fast is not None:
                writer = WriterProcess(where, synchronous, busy_timeout_ms, busy_poll_s)
                try:
                    await writer.start()
                except BaseException:
                    await anyio.to_thread.run_sync(_close_all, conn, fast)
                    raise
            elif fast is not None:
                checkpointer = await anyio.to_thread.run_sync(
                    Checkpointer.open, where, synchronous, limiter=limiter
                )
            return cls(
                conn,
                limiter,
                path=where,
                clock=clock,
                fast=fast,
                checkpointer=checkpointer,
                group_commit=group_commit and writer is None,
                writer=writer,
            )

        return Opening(open_, SqliteStore.aclose)

    def __repr__(self) -> str:
        state = "closed" if self._conn is None else "open"
        return f"<SqliteStore {self._path!r} {state}>"

    async def _call(
        self,
        fn: Callable[[Connection], _T],
        *,
        inline: bool = False,
        threaded: Callable[[Connection], _T] | None = None,
    ) -> _T:
        """Run `fn(connection)` one call at a time: inline when it is small and the database
        is free, otherwise in the store's worker thread (`threaded(connection)` there, when
        given: a lone write runs in autocommit mode inline, in a transaction in the thread).

        Inline (the hot path: key lookups, inserts, appends): a thread hop costs more than such
        a call (~120 us against ~20-60 us in WAL mode), so it runs on the event loop with a
        second connection whose busy timeout is 0. If another connection holds the write lock,
        it fails at once without having written anything (`BEGIN IMMEDIATE` is where it
        waits) and the call goes to the thread, which may wait for the lock. Auto-checkpoints
        are off on that connection; every 250th inline call asks the store's checkpoint thread
        for one (`Checkpointer`), without waiting for it. While that thread runs a RESTART
        checkpoint (which holds writers off for its copy and fsync), calls go to the worker
        thread, which waits on the checkpointer's `restarting` lock and so wakes the moment
        the checkpoint ends. A call runs inline only when no call runs in or waits for the
        thread (a counter, cheaper than taking the limiter): it does not await, so nothing
        starts in the middle of it, and it never overtakes an earlier call.

        Cancellation: we keep `to_thread.run_sync`'s default `abandon_on_cancel=False`. A
        thread call that waits for its turn is cancelled there, having run nothing. Once it
        runs, a cancelled caller waits until the thread has finished and gets its result; the
        cancellation is delivered at its next checkpoint. Every transaction has then
        committed or rolled back, and the caller knows which (`SessionStore.insert_user_message`:
        an insert committed while its caller was cancelled must not go unnoticed, or the
        message would be stored with its turn never started). Abandoning the thread instead
        would release the limiter while the thread still works, letting the next call use
        the same connection in the middle of a transaction (the encode/databases #460 bug
        class). The price: cancellation waits for at most one busy timeout. An inline call
        cannot be cancelled half-way: it does not await.
        """
        checkpointer = self._checkpointer
        if (
            inline
            and self._fast is not None
            and not self._thread_calls
            and not (checkpointer is not None and checkpointer.restarting.locked())
        ):
            done, result = self._inline(fn)
            if done:
                self._fast_calls += 1
                if checkpointer is not None and self._fast_calls % CHECKPOINT_EVERY == 0:
                    if self._fast_calls - checkpointer.done_for > CHECKPOINT_LAG_LIMIT:
                        # back-pressure: the thread is not keeping up (a write burst with no
                        # pause), so this caller checkpoints and waits, as SQLite would
                        await self._threaded(
                            functools.partial(truncate_checkpoint, lock=checkpointer.lock)
                        )
                        checkpointer.done_for = self._fast_calls
                    checkpointer.poke(self._fast_calls)
                return result  # type: ignore[return-value]
        # a thread call runs or waits (queue behind it), or the database was busy
        return await self._threaded(fn if threaded is None else threaded)

    def _write(self, session_id: str, work: Callable[[Connection], _T]) -> Awaitable[_T]:
        """Run `work(connection)` in a write transaction: its own, or with group commit the
        next batch's (`acp_once.storage.grouping`).

        A lone write is written as without group commit. A batch is written the same way, in
        one transaction: inline when the database is free (a thread hop and the wake-ups
        around it cost more CPU than they free the event loop for: measured with callgrind
        and /proc at 8 and 20 busy sessions), else in the worker thread, which waits for the
        lock while the writes that arrive queue for the next batch. `work` must write nothing
        when it raises a `StorageError` (it then answers its caller alone).

        Not a coroutine itself: it hands back the one its caller awaits (one frame fewer to
        suspend and resume per write).
        """
        group = self._group
        if group is None:
            return cast("Awaitable[_T]", self._write_alone(work))
        written: Awaitable[_T] = group.submit(session_id, work)
        return written

    def _write_op(self, op: WriterOp) -> Awaitable[Any]:
        """Hand `op` to the writer process, which batches it (`writer.WriterProcess`)."""
        writer = self._writer
        assert writer is not None
        written: Awaitable[Any] = writer.submit(op)
        return written

    async def _write_alone(self, work: _Work) -> object:
        # Inline, `work` runs in autocommit mode: its one INSERT is its own transaction (two
        # statements fewer than BEGIN IMMEDIATE ... COMMIT), and a write of several statements
        # opens its own (`insert_user_row`). In the thread, which may wait for the lock, the
        # transaction is taken first: in WAL mode a write that found another commit after
        # it started reading fails at once instead of waiting (SQLITE_BUSY_SNAPSHOT).
        return await self._call(work, inline=True, threaded=functools.partial(db.write, work=work))

    async def _write_batch(self, batch: list[Write[_Work]]) -> None:
        together = functools.partial(
            write_together,
            works=[write.work for write in batch],
            path=self._path,
            tails=self._tails,
        )
        outcomes = await self._call(together, inline=True)
        settle_each(batch, outcomes)

    @property
    def group_stats(self) -> GroupStats | None:
        """How many batches (transactions; with the writer process, frames sent to it) and
        writes group commit has written; None without group commit. For tests and
        benchmarks."""
        if self._writer is not None:
            return self._writer.stats
        return None if self._group is None else self._group.stats

    async def _threaded(self, fn: Callable[[Connection], _T]) -> _T:
        self._thread_calls += 1
        try:
            return await anyio.to_thread.run_sync(
                functools.partial(self._in_thread, fn), limiter=self._limiter
            )
        finally:
            self._thread_calls -= 1

    def _inline(self, fn: Callable[[Connection], _T]) -> tuple[bool, _T | None]:
        fast = self._fast
        if fast is None or self._conn is None:
            raise StorageError("the store is closed")
        try:
            return True, fn(fast)
        except sqlite3.Error as exc:
            # a write may have advanced a `Tail`, then rolled back: forget them all (rare)
            self._tails.clear()
            if isinstance(exc, sqlite3.OperationalError) and exc.sqlite_errorcode & 0xFF in (
                sqlite3.SQLITE_BUSY,
                sqlite3.SQLITE_LOCKED,
            ):
                return False, None  # nothing was written: retry in the thread, which may wait
            raise StorageError(f"{self._path}: {exc}") from exc

    def _in_thread(self, fn: Callable[[Connection], _T]) -> _T:
        conn = self._conn
        if conn is None:
            raise StorageError("the store is closed")
        checkpointer = self._checkpointer
        if checkpointer is not None and checkpointer.restarting.locked():
            # a RESTART checkpoint holds writers off: wake when it ends, not at the next
            # tick of SQLite's busy handler (which sleeps in steps of up to 100 ms)
            with checkpointer.restarting:
                pass
        try:
            return fn(conn)
        except sqlite3.Error as exc:
            self._tails.clear()  # a write may have advanced one, then rolled back
            # SQLite messages name tables and columns, never the values (so never a key).
            raise StorageError(f"{self._path}: {exc}") from exc

    # -- sessions ----------------------------------------------------------------------------

    async def create_session(self, record: SessionRecord) -> None:
        tails = self._tails

        def work(conn: Connection) -> None:
            number = _insert_session(conn, record)
            # its first write reads nothing
            tails[record.session_id] = Tail(number, 1, record.updated_at)

        await self._call(functools.partial(db.write, work=work), inline=True)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        def work(conn: Connection) -> SessionRecord | None:
            row: _SessionRow | None = conn.execute(_GET_SESSION, (session_id,)).fetchone()
            return None if row is None else _from_row(row)

        return await self._call(work, inline=True)

    async def list_sessions(
        self,
        *,
        cwd: str | None = None,
        cursor: str | None = None,
        limit: int = 100,
        tenant: str | AnyTenant | None = ANY_TENANT,
    ) -> tuple[list[SessionRecord], str | None]:
        after = list_position(cursor, limit)
        clauses: list[str] = []
        params: list[str | float | int] = []
        if cwd is not None:
            clauses.append("cwd = ?")
            params.append(cwd)
        if tenant is None:
            clauses.append("tenant IS NULL")
        elif not isinstance(tenant, AnyTenant):
            clauses.append("tenant = ?")
            params.append(tenant)
        if after is not None:
            clauses.append(_AFTER_CURSOR)
            params.extend((after[0], after[0], after[1]))
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        sql = f"SELECT {_SESSION_COLUMNS} FROM sessions{where}{_LIST_ORDER}"
        params.append(limit + 1)  # one more than asked tells whether a next page exists

        def work(conn: Connection) -> list[SessionRecord]:
            rows: list[_SessionRow] = conn.execute(sql, params).fetchall()
            return [_from_row(row) for row in rows]

        records = await self._call(work)
        return one_page(records, limit)

    async def delete_session(self, session_id: str) -> bool:
        tails = self._tails

        def work(conn: Connection) -> bool:
            tails.pop(session_id, None)
            conn.execute(_DELETE_TIMELINE, (session_id,))
            return (
                conn.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,)).rowcount
                > 0
            )

        deleted = await self._call(functools.partial(db.write, work=work))
        await self._forget_in_writer(session_id)
        return deleted

    async def update_session(
        self,
        session_id: str,
        *,
        title: str | Unchanged | None = UNCHANGED,
        updated_at: float | Unchanged = UNCHANGED,
    ) -> SessionRecord:
        assignments: list[str] = []
        params: list[str | float | None] = []
        if not isinstance(title, Unchanged):
            assignments.append("title = ?")
            params.append(title)
        if not isinstance(updated_at, Unchanged):
            assignments.append("updated_at = ?")
            params.append(updated_at)
        params.append(session_id)
        sql = f"UPDATE sessions SET {', '.join(assignments)} WHERE session_id = ?"

        tails = self._tails

        def work(conn: Connection) -> SessionRecord:
            if not isinstance(updated_at, Unchanged):
                tails.pop(session_id, None)  # read again at the next write
            if assignments:
                conn.execute(sql, params)
            row: _SessionRow | None = conn.execute(_GET_SESSION, (session_id,)).fetchone()
            if row is None:
                raise SessionMissing(session_id)
            return _from_row(row)

        record = await self._call(functools.partial(db.write, work=work), inline=True)
        if not isinstance(updated_at, Unchanged):
            await self._forget_in_writer(session_id)
        return record

    async def _forget_in_writer(self, session_id: str) -> None:
        """Make the writer process read the session's tail again at its next write, as the
        store does in-process (`Tail`): after a delete, or `updated_at` set by hand."""
        if self._writer is not None:
            await self._write_op(("f", session_id))

    async def fork_session(self, source_id: str, new_record: SessionRecord) -> None:
        def work(conn: Connection) -> None:
            if conn.execute(SESSION_EXISTS, (source_id,)).fetchone() is None:
                raise SessionMissing(source_id)
            _insert_session(conn, new_record)
            conn.execute(_COPY_TIMELINE, (new_record.session_id, source_id))

        await self._call(functools.partial(db.write, work=work))

    # -- timeline and keys -------------------------------------------------------------------

    async def insert_user_message(
        self,
        session_id: str,
        *,
        message_id: str,
        update: bytes,
        idempotency_key: str | None,
        prompt_digest: bytes | None,
    ) -> InsertOutcome:
        now = self._clock()
        if self._writer is not None:
            op = ("u", session_id, message_id, update, idempotency_key, prompt_digest, now)
            outcome: InsertOutcome = await self._write_op(op)
            return outcome
        tails = self._tails
        return await self._write(
            session_id,
            lambda conn: insert_user_row(
                conn, tails, session_id, message_id, update, idempotency_key, prompt_digest, now
            ),
        )

    async def find_key(self, session_id: str, key: str) -> KeyRecord | None:
        return await self._call(
            functools.partial(_find_key_call, session_id=session_id, key=key), inline=True
        )

    async def append_update(
        self, session_id: str, update: bytes, *, message_id: str | None = None
    ) -> int:
        now = self._clock()
        if self._writer is not None:
            op = ("a", session_id, ((update, message_id),), now)
            seq: int = await self._write_op(op)
            return seq
        tails = self._tails
        return await self._write(
            session_id,
            lambda conn: append_rows(conn, tails, session_id, ((update, message_id),), now),
        )

    async def append_updates(
        self, session_id: str, updates: Sequence[tuple[bytes, str | None]]
    ) -> list[int]:
        """`AppendsUpdates.append_updates`: one transaction for all of them (the runtime
        writes a turn's last retained update and its closing marker together: one commit,
        one WAL append, instead of two)."""
        entries = list(updates)
        if not entries:

            def exists(conn: Connection) -> None:
                if conn.execute(SESSION_EXISTS, (session_id,)).fetchone() is None:
                    raise SessionMissing(session_id)

            await self._call(exists, inline=True)
            return []
        now = self._clock()
        if self._writer is not None:
            first: int = await self._write_op(("a", session_id, entries, now))
            return list(range(first, first + len(entries)))
        tails = self._tails
        first = await self._write(
            session_id, lambda conn: append_rows(conn, tails, session_id, entries, now)
        )
        return list(range(first, first + len(entries)))

    async def read_timeline(
        self, session_id: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TimelineEntry]:
        check_limit(limit)

        def work(conn: Connection) -> list[TimelineEntry]:
            rows: list[tuple[int, str | None, bytes]] = conn.execute(
                _READ_TIMELINE, (session_id, after_seq, limit)
            ).fetchall()
            return [TimelineEntry(session_id, seq, mid, payload) for seq, mid, payload in rows]

        return await self._call(work)

    async def read_timeline_tail(self, session_id: str, *, limit: int = 1) -> list[TimelineEntry]:
        check_limit(limit)

        def work(conn: Connection) -> list[TimelineEntry]:
            rows: list[tuple[int, str | None, bytes]] = conn.execute(
                _READ_TAIL, (session_id, limit)
            ).fetchall()
            return [
                TimelineEntry(session_id, seq, mid, payload) for seq, mid, payload in reversed(rows)
            ]

        return await self._call(work, inline=True)

    async def count_user_messages(
        self, session_id: str, *, idempotency_key: str | None = None
    ) -> int:
        def work(conn: Connection) -> int:
            if idempotency_key is None:
                row: tuple[int] = conn.execute(_COUNT_USER, (session_id,)).fetchone()
            else:
                row = conn.execute(_COUNT_KEY, (session_id, idempotency_key)).fetchone()
            return row[0]

        return await self._call(work, inline=True)

    async def aclose(self) -> None:
        """Close the connection after the call in progress (if any). Idempotent."""

        def close(conn: Connection) -> None:
            self._conn = None
            conn.close()
            if self._fast is not None:
                self._fast.close()
                self._fast = None
            if self._checkpointer is not None:
                self._checkpointer.close()
                self._checkpointer = None

        if self._conn is None:
            return
        if self._writer is not None:
            await self._writer.aclose()  # after the batch in flight, as below
        # Bounded cleanup: waits for at most the one call in flight, so shielding is safe and
        # guarantees the connection is closed even if the closing task is being cancelled.
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(StorageError):  # closed meanwhile by another aclose()
                await self._call(close)
