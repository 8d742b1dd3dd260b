"""What only the PostgreSQL backend promises: several stores (nodes) on one database, caller
pools, explicit migrations, cancellation safety, and keys kept out of error messages.

The whole `SessionStore` contract runs on PostgreSQL through `store_factory` (conftest.py);
every test here uses fresh schemas that are dropped at teardown.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
import uuid
from contextlib import AsyncExitStack, asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import anyio
import orjson
import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from acp_once.agent.reference import ReferenceAgent
from acp_once.storage import (
    InsertOutcome,
    KeyRecord,
    SchemaOutOfDate,
    SessionRecord,
    SessionStore,
    StorageError,
    open_store,
)
from acp_once.storage.base import FencingError, SessionMissing
from acp_once.storage.contract import run_contract
from acp_once.storage.postgres import (
    LATEST_VERSION,
    GuardSql,
    PostgresStore,
    apply_migrations,
    describe_postgres,
    migrate_postgres,
    parse_postgres_url,
    postgres_status,
)
from acp_once.storage.postgres.sql import statements as compose_statements
from acp_once.testing import connected
from tests.cluster.harness import initialize, new_session, node, prompt
from tests.storage.conftest import batch_everything

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping, Sequence
    from contextlib import AbstractAsyncContextManager

pytestmark = pytest.mark.anyio
postgres = pytest.mark.postgres


def _record(session_id: str = "sess_1", *, updated_at: float = 100.0) -> SessionRecord:
    return SessionRecord(session_id, "/work", ("/lib",), "title", 50.0, updated_at)


def _update(message_id: str) -> bytes:
    return orjson.dumps({"sessionUpdate": "user_message", "messageId": message_id})


async def _insert(
    store: SessionStore, message_id: str, key: str | None, session_id: str = "sess_1"
) -> InsertOutcome:
    return await store.insert_user_message(
        session_id,
        message_id=message_id,
        update=_update(message_id),
        idempotency_key=key,
        prompt_digest=b"digest" if key else None,
    )


async def _raw(dsn: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(dsn, autocommit=True)


@asynccontextmanager
async def _caller_pool(
    dsn: str, *, max_size: int = 2, **kwargs: Any
) -> AsyncIterator[AsyncConnectionPool[Any]]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, open=False, min_size=1, max_size=max_size, kwargs=kwargs
    )
    await pool.open(wait=True, timeout=30)
    try:
        yield pool
    finally:
        await pool.close()


async def _states(dsn: str, application_name: str) -> list[str]:
    """The server-side states of the connections with this application name."""
    async with await _raw(dsn) as conn:
        cur = await conn.execute(
            "SELECT state FROM pg_stat_activity WHERE application_name = %s"
            " AND pid <> pg_backend_pid()",
            (application_name,),
        )
        return sorted(str(state) for (state,) in await cur.fetchall())


async def _until_waiting_on_a_lock(dsn: str, application_name: str) -> None:
    """Poll the server until a connection with this application name waits on a lock (the
    statement was sent and is blocked there); bounded by the caller's fail_after."""
    async with await _raw(dsn) as conn:
        while True:
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
                " AND wait_event_type = 'Lock'",
                (application_name,),
            )
            row = await cur.fetchone()
            if row is not None and row[0] > 0:
                return
            await anyio.sleep(0.01)  # polling the server's view, not a synchronisation guess


# -- several stores on one database -------------------------------------------------------------


