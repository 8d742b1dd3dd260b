"""psycopg calls the way the PostgreSQL store and the cluster's SQL both make them: our own
tuple rows and binary results on any caller's connection, transactions that work in
autocommit mode or not, connections that go back to the pool only when idle, and psycopg
errors turned into `StorageError`s that quote no value (keys are private)."""

from __future__ import annotations

import contextlib
import select
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool

from acp_once.storage.base import StorageError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence

__all__ = [
    "Conn",
    "Pool",
    "Query",
    "clean",
    "compose",
    "connect",
    "execute",
    "fetch_all",
    "fetch_one",
    "fetch_pipelined",
    "key_bytes",
    "storage_error",
    "transact",
    "use",
]

_T = TypeVar("_T")
Conn = psycopg.AsyncConnection[Any]
Pool = AsyncConnectionPool[Any]
Query = sql.SQL | sql.Composed

_CLEANUP_TIMEOUT: Final = 5.0
"""Seconds a rollback after a failed or cancelled call may take before we close instead."""


def compose(template: str, schema: str) -> sql.Composed:
    """`template` as SQL, with `{s}` the schema (quoted), rendered once.

    psycopg renders a `Composed` to bytes on every execution, part by part (tens of
    microseconds for our larger statements, on every prompt); rendered here once, each
    execution only encodes one string. The schema is a checked identifier
    (`check_schema`), quoted without a connection as with one.
    """
    rendered = sql.SQL(template).format(s=sql.Identifier(schema)).as_string(None)
    return sql.Composed([sql.SQL(rendered)])


def key_bytes(key: str) -> bytes:
    """An idempotency key as stored: its UTF-8 bytes, so keys compare byte for byte."""
    # surrogatepass: any Python str is a valid key, stored byte-exactly, never an encode error
    # (whose message would quote the key).
    return key.encode("utf-8", "surrogatepass")


async def execute(conn: Conn, query: Query, params: Sequence[Any] | Mapping[str, Any] = ()) -> None:
    """Run one statement; its rows, if any, are dropped."""
    async with conn.cursor(binary=True, row_factory=tuple_row) as cur:
        await cur.execute(query, params)


async def fetch_one(
    conn: Conn, query: Query, params: Sequence[Any] | Mapping[str, Any] = ()
) -> tuple[Any, ...] | None:
    """Run one statement and return its first row (None without one)."""
    # Our own tuple rows and binary results, whatever the row factory of a caller's pool.
    async with conn.cursor(binary=True, row_factory=tuple_row) as cur:
        await cur.execute(query, params)
        return await cur.fetchone()


async def fetch_all(
    conn: Conn, query: Query, params: Sequence[Any] | Mapping[str, Any] = ()
) -> list[tuple[Any, ...]]:
    """Run one statement and return all its rows."""
    async with conn.cursor(binary=True, row_factory=tuple_row) as cur:
        await cur.execute(query, params)
        return await cur.fetchall()


async def fetch_pipelined(
    conn: Conn, statements: Sequence[tuple[Query, Sequence[Any] | Mapping[str, Any]]]
) -> list[list[tuple[Any, ...]]]:
    """Run `statements` in order, sent together in pipeline mode (one round trip), and
    return each one's rows (empty for a statement without a result, such as BEGIN).

    The server runs them one after another exactly as if they were sent one by one: each
    statement of a READ COMMITTED transaction still takes its own snapshot when it starts.
    A failing statement raises its psycopg error and the ones after it do not run (the
    caller's connection is then cleaned as after any failed call).
    """
    cursors = [conn.cursor(binary=True, row_factory=tuple_row) for _ in statements]
    try:
        # the pipeline's exit sends the one Sync and waits for every result
        async with conn.pipeline():
            for cursor, (query, params) in zip(cursors, statements, strict=True):
                await cursor.execute(query, params)
        return [
            await cursor.fetchall() if cursor.description is not None else [] for cursor in cursors
        ]
    finally:
        for cursor in cursors:
            await cursor.close()


async def transact(conn: Conn, work: Callable[[Conn], Awaitable[_T]], *, begin: bool) -> _T:
    """Run `work(conn)` and commit; with `begin`, in an explicit READ COMMITTED block.

    Works on connections in autocommit mode (we send BEGIN) and not (psycopg sends BEGIN
    before the first statement; we then set the isolation level of that transaction). The
    COMMIT is shielded from cancellation. On any exception nothing is rolled back here: the
    caller owns the connection and cleans it (`use`, `clean`).
    """
    if begin:
        if conn.autocommit:
            await execute(conn, sql.SQL("BEGIN ISOLATION LEVEL READ COMMITTED"))
        else:
            await execute(conn, sql.SQL("SET TRANSACTION ISOLATION LEVEL READ COMMITTED"))
    result = await work(conn)
    with anyio.CancelScope(shield=True):
        await conn.commit()
    return result


