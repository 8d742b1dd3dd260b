"""The PostgreSQL store: psycopg 3 async on a connection pool, for several agent nodes.

Layout (see `migrations.py`), every table in one schema (`acp_once` by default, any name with
`schema=`), so several stores or test runs share a database without meeting:

* `sessions`: one row per session, with `next_seq`, the counter of its timeline;
* `timeline`: the retained `session/update` objects of each session in `seq` order. **The
  idempotency key is a nullable column of the user-message row itself** (`bytea`: the key's
  UTF-8 bytes, so keys compare byte for byte whatever the collation), guarded by the partial
  unique index `timeline_user_keys (session_id, idempotency_key) WHERE idempotency_key IS NOT
  NULL`, exactly as in the SQLite store: the key and its message are one row written by one
  INSERT, so neither can exist without the other; the key is forgotten with its row; a fork
  copies rows with `idempotency_key = NULL`; `find_key` is one probe of that index.

Concurrency (READ COMMITTED, which every write transaction asks for explicitly):

* `insert_user_message` locks the session row (`SELECT ... FOR NO KEY UPDATE`), looks the key
  up *after* the lock (a new statement sees every transaction that held the lock before), then
  inserts the row at `next_seq` and bumps `next_seq` and `updated_at` in one statement. Writers
  of one session are serialised by that lock, across connections, pools and processes, so
  `seq` is strictly increasing and two inserts of one new key insert once. The INSERT also says
  `ON CONFLICT (session_id, idempotency_key) ... DO NOTHING`: a writer that bypasses the lock
  still cannot record a key twice, and we then answer the recorded message.
* A guarded insert (`guard=`, a `WriteGuard`: see `guard.py`) is one statement instead: the
  guard's own locks, then the session row only when the guard holds, the key looked up in
  the statement's snapshot, the INSERT and `next_seq`, and what the guard adds after it. The
  guard is what makes that snapshot enough (the cluster's lease fence lets only the lease
  owner insert, one at a time); the unique index still refuses a duplicate.
* `append_update` is one statement (`UPDATE sessions ... RETURNING` feeding the INSERT), atomic
  on its own and serialised by the same row lock.
* Group commit (`group_commit=True`, the default; `acp_once.storage.grouping`): unguarded
  inserts and appends go through one queue with one writer. An insert is then one statement
  (`insert_one`: the lock, the lookup, the INSERT and `next_seq` together). A lone write is
  that statement in autocommit, one round trip; the writes that queue while a batch commits
  are sent together in pipeline mode inside one transaction (BEGIN, the writes as prepared
  statements and COMMIT in one write: one round trip, `connection.run_batch`), in the order
  of their session ids (see `_write_batch`), and each caller is answered after its COMMIT.
  Guarded writes are grouped the same way: a guard that does not hold writes nothing and is
  that write's own answer (a `FencingError`), and the others commit.

Cancellation (the encode/databases #460 lesson): a connection goes back to the pool only when
it is idle. When a call ends any other way (an error, or a cancellation at any await,
including in the middle of a statement) the store rolls the transaction back, shielded from
the cancellation and bounded in time, and closes the connection if it cannot be brought back
to idle; the pool then replaces it. The COMMIT itself is shielded, so a cancellation delivered
during it never leaves the caller unsure of the outcome for a reason of ours: once COMMIT is
sent, the call completes. `insert_user_message` is shielded as a whole (bounded): its guarded
form is one statement that commits on its own, which a cancellation cannot reliably stop, and
its caller must learn whether the message was stored (see `_insert_shielded`).

Keys are private (R29): PostgreSQL error messages can quote the values of a unique index
(`DETAIL: Key (session_id, idempotency_key)=(...)`). Every psycopg error is turned into a
`StorageError` built from the SQLSTATE and the primary message only, and raised *without* the
original exception attached (no `__cause__`, no `__context__`), so no traceback prints it.

Lifecycle (the LangGraph lessons #2570, #5327, #6741, #7304): `PostgresStore.open(dsn)` opens
and owns a pool (closed by `aclose`); `PostgresStore.open(pool)` uses the caller's
`AsyncConnectionPool` and leaves it open. Connections may be in autocommit mode or not; the
store opens its own transaction blocks either way. Migrations are explicit and numbered
(`migrations.py`, a `schema_version` table); `open` applies them unless `migrate=False`, which
raises `SchemaOutOfDate` naming `acp-once db migrate` instead.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool

from acp_once.storage.base import (
    ANY_TENANT,
    UNCHANGED,
    AnyTenant,
    FencingError,
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
from acp_once.storage.postgres.connection import (
    Conn,
    Pool,
    Query,
    connect,
    execute,
    fetch_all,
    fetch_one,
    key_bytes,
    run_batch,
    storage_error,
    transact,
    use,
)
from acp_once.storage.postgres.guard import guarded_statements
from acp_once.storage.postgres.migrations import prepare_schema
from acp_once.storage.postgres.sql import SESSION_COLUMNS, from_row, statements, to_params
from acp_once.storage.postgres.urls import DEFAULT_SCHEMA, check_schema, describe_postgres
from acp_once.storage.sharded import CopiedEntry
from acp_once.support.opening import AsyncClosing, Opening

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence

    from acp_once.storage.postgres.guard import WriteGuard

__all__ = ["PostgresStore"]

_T = TypeVar("_T")


_INSERT_TIMEOUT: Final = 60.0
"""Seconds a user message insert, shielded from cancellation, may take (`_insert_shielded`)."""


@dataclass(frozen=True, slots=True)
class _Work:
    """A grouped write: one statement, and what its rows come to (`finish`, which may run
    one more statement on the same connection, in the same transaction)."""

    query: Query
    params: Mapping[str, object]
    finish: Callable[[Conn, list[tuple[Any, ...]]], Awaitable[object]]


async def _alone(work: _Work, conn: Conn) -> object:
    """A grouped write written alone: its one statement, which commits on its own (sent
    as a batch of one without BEGIN and COMMIT: `run_batch`)."""
    rows = await run_batch(conn, [(work.query, work.params)], sent=[], transaction=False)
    return await work.finish(conn, rows[0])


class PostgresStore(AsyncClosing):
    """A `SessionStore` in a PostgreSQL schema. Create it with `PostgresStore.open(...)`."""

    def __init__(
        self,
        pool: Pool,
        *,
        schema: str,
        owns_pool: bool,
        where: str,
        clock: Callable[[], float],
        group_commit: bool = False,
    ) -> None:
        """Wrap an open pool on a migrated schema; use `PostgresStore.open` instead."""
        self._pool: Pool | None = pool
        self._group: GroupCommit[_Work] | None = (
            GroupCommit(self._write_alone, self._write_batch) if group_commit else None
        )
        self._owns_pool = owns_pool
        self._sql = statements(schema)
        self._where = where
        self._clock = clock

    @classmethod
    def open(
        cls,
        dsn_or_pool: str | Pool,
        *,
        migrate: bool = True,
        schema: str = DEFAULT_SCHEMA,
        min_size: int = 1,
        max_size: int = 10,
        prepare_threshold: int | None = 5,
        connect_timeout: float = 30.0,
        clock: Callable[[], float] = time.time,
        group_commit: bool = True,
        shard: bool = False,
    ) -> Opening[PostgresStore]:
        """Open the store in `schema`; await it or `async with` it.

        Args:
            dsn_or_pool: a libpq connection string or URL (the store then opens, owns and
                closes an `AsyncConnectionPool`), or the caller's open `AsyncConnectionPool`
                (left open by `aclose`; its connections may or may not be in autocommit mode).
            migrate: apply pending schema migrations (creating the schema if needed). With
                False, an out-of-date schema raises `SchemaOutOfDate` instead.
            schema: the PostgreSQL schema holding the store's tables.
            min_size: the smallest size of the store's own pool.
            max_size: the largest size of the store's own pool.
            prepare_threshold: psycopg's server-side prepared statements; None turns them off
                (needed behind PgBouncer in transaction mode). Own pool only.
            connect_timeout: seconds to wait for the first connections. Own pool only.
            clock: "now" in seconds since the epoch, for bumping `updated_at`.
            group_commit: write the user messages and retained updates of many
                sessions that arrive while a transaction is being written in the next one
                (see `_write`); False gives every write a transaction of its own.
            shard: opened as one shard of a `ShardedStore` (`acp_once.storage.postgres.shards`
                checks the set); without it, a database recorded as one shard of several is
                refused.

        Raises:
            SchemaOutOfDate: `migrate=False` and the schema is older than required.
            StorageError: the database cannot be reached, or its schema is newer than
                supported.
        """
        check_schema(schema)
        if not 1 <= min_size <= max_size:
            raise ValueError("the pool sizes must satisfy 1 <= min_size <= max_size")
        if isinstance(dsn_or_pool, AsyncConnectionPool):
            given: Pool | None = dsn_or_pool
            conninfo = dsn_or_pool.conninfo if isinstance(dsn_or_pool.conninfo, str) else ""
        else:
            given, conninfo = None, dsn_or_pool
        where = describe_postgres(conninfo, schema)

        async def open_given(pool: Pool) -> PostgresStore:
            await use(
                pool,
                functools.partial(
                    prepare_schema, schema=schema, migrate=migrate, where=where, alone=not shard
                ),
                where=where,
            )
            return cls(
                pool,
                schema=schema,
                owns_pool=False,
                where=where,
                clock=clock,
                group_commit=group_commit,
            )

        async def open_own() -> PostgresStore:
            conn = await connect(conninfo, where, connect_timeout)
            error: StorageError | None = None
            try:
                await prepare_schema(conn, schema, migrate=migrate, where=where, alone=not shard)
            except psycopg.Error as exc:
                error = storage_error(exc, where)
            finally:
                with anyio.CancelScope(shield=True):
                    await conn.close()
            if error is not None:
                raise error
            pool: Pool = AsyncConnectionPool(
                conninfo,
                open=False,
                min_size=min_size,
                max_size=max_size,
                kwargs={"autocommit": True, "prepare_threshold": prepare_threshold},
                name=f"acp-once {schema}",
            )
            try:
                await pool.open(wait=True, timeout=connect_timeout)
            except BaseException as exc:
                with anyio.CancelScope(shield=True):
                    await pool.close()
                if isinstance(exc, psycopg.Error):
                    raise StorageError(f"{where}: cannot open the connection pool") from None
                raise
            return cls(
                pool,
                schema=schema,
                owns_pool=True,
                where=where,
                clock=clock,
                group_commit=group_commit,
            )

        async def open_() -> PostgresStore:
            return await (open_own() if given is None else open_given(given))

        return Opening(open_, PostgresStore.aclose)

    def __repr__(self) -> str:
        state = "closed" if self._pool is None else "open"
        return f"<PostgresStore {self._where} {state}>"

    async def _call(self, work: Callable[[Conn], Awaitable[_T]], *, begin: bool = False) -> _T:
        pool = self._pool
        if pool is None:
            raise StorageError("the store is closed")
        return await use(
            pool, functools.partial(transact, work=work, begin=begin), where=self._where
        )

    # -- sessions ----------------------------------------------------------------------------

    async def create_session(self, record: SessionRecord) -> None:
        query = self._sql.insert_session

        async def work(conn: Conn) -> None:
            if await fetch_one(conn, query, to_params(record)) is None:
                raise SessionExists(record.session_id)

        await self._call(work)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        query = self._sql.get_session

        async def work(conn: Conn) -> SessionRecord | None:
            row = await fetch_one(conn, query, (session_id,))
            return None if row is None else from_row(row)

        return await self._call(work)

    async def list_sessions(
        self,
        *,
        cwd: str | None = None,
        cursor: str | None = None,
        limit: int = 100,
        tenant: str | AnyTenant | None = ANY_TENANT,
    ) -> tuple[list[SessionRecord], str | None]:
        after_at, after_id = list_position(cursor, limit) or (None, None)
        params: dict[str, object] = {
            "cwd": cwd,
            "any_tenant": isinstance(tenant, AnyTenant),
            "tenant": None if isinstance(tenant, AnyTenant) else tenant,
            "after_at": after_at,
            "after_id": after_id,
            "limit": limit + 1,  # one more than asked tells whether a next page exists
        }
        query = self._sql.list_sessions

        async def work(conn: Conn) -> list[SessionRecord]:
            return [from_row(row) for row in await fetch_all(conn, query, params)]

        records = await self._call(work)
        return one_page(records, limit)

    async def delete_session(self, session_id: str) -> bool:
        statements = self._sql

        async def work(conn: Conn) -> bool:
            async with conn.cursor(binary=True, row_factory=tuple_row) as cur:
                # The session's row first: its delete waits for every writer holding the row
                # (each timeline write locks it), and a writer after it finds no row and writes
                # nothing. Then the timeline, in a statement of its own, whose snapshot holds
                # the rows of the writers it waited for (one statement would miss them).
                await cur.execute(statements.delete_session, (session_id,))
                deleted = cur.rowcount > 0
                await cur.execute(statements.delete_timeline, (session_id,))
                return deleted

        return await self._call(work, begin=True)

    async def update_session(
        self,
        session_id: str,
        *,
        title: str | Unchanged | None = UNCHANGED,
        updated_at: float | Unchanged = UNCHANGED,
    ) -> SessionRecord:
        assignments: list[sql.Composable] = []
        params: list[object] = []
        if not isinstance(title, Unchanged):
            assignments.append(sql.SQL("title = %s"))
            params.append(title)
        if not isinstance(updated_at, Unchanged):
            assignments.append(sql.SQL("updated_at = %s"))
            params.append(updated_at)
        params.append(session_id)
        if assignments:
            query: Query = sql.SQL(
                "UPDATE {table} SET {assignments} WHERE session_id = %s RETURNING {columns}"
            ).format(
                table=sql.Identifier(self._sql.schema, "sessions"),
                assignments=sql.SQL(", ").join(assignments),
                columns=sql.SQL(SESSION_COLUMNS),
            )
        else:
            query = self._sql.get_session

        async def work(conn: Conn) -> SessionRecord:
            row = await fetch_one(conn, query, params)
            if row is None:
                raise SessionMissing(session_id)
            return from_row(row)

        return await self._call(work)

    async def fork_session(self, source_id: str, new_record: SessionRecord) -> None:
        statements = self._sql

        async def work(conn: Conn) -> None:
            # The lock keeps the source's timeline and `next_seq` still while we copy them.
            if await fetch_one(conn, statements.lock_session, (source_id,)) is None:
                raise SessionMissing(source_id)
            params = (*to_params(new_record), source_id)
            if await fetch_one(conn, statements.fork_session, params) is None:
                raise SessionExists(new_record.session_id)
            await execute(conn, statements.copy_timeline, (new_record.session_id, source_id))

        await self._call(work, begin=True)

    async def export_timeline(self, session_id: str) -> tuple[list[CopiedEntry], int] | None:
        """`CopiesSessions.export_timeline`: the session row locked (as a fork locks its
        source) while its timeline is read, so the copy is one point of its history."""
        statements = self._sql

        async def work(conn: Conn) -> tuple[list[CopiedEntry], int] | None:
            locked = await fetch_one(conn, statements.lock_session, (session_id,))
            if locked is None:
                return None
            rows = await fetch_all(conn, statements.export_timeline, (session_id,))
            entries = [CopiedEntry(seq, mid, payload, user) for seq, mid, payload, user in rows]
            return entries, int(locked[0])

        return await self._call(work, begin=True)

    async def import_session(
        self, record: SessionRecord, entries: Sequence[CopiedEntry], next_seq: int
    ) -> None:
        """`CopiesSessions.import_session`: the session row and its entries in one
        transaction (a fork onto this shard from another).

        Raises:
            SessionExists: the session id is taken (nothing is written).
        """
        statements = self._sql

        async def work(conn: Conn) -> None:
            params = (*to_params(record), next_seq)
            if await fetch_one(conn, statements.import_session, params) is None:
                raise SessionExists(record.session_id)
            if entries:
                await execute(
                    conn,
                    statements.import_timeline,
                    {
                        "sid": record.session_id,
                        "seqs": [entry.seq for entry in entries],
                        "mids": [entry.message_id for entry in entries],
                        "payloads": [entry.update for entry in entries],
                        "users": [entry.user_message for entry in entries],
                    },
                )

        await self._call(work, begin=True)

    # -- timeline and keys -------------------------------------------------------------------

    async def insert_user_message(
        self,
        session_id: str,
        *,
        message_id: str,
        update: bytes,
        idempotency_key: str | None,
        prompt_digest: bytes | None,
        guard: WriteGuard | None = None,
    ) -> InsertOutcome:
        """`SessionStore.insert_user_message`, under `guard` when given.

        With `guard`, one statement (one round trip) that writes only while the guard holds
        (see `guard.py`); else the guard's error (`WriteGuard.refused`, a `FencingError`) and
        nothing written.
        """
        now = self._clock()
        key = None if idempotency_key is None else key_bytes(idempotency_key)
        statements = self._sql

        async def recorded(conn: Conn) -> InsertOutcome | None:
            row = await fetch_one(conn, statements.find_key, (session_id, key))
            return None if row is None else InsertOutcome(row[0], False, row[1])

        if guard is not None:
            guarded = guarded_statements(statements.schema, guard.guard_sql).insert
            guarded_params = {
                **guard.guard_params(),
                "sid": session_id,
                "mid": message_id,
                "payload": update,
                "key": key,
                "digest": prompt_digest,
                "now": now,
            }

            async def finish_guarded(conn: Conn, rows: list[tuple[Any, ...]]) -> InsertOutcome:
                exists, holds, seq, mid, digest, *columns = rows[0]  # FROM ok, res: one row
                if not exists:
                    raise SessionMissing(session_id)
                refused = guard.refused(session_id, columns)
                if refused is not None:
                    raise refused
                if not holds:
                    raise FencingError(session_id)
                if seq is not None:
                    return InsertOutcome(message_id, True, prompt_digest)
                if mid is not None:
                    return InsertOutcome(mid, False, digest)
                # a key recorded outside the guard, during the statement
                raise StorageError(  # pragma: no cover
                    f"{self._where}: the key was recorded concurrently"
                )

            guarded_work = _Work(guarded, guarded_params, finish_guarded)
            if self._group is None:

                async def one_statement(conn: Conn) -> InsertOutcome:
                    return await finish_guarded(
                        conn, await fetch_all(conn, guarded, guarded_params)
                    )

                return await self._insert_shielded(one_statement)
            guarded_outcome: InsertOutcome = await self._group.submit(session_id, guarded_work)
            return guarded_outcome

        async def insert(conn: Conn) -> InsertOutcome:
            locked = await fetch_one(conn, statements.lock_session, (session_id,))
            if locked is None:
                raise SessionMissing(session_id)
            if key is not None and (found := await recorded(conn)) is not None:
                return found  # nothing written; COMMIT only releases the lock
            params = {
                "sid": session_id,
                "seq": locked[0],
                "mid": message_id,
                "payload": update,
                "key": key,
                "digest": prompt_digest,
                "now": now,
            }
            if await fetch_one(conn, statements.insert_entry, params) is None:
                # The unique index refused the key: a writer that bypassed the session lock
                # recorded it first (and committed, or ON CONFLICT would still wait). It wins.
                found = await recorded(conn)
                if found is None:  # pragma: no cover - the index just said it is there
                    raise StorageError(f"{self._where}: the key vanished during the insert")
                return found
            return InsertOutcome(message_id, True, prompt_digest)

        if self._group is None:
            return await self._insert_shielded(insert, begin=True)

        async def finish(conn: Conn, rows: list[tuple[Any, ...]]) -> InsertOutcome:
            exists, seq, mid, digest = rows[0]
            if not exists:
                raise SessionMissing(session_id)
            if seq is not None:
                return InsertOutcome(message_id, True, prompt_digest)
            if mid is not None:
                return InsertOutcome(mid, False, digest)
            # ON CONFLICT met a key committed while the statement waited for the session's
            # lock (outside its snapshot): a statement of its own sees it.
            found = await recorded(conn)
            if found is None:  # pragma: no cover - the index just said it is there
                raise StorageError(f"{self._where}: the key vanished during the insert")
            return found

        params = {
            "sid": session_id,
            "mid": message_id,
            "payload": update,
            "key": key,
            "digest": prompt_digest,
            "now": now,
        }
        work = _Work(statements.insert_one, params, finish)
        outcome: InsertOutcome = await self._group.submit(session_id, work)
        return outcome

    async def _insert_shielded(
        self, work: Callable[[Conn], Awaitable[_T]], *, begin: bool = False
    ) -> _T:
        """Run an insert to its end, whatever cancels the caller meanwhile.

        A cancellation in the middle of a statement only asks the server to stop it: the
        guarded insert is one statement that commits on its own (autocommit), and when the
        cancel comes too late it is stored all the same, while the caller sees only the
        cancellation. The runtime would then never start the message's turn, and a keyed
        retry would be answered with its id (`SessionStore.insert_user_message`). Shielded,
        the caller learns the outcome first; the cancellation comes at its next checkpoint.
        Bounded by `_INSERT_TIMEOUT`.

        Raises:
            StorageError: as `_call`, or the insert ran out of time (then it may or may not
                have been stored; a keyed retry finds it if it was).
        """
        with anyio.move_on_after(_INSERT_TIMEOUT, shield=True) as scope:
            return await self._call(work, begin=begin)
        assert scope.cancelled_caught
        raise StorageError(
            f"{self._where}: a user message insert took over {_INSERT_TIMEOUT:.0f} s"
            " (it may or may not have been stored)"
        )

    async def _write_alone(self, work: _Work) -> object:
        """A grouped write alone: its one statement in autocommit, shielded as an insert."""
        return await self._insert_shielded(functools.partial(_alone, work))

    async def _write_batch(self, batch: list[Write[_Work]]) -> None:
        """Write a batch of grouped writes in one transaction on one pooled connection, their
        statements sent together in pipeline mode (`run_batch`: one round trip).

        Each write is one statement that raises no SQL error for the outcomes callers
        expect: a recorded key is settled by the lookup in the statement or by `ON CONFLICT
        DO NOTHING`, a missing session by a statement that returns no row. So one write's
        conflict is its own answer and the transaction goes on. A SQL error (the
        connection, a deadlock, a value PostgreSQL refuses) aborts the whole transaction:
        then each write runs alone, so only the one at fault fails. Writes lock their
        sessions' rows, so they run in the order of their session ids (each session's
        writes keep their order): two batches, even of two processes, take the locks of
        the sessions they share in the same order and never deadlock. Bounded, as a lone insert
        is, by `_INSERT_TIMEOUT`.
        """
        ordered = sorted(batch, key=lambda write: write.session_id)
        outcomes: list[tuple[bool, object]] = []
        at_commit: list[bool] = []

        async def together(conn: Conn) -> None:
            sent: list[bool] = []
            try:
                results = await run_batch(
                    conn, [(write.work.query, write.work.params) for write in ordered], sent=sent
                )
            except psycopg.Error:
                # Before the batch was sent nothing can commit. After, a write's SQL error
                # aborts the transaction (the COMMIT then does nothing): INERROR. Anything
                # else (the COMMIT refused, the connection lost) leaves the outcome unknown.
                if sent:
                    at_commit.append(conn.info.transaction_status != TransactionStatus.INERROR)
                raise
            at_commit.append(True)  # committed: a failure from here on must not write it again
            for write, rows in zip(ordered, results, strict=True):
                try:
                    outcomes.append((True, await write.work.finish(conn, rows)))
                except StorageError as exc:  # SessionMissing: no SQL error, nothing written
                    outcomes.append((False, exc))

        failure: StorageError | None = None
        with anyio.move_on_after(_INSERT_TIMEOUT) as scope:
            try:
                await self._call(together, begin=False)
            except StorageError as exc:
                failure = exc
        unknown = failure is not None and (len(outcomes) == len(ordered) or any(at_commit))
        if scope.cancelled_caught or unknown:
            # Cut short or failed at COMMIT: the batch may or may not be stored, and writing
            # it again could store it twice. Every caller learns that.
            if failure is None:
                text = f"{self._where}: a grouped write took over {_INSERT_TIMEOUT:.0f} s"
            else:
                text = f"{failure}, at the commit of a grouped write"
            for write in batch:
                write.fail(StorageError(f"{text} (it may or may not have been stored)"))
            return
        if failure is not None:  # a write failed the transaction, rolled back: each alone
            for write in ordered:
                try:
                    write.settle(await self._call(functools.partial(_alone, write.work)))
                except StorageError as exc:
                    write.fail(exc)
            return
        settle_each(ordered, outcomes)

    @property
    def group_stats(self) -> GroupStats | None:
        """How many batches (transactions) and writes group commit has written; None without
        group commit. For tests and benchmarks."""
        return None if self._group is None else self._group.stats

    async def find_key(self, session_id: str, key: str) -> KeyRecord | None:
        query = self._sql.find_key

        async def work(conn: Conn) -> KeyRecord | None:
            row = await fetch_one(conn, query, (session_id, key_bytes(key)))
            return None if row is None else KeyRecord(row[0], row[1])

        return await self._call(work)

    async def append_update(
        self,
        session_id: str,
        update: bytes,
        *,
        message_id: str | None = None,
        guard: WriteGuard | None = None,
    ) -> int:
        """`SessionStore.append_update`; with `guard`, only while the guard holds (see
        `append_updates`)."""
        params: dict[str, object] = {
            "sid": session_id,
            "mid": message_id,
            "payload": update,
            "now": self._clock(),
        }
        if guard is not None:
            seqs = await self._append_guarded(session_id, params, guard, entries=1)
            return seqs[0]
        query = self._sql.append_entry

        async def work(conn: Conn) -> int:
            row = await fetch_one(conn, query, params)
            if row is None:
                raise SessionMissing(session_id)
            return int(row[0])

        if self._group is None:
            return await self._call(work)

        async def first_seq(conn: Conn, rows: list[tuple[Any, ...]]) -> int:
            if not rows:
                raise SessionMissing(session_id)
            return int(rows[0][0])

        seq: int = await self._group.submit(session_id, _Work(query, params, first_seq))
        return seq

    async def append_updates(
        self,
        session_id: str,
        updates: Sequence[tuple[bytes, str | None]],
        *,
        guard: WriteGuard | None = None,
    ) -> list[int]:
        """`AppendsUpdates.append_updates` in one statement; with `guard`, only while the
        guard holds (see `guard.py`).

        Raises:
            SessionMissing: the session does not exist (nothing is written).
            FencingError: `guard` was given and did not hold (the guard's own error, if it
                gives one; nothing is written).
            ValueError: `guard` guards inserts only (it has `after` expressions).
        """
        if not updates:
            return []
        params: dict[str, object] = {"sid": session_id, "now": self._clock()}
        if len(updates) == 1:
            ((payload, mid),) = updates
            params |= {"mid": mid, "payload": payload}
            query = self._sql.append_entry
        elif len(updates) == 2:  # a turn's last update and its end record: no arrays
            (payload, mid), (payload2, mid2) = updates
            params |= {"mid": mid, "payload": payload, "mid2": mid2, "payload2": payload2}
            query = self._sql.append_two
        else:
            params |= {
                "n": len(updates),
                "mids": [mid for _, mid in updates],
                "payloads": [update for update, _ in updates],
            }
            query = self._sql.append_many
        if guard is not None:
            return await self._append_guarded(session_id, params, guard, entries=len(updates))

        async def all_seqs(conn: Conn, rows: list[tuple[Any, ...]]) -> list[int]:
            if not rows:
                raise SessionMissing(session_id)
            return sorted(int(row[0]) for row in rows)

        if self._group is None:

            async def one_statement(conn: Conn) -> list[int]:
                return await all_seqs(conn, await fetch_all(conn, query, params))

            return await self._call(one_statement)
        seqs: list[int] = await self._group.submit(session_id, _Work(query, params, all_seqs))
        return seqs

    async def _append_guarded(
        self, session_id: str, params: dict[str, object], guard: WriteGuard, *, entries: int
    ) -> list[int]:
        """A guarded append of `entries` entries, with the parameters of its statement: one
        (`%(mid)s`, `%(payload)s`), two (and `%(mid2)s`, `%(payload2)s`) or more (`%(n)s`,
        `%(mids)s`, `%(payloads)s`); the seqs written."""
        statements = guarded_statements(self._sql.schema, guard.guard_sql)
        if entries == 1:
            query = statements.append_one
        elif entries == 2:
            query = statements.append_two
        else:
            query = statements.append
        if query is None:
            raise ValueError("this guard guards inserts only")
        params = {**params, **guard.guard_params()}

        async def guarded_seqs(conn: Conn, rows: list[tuple[Any, ...]]) -> list[int]:
            exists, holds, seqs, *columns = rows[0]  # FROM ok: one row
            if not exists:
                raise SessionMissing(session_id)
            refused = guard.refused(session_id, columns)
            if refused is not None:
                raise refused
            if not holds or not seqs:
                raise FencingError(session_id)
            return [int(seq) for seq in seqs]

        if self._group is None:

            async def one_statement(conn: Conn) -> list[int]:
                return await guarded_seqs(conn, await fetch_all(conn, query, params))

            return await self._call(one_statement)
        seqs: list[int] = await self._group.submit(session_id, _Work(query, params, guarded_seqs))
        return seqs

    @property
    def schema(self) -> str:
        """The PostgreSQL schema holding the store's tables."""
        return self._sql.schema

    @property
    def where(self) -> str:
        """Where the store lives, for messages (no password)."""
        return self._where

    @property
    def conninfo(self) -> str:
        """The connection string of the store's pool, for a dedicated connection beside it
        (the cluster's LISTEN); the caller's pool's when the store was opened on one.

        Raises:
            StorageError: the store is closed, or its pool was given no connection string.
        """
        pool = self._pool
        if pool is None:
            raise StorageError("the store is closed")
        if not isinstance(pool.conninfo, str) or not pool.conninfo:
            raise StorageError(f"{self._where}: the pool has no connection string")
        return pool.conninfo

    async def run(self, work: Callable[[Conn], Awaitable[_T]], *, begin: bool = True) -> _T:
        """Run `work(conn)` on a pooled connection and commit: the way statements of other
        modules on the same database (the cluster's leases and prompt queue) use the store's
        pool. With `begin`, in an explicit READ COMMITTED transaction; without, `work` runs
        its statements in autocommit mode (or sends its own BEGIN, as in a pipeline). The
        connection goes back to the pool idle, or is closed (see the module docstring); the
        helpers of `acp_once.storage.postgres.connection` run statements on it.

        Raises:
            StorageError: the store is closed, or PostgreSQL refused (psycopg errors are
                wrapped without their values); errors of `work` itself propagate.
        """
        return await self._call(work, begin=begin)

    async def read_timeline(
        self, session_id: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TimelineEntry]:
        check_limit(limit)
        query = self._sql.read_timeline

        async def work(conn: Conn) -> list[TimelineEntry]:
            rows = await fetch_all(conn, query, (session_id, after_seq, limit))
            return [TimelineEntry(session_id, seq, mid, payload) for seq, mid, payload in rows]

        return await self._call(work)

    async def read_timeline_tail(self, session_id: str, *, limit: int = 1) -> list[TimelineEntry]:
        check_limit(limit)
        query = self._sql.read_tail

        async def work(conn: Conn) -> list[TimelineEntry]:
            rows = await fetch_all(conn, query, (session_id, limit))
            return [
                TimelineEntry(session_id, seq, mid, payload) for seq, mid, payload in reversed(rows)
            ]

        return await self._call(work)

    async def count_user_messages(
        self, session_id: str, *, idempotency_key: str | None = None
    ) -> int:
        statements = self._sql

        async def work(conn: Conn) -> int:
            if idempotency_key is None:
                row = await fetch_one(conn, statements.count_user, (session_id,))
            else:
                params = (session_id, key_bytes(idempotency_key))
                row = await fetch_one(conn, statements.count_key, params)
            assert row is not None
            return int(row[0])

        return await self._call(work)

    async def aclose(self) -> None:
        """Stop using the pool, and close it if the store opened it. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None and self._owns_pool:
            with anyio.CancelScope(shield=True):  # bounded: the pool's own close timeout
                await pool.close()
