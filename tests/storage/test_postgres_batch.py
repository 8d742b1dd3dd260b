"""`run_batch` (`acp_once.storage.postgres.connection`), the PostgreSQL store's group-commit
batches: every statement's rows in one transaction, a failing statement commits nothing,
prepared statements a session dropped are prepared again, and a batch cut short closes its
connection. On a real PostgreSQL server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import orjson
import psycopg
import pytest
from psycopg import sql
from psycopg.pq import TransactionStatus

from acp_once.storage import InsertOutcome, SessionRecord
from acp_once.storage.base import StorageError
from acp_once.storage.postgres import PostgresStore, connection
from acp_once.storage.postgres.connection import Conn, run_batch
from tests.storage.conftest import batch_everything

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

_INSERT = sql.SQL(
    "INSERT INTO batch_t (id, body, note) VALUES (%(id)s, %(body)s, %(note)s) RETURNING id, body"
)
_COUNT = sql.SQL("SELECT count(*) FROM batch_t WHERE note = %(note)s")


@pytest.fixture
async def conn(postgres_dsn: str) -> AsyncIterator[Conn]:
    connection = await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True)
    try:
        await connection.execute(
            "CREATE TEMPORARY TABLE batch_t (id bigint, body bytea, note text)"
        )
        yield connection
    finally:
        await connection.close()


async def _count(conn: Conn, note: str) -> int:
    cursor = await conn.execute("SELECT count(*) FROM batch_t WHERE note = %s", (note,))
    row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def test_each_statement_gets_its_rows_and_the_batch_commits(
    conn: Conn,
) -> None:
    sent: list[bool] = []
    with anyio.fail_after(10):
        rows = await run_batch(
            conn,
            [
                (_INSERT, {"id": 1, "body": b"\x00one", "note": "n"}),
                (_INSERT, {"id": 2**40, "body": b"two", "note": "n"}),  # another int type
                (_COUNT, {"note": "n"}),
                (_INSERT, {"id": 3, "body": None, "note": "n"}),
            ],
            sent=sent,
        )
    assert rows == [[(1, b"\x00one")], [(2**40, b"two")], [(2,)], [(3, None)]]
    assert sent == [True]
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert await _count(conn, "n") == 3


async def test_a_failing_statement_commits_nothing_and_leaves_the_transaction_failed(
    conn: Conn,
) -> None:
    divide = sql.SQL("SELECT 1 / %(zero)s")
    with anyio.fail_after(10), pytest.raises(psycopg.errors.DivisionByZero):
        await run_batch(
            conn,
            [(_INSERT, {"id": 1, "body": b"x", "note": "f"}), (divide, {"zero": 0})],
            sent=[],
        )
    assert conn.info.transaction_status == TransactionStatus.INERROR
    await conn.rollback()
    assert await _count(conn, "f") == 0
    # the connection goes on: the same statements, now all valid
    with anyio.fail_after(10):
        rows = await run_batch(
            conn, [(_INSERT, {"id": 2, "body": b"y", "note": "f"}), (divide, {"zero": 1})], sent=[]
        )
    assert rows == [[(2, b"y")], [(1,)]]
    assert await _count(conn, "f") == 1


async def test_prepared_statements_the_session_dropped_are_prepared_again(
    conn: Conn,
) -> None:
    with anyio.fail_after(10):
        await run_batch(conn, [(_INSERT, {"id": 1, "body": b"x", "note": "d"})], sent=[])
        await conn.execute("DEALLOCATE ALL")
        with pytest.raises(psycopg.errors.InvalidSqlStatementName):
            await run_batch(conn, [(_INSERT, {"id": 2, "body": b"x", "note": "d"})], sent=[])
        await conn.rollback()
        rows = await run_batch(conn, [(_INSERT, {"id": 3, "body": b"x", "note": "d"})], sent=[])
    assert rows == [[(3, b"x")]]
    assert await _count(conn, "d") == 2


async def test_a_batch_cut_short_closes_its_connection(
    conn: Conn,
) -> None:
    """Cancelled while the server runs it, the batch's outcome is unknown: the connection
    is closed, never left mid-pipeline for its next user."""
    sleep = sql.SQL("SELECT pg_sleep(%(seconds)s)")
    sent: list[bool] = []
    with anyio.move_on_after(0.5) as scope:
        await run_batch(conn, [(sleep, {"seconds": 30.0})], sent=sent)
    assert scope.cancelled_caught
    assert sent == [True]
    assert conn.closed


async def test_positional_parameters_are_refused(conn: Conn) -> None:
    with pytest.raises(ValueError, match="named parameters"):
        await run_batch(conn, [(sql.SQL("SELECT %s"), {})], sent=[])
    assert conn.info.transaction_status == TransactionStatus.IDLE


async def test_the_store_writes_a_batch_whose_prepared_statements_were_dropped(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    """One pooled connection whose prepared statements a `DEALLOCATE ALL` dropped: that
    batch is written write by write, the next is a batch again, and nothing is lost."""
    async with PostgresStore.open(postgres_dsn, schema=new_schema(), max_size=1) as store:
        batch_everything(store)
        await store.create_session(SessionRecord("s", "/w", (), None, 1.0, 1.0))

        async def insert(message_id: str) -> InsertOutcome:
            update = orjson.dumps({"sessionUpdate": "user_message", "messageId": message_id})
            return await store.insert_user_message(
                "s",
                message_id=message_id,
                update=update,
                idempotency_key=f"k-{message_id}",
                prompt_digest=b"d",
            )

        async def deallocate(connection: Conn) -> None:
            await connection.execute("DEALLOCATE ALL")

        with anyio.fail_after(20):
            assert await insert("m1") == InsertOutcome("m1", True, b"d")
            await store.run(deallocate, begin=False)
            assert await insert("m2") == InsertOutcome("m2", True, b"d")
            assert await insert("m3") == InsertOutcome("m3", True, b"d")
            assert await insert("m2") == InsertOutcome("m2", False, b"d")
        assert await store.count_user_messages("s") == 3


async def test_without_a_transaction_a_statement_commits_on_its_own(conn: Conn) -> None:
    """A lone write: no BEGIN nor COMMIT; a failing statement leaves the connection idle."""
    with anyio.fail_after(10):
        rows = await run_batch(
            conn, [(_INSERT, {"id": 1, "body": b"x", "note": "t"})], sent=[], transaction=False
        )
        assert rows == [[(1, b"x")]]
        assert conn.info.transaction_status == TransactionStatus.IDLE
        with pytest.raises(psycopg.errors.DivisionByZero):
            await run_batch(
                conn, [(sql.SQL("SELECT 1 / %(zero)s"), {"zero": 0})], sent=[], transaction=False
            )
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert await _count(conn, "t") == 1


async def test_after_one_prepared_statement_was_dropped_the_rest_do_not_collide(
    conn: Conn,
) -> None:
    """Only one of the connection's prepared statements dropped: the next batch fails on it,
    and the statements prepared again take new names (the others still exist)."""
    with anyio.fail_after(10):
        await run_batch(
            conn,
            [(_INSERT, {"id": 1, "body": b"x", "note": "p"}), (_COUNT, {"note": "p"})],
            sent=[],
        )
        cursor = await conn.execute(
            "SELECT name FROM pg_prepared_statements WHERE statement LIKE 'SELECT count%%'"
        )
        row = await cursor.fetchone()
        assert row is not None
        await conn.execute(f'DEALLOCATE "{row[0]}"')
        with pytest.raises(psycopg.errors.InvalidSqlStatementName):
            await run_batch(conn, [(_COUNT, {"note": "p"})], sent=[], transaction=False)
        rows = await run_batch(
            conn,
            [(_INSERT, {"id": 2, "body": b"y", "note": "p"}), (_COUNT, {"note": "p"})],
            sent=[],
        )
    assert rows == [[(2, b"y")], [(2,)]]


async def test_without_prepared_statements_nothing_is_prepared(postgres_dsn: str) -> None:
    """A connection with `prepare_threshold=None` (PgBouncer in transaction mode) gets its
    statements unnamed: the batch runs, and the session holds no prepared statement."""
    connection = await psycopg.AsyncConnection.connect(
        postgres_dsn, autocommit=True, prepare_threshold=None
    )
    try:
        await connection.execute(
            "CREATE TEMPORARY TABLE batch_t (id bigint, body bytea, note text)"
        )
        with anyio.fail_after(10):
            rows = await run_batch(
                connection,
                [(_INSERT, {"id": 1, "body": b"x", "note": "u"}), (_COUNT, {"note": "u"})],
                sent=[],
            )
        assert rows == [[(1, b"x")], [(1,)]]
        cursor = await connection.execute("SELECT count(*) FROM pg_prepared_statements")
        assert await cursor.fetchone() == (0,)
    finally:
        await connection.close()


async def test_a_batch_lost_after_it_was_sent_is_reported_unknown_never_written_again(
    postgres_dsn: str, new_schema: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server committed the batch, then the connection failed before its answer came
    back: each caller learns its write may or may not be stored, and nothing is written
    again (an append, which has no key, would otherwise be stored twice)."""
    real = connection._results
    cut: list[bool] = []

    async def answer_lost(pgconn: Any, *, pipeline: bool) -> list[Any]:
        results = await real(pgconn, pipeline=pipeline)
        if pipeline and not cut:
            cut.append(True)
            raise psycopg.OperationalError("the connection was lost")
        return results

    async with PostgresStore.open(postgres_dsn, schema=new_schema()) as store:
        batch_everything(store)
        for sid in ("a", "b"):
            await store.create_session(SessionRecord(sid, "/w", (), None, 1.0, 1.0))
        monkeypatch.setattr(connection, "_results", answer_lost)
        errors: dict[str, StorageError] = {}

        async def append(sid: str) -> None:
            try:
                await store.append_updates(sid, [(b'{"n": 1}', None), (b'{"n": 2}', None)])
            except StorageError as exc:
                errors[sid] = exc

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(append, "a")
                tg.start_soon(append, "b")
        assert cut == [True]
        assert errors  # the writes of the lost batch, each told so
        assert all("may or may not have been stored" in str(e) for e in errors.values())
        for sid in ("a", "b"):
            written = [entry.update for entry in await store.read_timeline(sid)]
            assert written in ([], [b'{"n": 1}', b'{"n": 2}'])
            if sid in errors:
                assert written == [b'{"n": 1}', b'{"n": 2}']  # committed, once