async def clean(conn: Conn) -> bool:
    """Bring a connection whose call failed or was cancelled back to idle, or close it.

    Must run shielded. Returns True when the connection is idle and can be reused.
    """
    status = conn.info.transaction_status
    if status in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
        with anyio.move_on_after(_CLEANUP_TIMEOUT):
            with contextlib.suppress(psycopg.Error):
                await conn.rollback()
    if conn.info.transaction_status == TransactionStatus.IDLE:
        return True
    # Still busy (a statement in flight, a rollback that did not answer) or broken: a
    # connection in an unknown state never goes back to the pool.
    await conn.close()
    return False


async def connect(conninfo: str, where: str, timeout: float) -> Conn:
    """Open one connection in autocommit mode.

    Raises:
        StorageError: it cannot be opened (the message names `where`, no password).
    """
    try:
        return await psycopg.AsyncConnection.connect(
            conninfo, autocommit=True, connect_timeout=max(1, round(timeout))
        )
    except psycopg.Error as exc:
        error = StorageError(f"cannot connect to {storage_error(exc, where)}")
    raise error


def _quiet(conn: Conn) -> bool:
    """Whether an idle pooled connection has nothing waiting to be read (no round trip).

    The server says nothing on an idle connection unless something happened to it: a
    backend terminated while idle (an operator, a failover, `idle_session_timeout`) leaves a
    FATAL error and the end of the stream on the socket. Anything waiting makes the
    connection suspect.
    """
    if conn.closed or conn.broken:
        return False
    try:
        readable, _, _ = select.select([conn.pgconn.socket], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return False
    return not readable


async def _checkout(pool: Pool) -> Conn:
    """A pooled connection that did not die while idle.

    Checked before anything is sent on it, so a prompt is never half-written and never
    written twice: a connection whose socket has something waiting (`_quiet`) gets one round
    trip of checking (`check_connection`) and, dead, is closed and given back (the pool
    replaces it) before we take the next. A retry after a failed statement would not be
    safe in general (the statement may have committed), and a check on every checkout would
    cost a round trip per call; the socket poll costs a system call. At most `max_size`
    connections are given up; a connection that dies between the poll and its first
    statement fails that call as before.
    """
    for _ in range(pool.max_size):
        conn: Conn = await pool.getconn()
        if _quiet(conn):
            return conn
        try:
            await pool.check_connection(conn)
        except psycopg.Error:
            with anyio.CancelScope(shield=True):
                await conn.close()
                await pool.putconn(conn)  # closed: the pool discards it and makes another
            continue
        except BaseException:
            with anyio.CancelScope(shield=True):
                await conn.close()
                await pool.putconn(conn)
            raise
        return conn
    last: Conn = await pool.getconn()
    return last


async def use(pool: Pool, work: Callable[[Conn], Awaitable[_T]], *, where: str) -> _T:
    """Run `work` on a pooled connection; the connection goes back idle, or is closed.

    A connection that died while idle in the pool is replaced before `work` starts
    (`_checkout`). Every psycopg error comes out as a `StorageError` without its original
    (see `storage_error`); our own errors (`SessionMissing`, ...) come out as they are.
    """
    try:
        conn = await _checkout(pool)
    except psycopg.Error as exc:
        error = storage_error(exc, where)
    else:
        idle = False
        try:
            result = await work(conn)
            idle = conn.info.transaction_status == TransactionStatus.IDLE
            return result
        except psycopg.Error as exc:
            error = storage_error(exc, where)
        finally:
            with anyio.CancelScope(shield=True):
                if not idle:
                    await clean(conn)
                await pool.putconn(conn)
    raise error


def storage_error(exc: psycopg.Error, where: str) -> StorageError:
    """A StorageError for a psycopg error, without the values PostgreSQL may quote.

    Only the SQLSTATE and the primary message go in: never DETAIL (which quotes the columns of
    a violated unique index, the key included) nor HINT. Data exceptions (class 22) may quote
    a value even in their primary message, so they carry the SQLSTATE only. Raise the result
    outside the `except` block, so that the psycopg error is not kept as its context.
    """
    state = exc.sqlstate
    name = type(exc).__name__
    if state is None:  # raised by psycopg itself (connection, adaptation): no server values
        text = str(exc).splitlines()[0] if str(exc) else name
        return StorageError(f"{where}: {name}: {text}")
    if state.startswith("22"):
        return StorageError(f"{where}: {name} (SQLSTATE {state})")
    primary = exc.diag.message_primary or name
    return StorageError(f"{where}: {name} (SQLSTATE {state}): {primary}")
