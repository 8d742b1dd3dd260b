"""psycopg calls the way the PostgreSQL store and the cluster's SQL both make them: our own
tuple rows and binary results on any caller's connection, transactions that work in
autocommit mode or not, connections that go back to the pool only when idle, and psycopg
errors turned into `StorageError`s that quote no value (keys are private)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import select
import weakref
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
import psycopg
from psycopg import pq, sql
from psycopg.adapt import PyFormat, Transformer
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool

from acp_once.storage.base import StorageError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence

    from psycopg.abc import Buffer

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
    "run_batch",
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


# -- batches sent at once ------------------------------------------------------------------

_PLACEHOLDER: Final = re.compile(r"%\((\w+)\)s|%%|%s")
_AUTO: Final = PyFormat.AUTO
_TUPLES_OK: Final = pq.ExecStatus.TUPLES_OK
_FATAL_ERROR: Final = pq.ExecStatus.FATAL_ERROR
_PIPELINE_SYNC: Final = pq.ExecStatus.PIPELINE_SYNC
_UNKNOWN_STATEMENT: Final = "26000"  # invalid_sql_statement_name: DEALLOCATE ALL, DISCARD ALL
_BEGIN_READ_COMMITTED: Final = b"BEGIN ISOLATION LEVEL READ COMMITTED"


class _Compiled:
    """A statement with `%(name)s` placeholders as PostgreSQL takes it: `$n` placeholders,
    and the parameter names in `$n` order."""

    __slots__ = ("names", "query", "text")

    def __init__(self, query: Query) -> None:
        self.query = query  # kept alive: the cache is keyed by its id
        names: list[str] = []

        def number(match: re.Match[str]) -> str:
            name = match.group(1)
            if name is None:
                if match.group(0) == "%%":
                    return "%"
                raise ValueError("a batched statement takes named parameters only")
            if name not in names:
                names.append(name)
            return f"${names.index(name) + 1}"

        self.text = _PLACEHOLDER.sub(number, query.as_string(None)).encode()
        self.names = tuple(names)


_compiled: dict[int, _Compiled] = {}
_names: Final = itertools.count()
_prepared: weakref.WeakKeyDictionary[pq.abc.PGconn, dict[tuple[bytes, tuple[int, ...]], bytes]] = (
    weakref.WeakKeyDictionary()
)


def _compile(query: Query) -> _Compiled:
    compiled = _compiled.get(id(query))
    if compiled is None or compiled.query is not query:
        compiled = _compiled[id(query)] = _Compiled(query)
    return compiled


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _ready(fd: int, *, write: bool) -> None:
    """Wait until the socket `fd` is readable (or, with `write`, readable or writable)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    loop.add_reader(fd, _wake, future)
    if write:
        loop.add_writer(fd, _wake, future)
    try:
        await future
    finally:
        loop.remove_reader(fd)
        if write:
            loop.remove_writer(fd)


async def _send(pgconn: pq.abc.PGconn) -> None:
    """Send everything libpq holds, reading what the server sends meanwhile."""
    while pgconn.flush():
        await _ready(pgconn.socket, write=True)
        pgconn.consume_input()


async def _results(pgconn: pq.abc.PGconn, *, pipeline: bool) -> list[pq.abc.PGresult]:
    """The results of what was sent: up to the Sync in pipeline mode, else up to the end."""
    results: list[pq.abc.PGresult] = []
    while True:
        while pgconn.is_busy():
            await _ready(pgconn.socket, write=False)
            pgconn.consume_input()
            while (notice := pgconn.notifies()) is not None:
                if pgconn.notify_handler is not None:
                    pgconn.notify_handler(notice)
        result = pgconn.get_result()
        if result is None:
            if pipeline:
                continue  # the end of one statement's results
            return results
        if pipeline and result.status == _PIPELINE_SYNC:
            return results
        results.append(result)