@postgres
async def test_data_survives_close_and_reopen(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    schema = new_schema()
    async with PostgresStore.open(postgres_dsn, schema=schema) as store:
        await store.create_session(_record())
        await _insert(store, "m1", "key-1")
        await store.append_update("sess_1", b'{"sessionUpdate":"agent_message"}', message_id="a")
        before = await store.read_timeline("sess_1")
        record = await store.get_session("sess_1")
    assert "closed" in repr(store)

    store = await PostgresStore.open(postgres_dsn, schema=schema, migrate=False)  # explicit
    try:
        assert await store.get_session("sess_1") == record
        assert await store.read_timeline("sess_1") == before
        assert await store.find_key("sess_1", "key-1") == KeyRecord("m1", b"digest")
        assert await _insert(store, "m2", "key-1") == InsertOutcome("m1", False, b"digest")
        assert await store.count_user_messages("sess_1") == 1
        assert (await store.read_timeline_tail("sess_1"))[0].message_id == "a"
    finally:
        await store.aclose()


@postgres
async def test_two_stores_racing_on_one_key_insert_once(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    """Two store objects with two pools, as two nodes would: 50 inserts of one new key."""
    schema = new_schema()
    async with (
        PostgresStore.open(postgres_dsn, schema=schema) as first,
        PostgresStore.open(postgres_dsn, schema=schema) as second,
    ):
        await first.create_session(_record())
        outcomes: list[InsertOutcome] = []

        async def attempt(store: PostgresStore, n: int) -> None:
            outcomes.append(await _insert(store, f"m{n}", "the-key"))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for n in range(25):
                    tg.start_soon(attempt, first, n)
                    tg.start_soon(attempt, second, 100 + n)
        winners = [o for o in outcomes if o.inserted]
        assert len(outcomes) == 50
        assert len(winners) == 1
        assert {o.message_id for o in outcomes} == {winners[0].message_id}
        assert await first.count_user_messages("sess_1") == 1
        assert await second.count_user_messages("sess_1", idempotency_key="the-key") == 1
        assert len(await second.read_timeline("sess_1")) == 1


@postgres
async def test_a_delete_waiting_on_a_writer_removes_what_the_writer_committed(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    """Trace: a writer holds a session's row (as every timeline write does) and has appended a
    row, uncommitted; `delete_session` is called and waits on the row; the writer commits.
    Property: the delete removes the session and every timeline row, the one committed while
    it waited included (the timeline has no foreign key: the store deletes it itself)."""
    schema = new_schema()
    app = f"acp-once-delete-{uuid.uuid4().hex[:8]}"
    with anyio.fail_after(60):
        async with (
            _caller_pool(postgres_dsn, application_name=app) as pool,
            PostgresStore.open(pool, schema=schema) as store,
        ):
            await store.create_session(_record())
            await _insert(store, "m1", "key-1")
            statements = compose_statements(schema)
            deleted: list[bool] = []

            async def delete() -> None:
                deleted.append(await store.delete_session("sess_1"))

            async with await _raw(postgres_dsn) as writer, anyio.create_task_group() as tg:
                transaction = writer.transaction()
                async with transaction:
                    await writer.execute(
                        statements.append_entry,
                        {"sid": "sess_1", "mid": "late", "payload": b"{}", "now": 200.0},
                    )
                    tg.start_soon(delete)
                    await _until_waiting_on_a_lock(postgres_dsn, app)
                # the writer's row is committed; the task group waits for the delete
            assert deleted == [True]
            assert await store.get_session("sess_1") is None
            async with await _raw(postgres_dsn) as conn:
                query = sql.SQL("SELECT count(*) FROM {}.timeline WHERE session_id = %s")
                cur = await conn.execute(query.format(sql.Identifier(schema)), ("sess_1",))
                assert await cur.fetchone() == (0,)


@postgres
async def test_two_stores_writing_concurrently_get_strictly_increasing_seqs(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    schema = new_schema()
    async with (
        PostgresStore.open(postgres_dsn, schema=schema) as first,
        PostgresStore.open(postgres_dsn, schema=schema) as second,
    ):
        await first.create_session(_record())
        seqs: list[int] = []

        async def append(store: PostgresStore, n: int) -> None:
            seqs.append(await store.append_update("sess_1", b"{}", message_id=f"a{n}"))

        async def insert(store: PostgresStore, n: int) -> None:
            assert (await _insert(store, f"u{n}", f"k{n}" if n % 2 else None)).inserted

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for n in range(20):
                    tg.start_soon(append, first if n % 2 else second, n)
                    tg.start_soon(insert, second if n % 2 else first, n)
        entries = await first.read_timeline("sess_1")
        assert [e.seq for e in entries] == list(range(1, 41))  # no gap, no repeat
        assert set(seqs) <= {e.seq for e in entries} and len(set(seqs)) == 20
        assert await second.count_user_messages("sess_1") == 20


# -- caller-supplied pools ----------------------------------------------------------------------


@postgres
async def test_the_contract_holds_on_a_caller_pool_which_stays_open(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    """A pool in psycopg's default (non-autocommit) mode, with dict rows: the contract holds,
    the store never closes the pool, and no connection is left in a transaction."""
    app = f"acp-once-test-{uuid.uuid4().hex[:12]}"
    async with _caller_pool(
        postgres_dsn, max_size=4, row_factory=dict_row, application_name=app
    ) as pool:

        def factory() -> AbstractAsyncContextManager[SessionStore]:
            return PostgresStore.open(pool, schema=new_schema())

        assert await run_contract(factory) == []
        assert not pool.closed
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT 1 AS one")
            assert await cur.fetchone() == {"one": 1}
        assert set(await _states(postgres_dsn, app)) <= {"idle"}


async def _close_and_check(store: PostgresStore, pool: AsyncConnectionPool[Any]) -> bool:
    await store.aclose()
    return pool.closed


@postgres
async def test_own_pool_is_closed_by_aclose(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    store = await PostgresStore.open(postgres_dsn, schema=new_schema())
    pool = store._pool
    assert pool is not None
    assert [pool.closed, await _close_and_check(store, pool)] == [False, True]
    with pytest.raises(StorageError, match="closed"):
        await store.get_session("sess_1")


# -- migrations ---------------------------------------------------------------------------------


@postgres
async def test_a_new_schema_without_migrate_is_out_of_date(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    schema = new_schema()
    with pytest.raises(SchemaOutOfDate, match="acp-once db migrate") as caught:
        await PostgresStore.open(postgres_dsn, schema=schema, migrate=False)
    assert (caught.value.found, caught.value.required) == (0, LATEST_VERSION)
    assert isinstance(caught.value, StorageError)
    assert await postgres_status(postgres_dsn, schema) == (0, LATEST_VERSION)
    async with await _raw(postgres_dsn) as conn:  # status and the refusal created nothing
        cur = await conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,))
        assert await cur.fetchone() is None
    assert await migrate_postgres(postgres_dsn, schema) == (0, LATEST_VERSION)
    assert await migrate_postgres(postgres_dsn, schema) == (LATEST_VERSION, LATEST_VERSION)
    assert await postgres_status(postgres_dsn, schema) == (LATEST_VERSION, LATEST_VERSION)
    async with PostgresStore.open(postgres_dsn, schema=schema, migrate=False) as store:
        await store.create_session(_record())
        assert await store.get_session("sess_1") == _record()


@postgres
async def test_a_partly_migrated_schema_is_out_of_date_until_migrated(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    schema = new_schema()
    async with await _raw(postgres_dsn) as conn:
        assert await apply_migrations(conn, schema, target=LATEST_VERSION - 1) == list(
            range(1, LATEST_VERSION)
        )
    with pytest.raises(SchemaOutOfDate, match="acp-once db migrate") as caught:
        await PostgresStore.open(postgres_dsn, schema=schema, migrate=False)
    assert caught.value.found == LATEST_VERSION - 1
    async with PostgresStore.open(postgres_dsn, schema=schema) as store:  # migrate=True
        await store.create_session(_record())
    async with await _raw(postgres_dsn) as conn:
        cur = await conn.execute(
            sql.SQL("SELECT version FROM {}.schema_version ORDER BY version").format(
                sql.Identifier(schema)
            )
        )
        assert [v for (v,) in await cur.fetchall()] == list(range(1, LATEST_VERSION + 1))


@postgres
async def test_concurrent_openers_migrate_once(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    schema = new_schema()
    stores: list[PostgresStore] = []

    async def open_one() -> None:
        stores.append(await PostgresStore.open(postgres_dsn, schema=schema))

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(open_one)
        await stores[0].create_session(_record())
        assert await stores[3].get_session("sess_1") == _record()
    finally:
        for store in stores:
            await store.aclose()
    assert await postgres_status(postgres_dsn, schema) == (LATEST_VERSION, LATEST_VERSION)


@postgres
async def test_a_newer_schema_is_refused(postgres_dsn: str, new_schema: Callable[[], str]) -> None:
    schema = new_schema()
    await migrate_postgres(postgres_dsn, schema)
    async with await _raw(postgres_dsn) as conn:
        await conn.execute(
            sql.SQL("INSERT INTO {}.schema_version (version, description) VALUES (%s, 'x')").format(
                sql.Identifier(schema)
            ),
            (LATEST_VERSION + 1,),
        )
    with pytest.raises(StorageError, match="newer") as caught:
        await PostgresStore.open(postgres_dsn, schema=schema)
    assert not isinstance(caught.value, SchemaOutOfDate)


@postgres
async def test_unreachable_server_is_a_storage_error(new_schema: Callable[[], str]) -> None:
    dsn = "postgresql://nobody:not-this-password@127.0.0.1:1/none"
    with pytest.raises(StorageError, match="cannot connect") as caught:
        await PostgresStore.open(dsn, schema=new_schema(), connect_timeout=2)
    assert "not-this-password" not in str(caught.value)


# -- keys stay out of errors --------------------------------------------------------------------


def _leaks(exc: BaseException, secrets: list[str]) -> list[str]:
    """Every place where one of `secrets` shows in the exception, its chain or its traceback."""
    texts = [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
    chained = exc.__cause__ or exc.__context__
    if chained is not None:
        texts += [str(chained), repr(chained)]
    return [secret for secret in secrets for text in texts if secret in text]


@postgres
async def test_a_unique_violation_never_reports_the_key(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    key = "SECRET-KEY-5f3a9c"
    secrets = [key, key.encode().hex()]
    schema = new_schema()
    app = f"acp-once-test-{uuid.uuid4().hex[:12]}"
    async with (
        _caller_pool(postgres_dsn, application_name=app, autocommit=True) as pool,
        PostgresStore.open(pool, schema=schema) as store,
    ):
        await store.create_session(_record("a"))
        await store.create_session(_record("b"))
        await _insert(store, "m1", key, session_id="a")
        # A stricter index than ours (one key in the whole table) makes the store's own INSERT
        # of the same key in session b fail with a unique violation that quotes the key.
        async with await _raw(postgres_dsn) as conn:
            await conn.execute(
                sql.SQL("CREATE UNIQUE INDEX global_keys ON {}.timeline (idempotency_key)").format(
                    sql.Identifier(schema)
                )
            )
            with pytest.raises(psycopg.errors.UniqueViolation) as raw_error:
                await conn.execute(
                    sql.SQL(
                        "INSERT INTO {}.timeline (session_id, seq, message_id, payload,"
                        " is_user_message, idempotency_key) VALUES ('b', 99, 'x', '', true, %s)"
                    ).format(sql.Identifier(schema)),
                    (key.encode(),),
                )
        assert _leaks(raw_error.value, secrets)  # psycopg's own message does quote it

        with pytest.raises(StorageError) as caught:
            await _insert(store, "m2", key, session_id="b")
        assert "UniqueViolation" in str(caught.value) and "23505" in str(caught.value)
        assert _leaks(caught.value, secrets) == []
        assert caught.value.__cause__ is None and caught.value.__context__ is None

        # Nothing was half-written and the connection went back clean.
        assert await store.count_user_messages("b") == 0
        assert await store.read_timeline("b") == []
        assert (await _insert(store, "m3", "another-key", session_id="b")).inserted
        assert set(await _states(postgres_dsn, app)) <= {"idle"}


# -- cancellation -------------------------------------------------------------------------------


@dataclass
class _Gate:
    """Marks where the calling task's store statements stop: before the first statement whose
    text contains `marker`, `reached` is set, and with `pause` the statement waits for
    `release` (so the connection is inside its transaction, holding the session lock)."""

    marker: str
    pause: bool
    reached: anyio.Event = field(default_factory=anyio.Event)
    release: anyio.Event = field(default_factory=anyio.Event)


_GATE: ContextVar[_Gate | None] = ContextVar("_GATE", default=None)


class _GatedCursor(psycopg.AsyncCursor[Any]):
    async def execute(
        self,
        query: Any,
        params: Any = None,
        *,
        prepare: bool | None = None,
        binary: bool | None = None,
    ) -> Self:
        gate = _GATE.get()
        text = query.as_string() if isinstance(query, sql.Composable) else str(query)
        if gate is not None and not gate.reached.is_set() and gate.marker in text:
            gate.reached.set()
            if gate.pause:
                await gate.release.wait()
        return await super().execute(query, params, prepare=prepare, binary=binary)


async def _check_usable(store: PostgresStore, pool: AsyncConnectionPool[Any]) -> None:
    """No connection was kept out of the pool, and every pooled one works and holds no lock
    (concurrent writes to the session use them all)."""
    with anyio.fail_after(30):
        # a connection given back broken (a statement cancelled) is replaced by the pool in a
        # task of its own: wait for that; one kept out of the pool never comes back
        while (stats := pool.get_stats())["pool_available"] != stats["pool_size"]:  # noqa: ASYNC110
            await anyio.sleep(0.01)  # polling the pool's state, not a synchronisation guess
        async with anyio.create_task_group() as tg:
            for n in range(6):
                tg.start_soon(_insert, store, f"after{n}", f"after-key-{n}")
    assert await store.count_user_messages("sess_1", idempotency_key="after-key-5") == 1


@postgres
async def test_an_insert_whose_caller_is_cancelled_inside_its_transaction_completes(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    """`insert_user_message` is shielded: its caller learns whether the message was stored
    (a stored message whose caller saw only a cancellation would never get its turn)."""
    app = f"acp-once-test-{uuid.uuid4().hex[:12]}"
    async with (
        _caller_pool(postgres_dsn, cursor_factory=_GatedCursor, application_name=app) as pool,
        PostgresStore.open(pool, schema=new_schema(), group_commit=False) as store,
    ):
        await store.create_session(_record())
        gate = _Gate("WITH ins AS", pause=True)  # after the session lock, before the INSERT
        scope = anyio.CancelScope()
        outcomes: list[InsertOutcome] = []

        async def victim() -> None:
            _GATE.set(gate)
            with scope:
                outcomes.append(await _insert(store, "m1", "key-1"))
                await anyio.sleep_forever()  # the cancellation lands here, after the outcome

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(victim)
                await gate.reached.wait()
                assert "idle in transaction" in await _states(postgres_dsn, app)
                scope.cancel()
                await anyio.wait_all_tasks_blocked()
                assert outcomes == []  # still inside its transaction, not abandoned
                gate.release.set()
        assert scope.cancelled_caught
        assert outcomes == [InsertOutcome("m1", True, b"digest")]
        assert await store.find_key("sess_1", "key-1") == KeyRecord("m1", b"digest")
        assert set(await _states(postgres_dsn, app)) <= {"idle"}
        await _check_usable(store, pool)


@postgres
@pytest.mark.parametrize("write", ["insert", "append"])
async def test_a_write_cancelled_while_its_statement_waits_on_the_server(
    postgres_dsn: str, new_schema: Callable[[], str], write: str
) -> None:
    """An append is cancelled there (nothing written, the connection cleaned); an insert is
    shielded and completes once the server lets it (see the test above)."""
    schema = new_schema()
    app = f"acp-once-test-{uuid.uuid4().hex[:12]}"
    async with (
        _caller_pool(postgres_dsn, cursor_factory=_GatedCursor, application_name=app) as pool,
        PostgresStore.open(pool, schema=schema, group_commit=False) as store,
    ):
        await store.create_session(_record())
        gate = _Gate("FOR NO KEY UPDATE" if write == "insert" else "UPDATE", pause=False)
        scope = anyio.CancelScope()
        outcomes: list[object] = []

        async def victim() -> None:
            _GATE.set(gate)
            with scope:
                if write == "insert":
                    outcomes.append(await _insert(store, "m1", "key-1"))
                else:
                    outcomes.append(await store.append_update("sess_1", b'{"a": 1}'))
                await anyio.sleep_forever()

        blocker = await _raw(postgres_dsn)
        try:
            # Another node holds the session row: the victim's statement must wait.
            await blocker.execute("BEGIN")
            await blocker.execute(
                sql.SQL("SELECT 1 FROM {}.sessions WHERE session_id = 'sess_1' FOR UPDATE").format(
                    sql.Identifier(schema)
                )
            )
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(victim)
                    await gate.reached.wait()
                    await _until_waiting_on_a_lock(postgres_dsn, app)  # sent, unanswered
                    scope.cancel()
                    if write == "insert":
                        # shielded: it goes on waiting for the lock, which only the
                        # blocker's end frees (the append's statement is cancelled instead)
                        await anyio.wait_all_tasks_blocked()
                        assert outcomes == []
                        await blocker.execute("ROLLBACK")
            assert scope.cancelled_caught
        finally:
            await blocker.execute("ROLLBACK")
            await blocker.close()

        if write == "insert":
            assert outcomes == [InsertOutcome("m1", True, b"digest")]
            assert await store.find_key("sess_1", "key-1") == KeyRecord("m1", b"digest")
        else:
            assert outcomes == []
            assert await store.read_timeline("sess_1") == []
            assert await _insert(store, "m2", "key-1") == InsertOutcome("m2", True, b"digest")
        assert await store.count_user_messages("sess_1") == 1
        await _check_usable(store, pool)


# -- guarded writes: any guard, not only the cluster's fence -------------------------------------


class _Closed(FencingError):
    """The refusal of `_GateGuard`: its gate row says closed."""


@dataclass(frozen=True)
class _GateGuard:
    """A guard of our own: a write goes through only while the row `name` of a `gates`
    table says open (locked FOR SHARE by the write, as the cluster's fence locks its lease)."""

    schema: str
    name: str
    settle: bool = False
    """Inserts only: the insert also records its message id in the gate row."""

    @property
    def guard_sql(self) -> GuardSql:
        before = "g AS (SELECT open FROM {s}.gates WHERE name = %(gate)s FOR SHARE)"
        holds = "COALESCE((SELECT open FROM g), false)"
        if not self.settle:
            return GuardSql(before=before, holds=holds, columns=holds)
        return GuardSql(
            before=before,
            holds=holds,
            columns=f"{holds}, (SELECT count(*) FROM upd)",
            after=(
                "upd AS (UPDATE {s}.gates SET last = COALESCE(res.mid, %(mid)s) FROM res"
                " WHERE name = %(gate)s AND res.held RETURNING 1)"
            ),
        )

    def guard_params(self) -> Mapping[str, object]:
        return {"gate": self.name}

    def refused(self, session_id: str, columns: Sequence[Any]) -> FencingError | None:
        return None if columns[0] else _Closed(session_id)


@postgres
@pytest.mark.parametrize("group_commit", [True, False], ids=["grouped", "single"])
async def test_a_guard_of_our_own_is_its_own_writes_answer(
    postgres_dsn: str, new_schema: Callable[[], str], group_commit: bool
) -> None:
    """The store knows "a guarded write", not the cluster: a guard made here holds or refuses
    each write alone (in a batch too), its refusal is the guard's own error, nothing is
    written then, and its `after` expressions run with the insert."""
    schema = new_schema()
    async with PostgresStore.open(postgres_dsn, schema=schema, group_commit=group_commit) as store:
        if group_commit:
            batch_everything(store)
        async with await _raw(postgres_dsn) as conn:
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE {s}.gates (name text PRIMARY KEY, open boolean, last text);"
                    " INSERT INTO {s}.gates VALUES ('open', true, NULL), ('shut', false, NULL),"
                    " ('s1', true, NULL), ('s2', true, NULL), ('s3', true, NULL)"
                ).format(s=sql.Identifier(schema))
            )
        sessions = [f"s{n}" for n in range(4)]
        for sid in sessions:
            await store.create_session(_record(sid))
        results: dict[str, object] = {}

        async def insert(sid: str) -> None:
            # a gate row per session: two inserts settling one row would deadlock (both
            # hold it FOR SHARE, then update it), as two fences of one lease never do
            gate = _GateGuard(schema, "shut" if sid == "s0" else sid, settle=True)
            try:
                results[sid] = await store.insert_user_message(
                    sid, message_id=f"{sid}-m", update=_update(f"{sid}-m"),
                    idempotency_key="k", prompt_digest=b"d", guard=gate,
                )  # fmt: skip
            except FencingError as exc:
                results[sid] = exc

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for sid in sessions:
                    tg.start_soon(insert, sid)
        assert isinstance(results["s0"], _Closed)
        assert await store.count_user_messages("s0") == 0
        for sid in sessions[1:]:
            assert results[sid] == InsertOutcome(f"{sid}-m", True, b"d")
        async with await _raw(postgres_dsn) as conn:
            cur = await conn.execute(
                sql.SQL("SELECT name, last FROM {s}.gates ORDER BY name").format(
                    s=sql.Identifier(schema)
                )
            )
            assert await cur.fetchall() == [
                ("open", None),
                ("s1", "s1-m"),
                ("s2", "s2-m"),
                ("s3", "s3-m"),
                ("shut", None),
            ]
        # the key again: the recorded message, the guard's `after` sees it (res.mid)
        again = await store.insert_user_message(
            "s1", message_id="other", update=b"{}", idempotency_key="k", prompt_digest=b"d",
            guard=_GateGuard(schema, "open", settle=True),
        )  # fmt: skip
        assert again == InsertOutcome("s1-m", False, b"d")
        async with await _raw(postgres_dsn) as conn:
            cur = await conn.execute(
                sql.SQL("SELECT last FROM {s}.gates WHERE name = 'open'").format(
                    s=sql.Identifier(schema)
                )
            )
            assert await cur.fetchone() == ("s1-m",)

        open_gate, shut_gate = _GateGuard(schema, "open"), _GateGuard(schema, "shut")
        assert await store.append_updates("s1", [(b"{}", "a"), (b"{}", None)], guard=open_gate) == [
            2,
            3,
        ]
        assert await store.append_update("s1", b"{}", guard=open_gate) == 4
        with pytest.raises(_Closed):
            await store.append_updates("s1", [(b"{}", "b")], guard=shut_gate)
        with pytest.raises(_Closed):
            await store.append_update("s1", b"{}", guard=shut_gate)
        with pytest.raises(SessionMissing):
            await store.append_update("nope", b"{}", guard=open_gate)
        with pytest.raises(ValueError, match="inserts only"):
            await store.append_update("s1", b"{}", guard=_GateGuard(schema, "open", settle=True))
        assert [e.seq for e in await store.read_timeline("s1")] == [1, 2, 3, 4]


# -- connections that died while idle in the pool ----------------------------------------------


async def _terminate_backends(dsn: str, application_name: str) -> int:
    """Terminate every backend with this application name (as an operator or a failover
    would), and wait until the server has let them all go; returns how many there were."""
    async with await _raw(dsn) as conn:
        cur = await conn.execute(
            # MATERIALIZED: the filter runs before pg_terminate_backend (never on ourselves)
            "WITH t AS MATERIALIZED (SELECT pid FROM pg_stat_activity"
            "  WHERE datname = current_database() AND pid <> pg_backend_pid()"
            "  AND application_name = %s)"
            " SELECT pid FROM t WHERE pg_terminate_backend(pid)",
            (application_name,),
        )
        pids = [pid for (pid,) in await cur.fetchall()]
        while True:  # new connections of the pool may appear meanwhile: those are not waited on
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
            )
            left = await cur.fetchone()
            if left is not None and left[0] == 0:
                return len(pids)
            await anyio.sleep(0.01)  # polling the server's view, bounded by the caller


@postgres
@pytest.mark.parametrize("group_commit", [True, False], ids=["grouped", "single"])
async def test_the_writes_after_the_backends_were_terminated_succeed(
    postgres_dsn: str, new_schema: Callable[[], str], group_commit: bool
) -> None:
    """Every pooled connection dies while idle (its backend terminated): the very next calls
    succeed on fresh connections, and each write is stored exactly once."""
    app = f"acp-once-test-{uuid.uuid4().hex[:12]}"
    dsn = psycopg.conninfo.make_conninfo(postgres_dsn, application_name=app)
    async with PostgresStore.open(
        dsn, schema=new_schema(), min_size=3, max_size=3, group_commit=group_commit
    ) as store:
        await store.create_session(_record())
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:  # every pooled connection used once
                for n in range(3):
                    tg.start_soon(_insert, store, f"m{n}", f"key-{n}")
            assert await _terminate_backends(postgres_dsn, app) == 3
            for n in range(3, 7):
                assert await _insert(store, f"m{n}", f"key-{n}") == InsertOutcome(
                    f"m{n}", True, b"digest"
                )
            assert await store.append_update("sess_1", b'{"a": 1}', message_id="a") == 8
            assert await _terminate_backends(postgres_dsn, app) >= 1
            assert (await store.get_session("sess_1")) is not None
            assert await _insert(store, "m3-again", "key-3") == InsertOutcome(
                "m3", False, b"digest"
            )
        assert await store.count_user_messages("sess_1") == 7
        assert [entry.seq for entry in await store.read_timeline("sess_1")] == list(range(1, 9))


@postgres
@pytest.mark.parametrize("clustered", [False, True], ids=["one-node", "cluster-node"])
async def test_the_prompts_after_the_backends_were_terminated_succeed(
    postgres_dsn: str, new_schema: Callable[[], str], tmp_path: Path, clustered: bool
) -> None:
    """An agent on the store (alone, or as a cluster node as `acp-once serve` runs it): after
    its backends are terminated, the very next prompts are answered (no -32603), and a retry
    of one of them gets its recorded id (each is stored once)."""
    app = f"acp-once-test-{uuid.uuid4().hex[:12]}"
    dsn = psycopg.conninfo.make_conninfo(postgres_dsn, application_name=app)
    schema, effects = new_schema(), tmp_path / "effects"
    async with AsyncExitStack() as stack:
        if clustered:
            one = await stack.enter_async_context(node(dsn, schema, "a", effects, max_size=3))
            agent, store = one.agent, one.store
        else:
            store = await stack.enter_async_context(
                PostgresStore.open(dsn, schema=schema, min_size=3, max_size=3)
            )
            agent = await stack.enter_async_context(ReferenceAgent(store, side_effects=effects))
        conn = await stack.enter_async_context(connected(agent))
        with anyio.fail_after(20):
            await initialize(conn)
            sid = await new_session(conn)
            await prompt(conn, sid, "before", "k-before")
            assert await _terminate_backends(postgres_dsn, app) >= 1
            answered = [await prompt(conn, sid, f"after {n}", f"k-after-{n}") for n in range(3)]
            assert await prompt(conn, sid, "after 0", "k-after-0") == answered[0]
            assert await store.count_user_messages(sid) == 4


# -- find_key and the tail are index lookups ----------------------------------------------------


@postgres
async def test_find_key_and_the_tail_use_indexes(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    schema = new_schema()
    async with PostgresStore.open(postgres_dsn, schema=schema) as store:
        await store.create_session(_record())
    statements = compose_statements(schema)
    async with await _raw(postgres_dsn) as conn:
        await conn.execute(
            sql.SQL(
                "INSERT INTO {s}.timeline (session_id, seq, message_id, payload, is_user_message,"
                " idempotency_key) SELECT 'sess_1', n, 'm' || n, '\\x7b7d', true,"
                " convert_to('key-' || n, 'UTF8') FROM generate_series(1, 20000) n"
            ).format(s=sql.Identifier(schema))
        )
        await conn.execute(sql.SQL("ANALYZE {}.timeline").format(sql.Identifier(schema)))

        async def plan(query: sql.Composed, params: tuple[object, ...]) -> str:
            cur = await conn.execute(sql.SQL("EXPLAIN ") + query, params)
            return "\n".join(str(line) for (line,) in await cur.fetchall())

        assert "timeline_user_keys" in await plan(statements.find_key, ("sess_1", b"key-77"))
        tail = await plan(statements.read_tail, ("sess_1", 1))
        assert "Index Scan Backward using timeline_pkey" in tail
    async with PostgresStore.open(postgres_dsn, schema=schema) as store:
        assert await store.find_key("sess_1", "key-77") == KeyRecord("m77", None)
        assert [e.seq for e in await store.read_timeline_tail("sess_1", limit=2)] == [19999, 20000]


# -- URLs, the CLI, and the skip-or-fail rule ---------------------------------------------------


def _with_schema(dsn: str, schema: str) -> str:
    return f"{dsn}{'&' if '?' in dsn else '?'}schema={schema}"


@postgres
async def test_open_store_accepts_postgresql_urls(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    schema = new_schema()
    with pytest.raises(SchemaOutOfDate, match="acp-once db migrate"):
        async with open_store(_with_schema(postgres_dsn, schema), migrate=False):
            pass
    async with open_store(_with_schema(postgres_dsn, schema)) as store:
        assert isinstance(store, PostgresStore)
        await store.create_session(_record())
        await _insert(store, "m1", "k")
    short = _with_schema(postgres_dsn.replace("postgresql://", "postgres://", 1), schema)
    async with open_store(short, migrate=False) as again:
        assert await again.find_key("sess_1", "k") == KeyRecord("m1", b"digest")


def test_parse_and_describe_postgres_urls() -> None:
    assert parse_postgres_url("postgresql://h/db") == ("postgresql://h/db", "acp_once")
    assert parse_postgres_url("postgres://u@h:6/db?sslmode=disable&schema=nodes") == (
        "postgres://u@h:6/db?sslmode=disable",
        "nodes",
    )
    with pytest.raises(ValueError, match="schema"):
        parse_postgres_url("postgresql://h/db?schema=")
    with pytest.raises(ValueError, match="postgresql://"):
        parse_postgres_url("sqlite:x.db")
    where = describe_postgres("postgresql://user:hunter2@db.example:6543/acp", "s")
    assert where == "postgresql://db.example:6543/acp (schema s)"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acp_once", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@postgres
def test_cli_db_status_and_migrate(postgres_dsn: str, new_schema: Callable[[], str]) -> None:
    url = _with_schema(postgres_dsn, new_schema())
    pending = _cli("db", "status", "--store", url)
    assert pending.returncode == 1 and "schema version 0 of" in pending.stdout
    migrated = _cli("db", "migrate", "--store", url)
    assert migrated.returncode == 0 and f"0 -> {LATEST_VERSION}" in migrated.stdout
    up = _cli("db", "status", "--store", url)
    assert up.returncode == 0 and "up to date" in up.stdout
    down = _cli("db", "status", "--store", "postgresql://nobody:pw-XYZ@127.0.0.1:1/none")
    assert down.returncode == 2 and "cannot connect" in down.stderr
    assert "pw-XYZ" not in down.stderr + down.stdout


@pytest.mark.parametrize(("ci", "outcome"), [("true", "1 error"), ("", "1 skipped")])
def test_without_a_dsn_postgres_tests_skip_except_on_ci(ci: str, outcome: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("ACP_ONCE_TEST_POSTGRES_DSN", "CI")}
    if ci:
        env["CI"] = ci
    test = f"{__file__}::test_data_survives_close_and_reopen"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert outcome in result.stdout, result.stdout
    assert (result.returncode != 0) == bool(ci)
    if ci:
        assert "CI=true requires the PostgreSQL tests" in result.stdout


@postgres
@pytest.mark.parametrize("batched", [False, True])
async def test_updated_at_moves_in_steps_of_a_second_and_never_back(
    postgres_dsn: str, new_schema: Callable[[], str], batched: bool
) -> None:
    """A write within a second of the last bump leaves `updated_at` (and so every index of
    `sessions`) as it is; `session/list` shows whole seconds, so nothing visible is lost."""
    now = [1_000.0]
    async with PostgresStore.open(postgres_dsn, schema=new_schema(), clock=lambda: now[0]) as store:
        if batched:
            batch_everything(store)
        await store.create_session(_record(updated_at=1_000.0))
        now[0] = 1_000.5
        await _insert(store, "m1", None)
        await store.append_updates("sess_1", [(b"{}", None)])
        await store.append_update("sess_1", b"{}")
        record = await store.get_session("sess_1")
        assert record is not None and record.updated_at == 1_000.0  # within the second
        now[0] = 1_001.0
        await _insert(store, "m2", "k")
        record = await store.get_session("sess_1")
        assert record is not None and record.updated_at == 1_001.0  # a second later: bumped
        now[0] = 900.0  # a clock that went back never moves it back
        await store.append_update("sess_1", b"{}")
        record = await store.get_session("sess_1")
        assert record is not None and record.updated_at == 1_001.0
        assert [e.seq for e in await store.read_timeline("sess_1")] == [1, 2, 3, 4, 5]