async def run_batch(
    conn: Conn,
    statements: Sequence[tuple[Query, Mapping[str, Any]]],
    *,
    sent: list[bool],
    transaction: bool = True,
) -> list[list[tuple[Any, ...]]]:
    """Run `statements` (each with `%(name)s` parameters) in one READ COMMITTED transaction,
    all sent in one write (BEGIN, the statements, COMMIT and one Sync: one round trip) as
    prepared statements, and return each one's rows (binary results, tuple rows).

    psycopg's pipeline flushes the socket and polls it after every statement (some 30 µs of
    CPU a statement here, against some 7 for this); this drives libpq's pipeline through
    psycopg's own `pq` and adapters instead. A statement is prepared on the connection the
    first time it is used there with its parameters' types, in a round trip before the
    batch; on a connection whose `prepare_threshold` is None (PgBouncer in transaction mode)
    none is: each is sent unnamed, parsed every time. `conn` must be idle (no transaction
    open); it is idle again after a commit.

    `sent` gets True once the batch, COMMIT included, may have reached the server. Without
    `transaction`, no BEGIN nor COMMIT is sent: the statements run in the implicit transaction
    that ends at the Sync (one statement alone commits on its own, as in autocommit mode).

    Raises:
        psycopg.Error: a statement failed (the transaction is then aborted, nothing of it
            committed, and the connection stays in the failed transaction for its caller to
            roll back), or the COMMIT failed (nothing committed; the connection is idle), or
            the connection failed (then it is closed, and after `sent` the outcome is unknown).
        ValueError: a statement has positional (`%s`) parameters (nothing was sent).
    """
    transformer = Transformer(conn)
    batch: list[tuple[tuple[bytes, tuple[int, ...]], Sequence[Buffer | None], list[pq.Format]]] = []
    for query, params in statements:
        compiled = _compile(query)
        values = transformer.dump_sequence(
            [params[name] for name in compiled.names], [_AUTO] * len(compiled.names)
        )
        batch.append(
            (
                (compiled.text, tuple(transformer.types or ())),
                values,
                list(transformer.formats or ()),
            )
        )
    async with conn.lock:
        pgconn = conn.pgconn
        prepared = _prepared.get(pgconn)
        if prepared is None:
            prepared = _prepared[pgconn] = {}
        try:
            named = conn.prepare_threshold is not None
            if named:
                for key, _, _ in batch:
                    if key not in prepared:
                        await _prepare(conn, pgconn, prepared, key)
            pgconn.enter_pipeline_mode()
            if transaction:
                pgconn.send_query_params(_BEGIN_READ_COMMITTED, None)
            for key, values, formats in batch:
                if named:
                    pgconn.send_query_prepared(prepared[key], values, formats, result_format=1)
                else:  # unnamed statements: behind PgBouncer in transaction mode
                    pgconn.send_query_params(key[0], values, key[1], formats, result_format=1)
            if transaction:
                pgconn.send_query_params(b"COMMIT", None)
            pgconn.pipeline_sync()
            sent.append(True)
            await _send(pgconn)
            results = await _results(pgconn, pipeline=True)
            pgconn.exit_pipeline_mode()
        except psycopg.Error as exc:
            if exc.sqlstate is None:
                await _lost(conn)
            raise
        except BaseException:
            await _lost(conn)
            raise
    control = 2 if transaction else 0  # BEGIN and COMMIT
    if len(results) != len(batch) + control:
        await _lost(conn)
        raise psycopg.InternalError("the server answered a batch with too few results")
    for result in results:
        if result.status == _FATAL_ERROR:
            error = psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
            if error.sqlstate == _UNKNOWN_STATEMENT:
                prepared.clear()  # the session's prepared statements were dropped
            raise error
    rows: list[list[tuple[Any, ...]]] = []
    for result in results[1:-1] if transaction else results:
        if result.status == _TUPLES_OK:
            transformer.set_pgresult(result)
            rows.append(transformer.load_rows(0, result.ntuples, tuple))
        else:
            rows.append([])
    return rows


async def _prepare(
    conn: Conn,
    pgconn: pq.abc.PGconn,
    prepared: dict[tuple[bytes, tuple[int, ...]], bytes],
    key: tuple[bytes, tuple[int, ...]],
) -> None:
    # never reused in a process: after `prepared.clear()` some may still exist on the server
    name = f"acp_once_{next(_names)}".encode()
    text, types = key
    pgconn.send_prepare(name, text, types)
    await _send(pgconn)
    for result in await _results(pgconn, pipeline=False):
        if result.status == _FATAL_ERROR:
            raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
    prepared[key] = name


async def _lost(conn: Conn) -> None:
    """Close a connection left in an unknown state (it never goes back to the pool)."""
    with anyio.CancelScope(shield=True):
        await conn.close()
