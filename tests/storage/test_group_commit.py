"""Group commit (`acp_once.storage.grouping`) in the SQLite and PostgreSQL stores: writes of
many sessions that arrive together share a transaction, each caller gets its own outcome
after its own commit, and one write's conflict or error is its answer alone.

The batches and writes counted here are the stores' `group_stats` (one batch, one
transaction)."""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING

import anyio
import orjson
import pytest

from acp_once.storage import InsertOutcome, KeyRecord, SessionMissing, SessionRecord, SqliteStore
from acp_once.storage.base import StorageError
from acp_once.storage.postgres import PostgresStore
from tests.storage.conftest import batch_everything

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractAsyncContextManager
    from pathlib import Path

    Opener = Callable[[], AbstractAsyncContextManager[SqliteStore | PostgresStore]]

pytestmark = pytest.mark.anyio


@pytest.fixture(
    params=["sqlite", "sqlite-writer", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def open_grouped(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """Opens a durable store with group commit (the default) on fresh storage."""
    if request.param == "postgres":
        dsn: str = request.getfixturevalue("postgres_dsn")
        new_schema: Callable[[], str] = request.getfixturevalue("new_schema")
        return lambda: PostgresStore.open(dsn, schema=new_schema())
    writer = request.param == "sqlite-writer"
    return lambda: SqliteStore.open(tmp_path / "grouped.db", writer_process=writer)


def _record(session_id: str) -> SessionRecord:
    return SessionRecord(session_id, "/w", (), None, 1.0, 1.0)


def _update(message_id: str) -> bytes:
    return orjson.dumps(
        {
            "sessionUpdate": "user_message",
            "messageId": message_id,
            "content": [{"type": "text", "text": "hello"}],
        }
    )


async def _insert(
    store: SqliteStore | PostgresStore, session_id: str, message_id: str, key: str | None
) -> InsertOutcome:
    return await store.insert_user_message(
        session_id,
        message_id=message_id,
        update=_update(message_id),
        idempotency_key=key,
        prompt_digest=None if key is None else f"digest of {message_id}".encode(),
    )


async def test_concurrent_inserts_of_many_sessions_share_transactions(
    open_grouped: Opener,
) -> None:
    sessions = [f"s{n}" for n in range(20)]
    async with open_grouped() as store:
        for sid in sessions:
            await store.create_session(_record(sid))
        stats = store.group_stats
        assert stats is not None
        before = stats.batches, stats.writes
        outcomes: dict[tuple[str, int], InsertOutcome] = {}

        async def client(sid: str) -> None:
            for n in range(5):
                outcomes[sid, n] = await _insert(store, sid, f"{sid}-m{n}", f"{sid}-k{n}")
                await store.append_update(sid, b'{"sessionUpdate": "x"}', message_id=f"{sid}-a{n}")

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for sid in sessions:
                    tg.start_soon(client, sid)

        batches, writes = stats.batches - before[0], stats.writes - before[1]
        assert writes == 20 * 5 * 2
        assert batches < writes / 4, (batches, writes)  # grouped, far fewer commits than writes
        assert stats.largest > 1
        for sid in sessions:  # every caller got its own outcome, and it is stored
            for n in range(5):
                digest = f"digest of {sid}-m{n}".encode()
                assert outcomes[sid, n] == InsertOutcome(f"{sid}-m{n}", True, digest)
                assert await store.find_key(sid, f"{sid}-k{n}") == KeyRecord(f"{sid}-m{n}", digest)
            entries = await store.read_timeline(sid)
            assert [e.message_id for e in entries] == [
                mid for n in range(5) for mid in (f"{sid}-m{n}", f"{sid}-a{n}")
            ]
            assert [e.seq for e in entries] == list(range(1, 11))


@pytest.mark.parametrize("batched", [False, True], ids=["default", "batched"])
async def test_concurrent_inserts_of_one_key_store_one_message(
    open_grouped: Opener, batched: bool
) -> None:
    """Same key from several tasks, several sessions at once (so batches form): one message
    per session, and every caller of a session gets its message id."""
    async with open_grouped() as store:
        if batched:
            batch_everything(store)
        for sid in ("a", "b", "c"):
            await store.create_session(_record(sid))
        outcomes: list[tuple[str, InsertOutcome]] = []

        async def attempt(sid: str, n: int) -> None:
            outcomes.append((sid, await _insert(store, sid, f"{sid}-m{n}", "same-key")))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for n in range(10):
                    for sid in ("a", "b", "c"):
                        tg.start_soon(attempt, sid, n)
        stats = store.group_stats
        assert stats is not None and stats.largest > 1
        for sid in ("a", "b", "c"):
            mine = [outcome for s, outcome in outcomes if s == sid]
            assert len(mine) == 10
            winners = [outcome for outcome in mine if outcome.inserted]
            assert len(winners) == 1
            assert {outcome.message_id for outcome in mine} == {winners[0].message_id}
            assert await store.count_user_messages(sid) == 1
            found = await store.find_key(sid, "same-key")
            assert found is not None and found.message_id == winners[0].message_id


@pytest.mark.parametrize("batched", [False, True], ids=["default", "batched"])
async def test_a_write_to_a_missing_session_fails_alone(
    open_grouped: Opener, batched: bool
) -> None:
    async with open_grouped() as store:
        if batched:
            batch_everything(store)
        await store.create_session(_record("here"))
        results: dict[str, object] = {}

        async def attempt(name: str, sid: str, append: bool) -> None:
            try:
                if append:
                    results[name] = await store.append_update(sid, b"{}")
                else:
                    results[name] = await _insert(store, sid, name, f"key-{name}")
            except SessionMissing as exc:
                results[name] = exc

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(attempt, "m1", "here", False)
                tg.start_soon(attempt, "gone1", "gone", False)
                tg.start_soon(attempt, "m2", "here", False)
                tg.start_soon(attempt, "gone2", "gone", True)
                tg.start_soon(attempt, "a3", "here", True)
        assert isinstance(results["gone1"], SessionMissing)
        assert isinstance(results["gone2"], SessionMissing)
        assert results["m1"] == InsertOutcome("m1", True, b"digest of m1")
        assert results["m2"] == InsertOutcome("m2", True, b"digest of m2")
        assert results["a3"] == 3
        assert [e.message_id for e in await store.read_timeline("here")] == ["m1", "m2", None]
        assert await store.read_timeline("gone") == []


@pytest.mark.postgres
async def test_a_value_postgresql_refuses_fails_its_own_write_only(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    """A NUL in a text column aborts the batch's transaction on the server: the batch is
    then written write by write, and only the faulty one fails."""
    async with PostgresStore.open(postgres_dsn, schema=new_schema()) as store:
        batch_everything(store)
        for sid in ("a", "b", "c"):
            await store.create_session(_record(sid))
        results: dict[str, object] = {}

        async def attempt(sid: str, message_id: str) -> None:
            try:
                results[sid] = await _insert(store, sid, message_id, f"key-{sid}")
            except StorageError as exc:
                results[sid] = exc

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(attempt, "a", "ma")
                tg.start_soon(attempt, "b", "m\x00b")
                tg.start_soon(attempt, "c", "mc")
        assert isinstance(results["b"], StorageError)
        assert "key-b" not in str(results["b"])
        assert results["a"] == InsertOutcome("ma", True, b"digest of ma")
        assert results["c"] == InsertOutcome("mc", True, b"digest of mc")
        assert await store.find_key("b", "key-b") is None
        assert await store.count_user_messages("b") == 0


async def test_cancelled_callers_of_a_batch_in_flight_and_of_a_queued_write(
    tmp_path: Path,
) -> None:
    """While a batch waits for SQLite's write lock (held by another connection), a cancelled
    caller of that batch still gets its outcome (cancelled afterwards), and a cancelled caller
    whose write is only queued withdraws it: nothing of it is written."""
    path = tmp_path / "cancel.db"
    async with SqliteStore.open(path) as store:
        for sid in ("a", "b", "c", "d"):
            await store.create_session(_record(sid))
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # holds the write lock
        scopes = {sid: anyio.CancelScope() for sid in ("a", "b", "c", "d")}
        outcomes: dict[str, InsertOutcome] = {}
        answered = {sid: anyio.Event() for sid in ("a", "b", "c", "d")}

        async def caller(sid: str) -> None:
            with scopes[sid]:
                outcomes[sid] = await _insert(store, sid, f"{sid}-m", f"{sid}-k")
                answered[sid].set()
                await anyio.sleep_forever()  # a cancellation lands here, after the outcome

        try:
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(caller, "a")
                    tg.start_soon(caller, "b")  # a and b: one batch, in the worker thread
                    await anyio.wait_all_tasks_blocked()
                    tg.start_soon(caller, "c")
                    tg.start_soon(caller, "d")  # c and d: queued behind it
                    await anyio.wait_all_tasks_blocked()
                    scopes["a"].cancel()
                    scopes["c"].cancel()
                    await anyio.wait_all_tasks_blocked()
                    assert outcomes == {}  # a waits for its batch; c withdrew
                    blocker.execute("ROLLBACK")
                    for sid in ("a", "b", "d"):
                        await answered[sid].wait()
                    scopes["b"].cancel()
                    scopes["d"].cancel()
        finally:
            if blocker.in_transaction:
                blocker.execute("ROLLBACK")
            blocker.close()
        assert sorted(outcomes) == ["a", "b", "d"]
        assert all(scope.cancelled_caught for scope in scopes.values())
        for sid in ("a", "b", "d"):
            assert outcomes[sid] == InsertOutcome(f"{sid}-m", True, f"digest of {sid}-m".encode())
            assert await store.find_key(sid, f"{sid}-k") is not None
        assert await store.find_key("c", "c-k") is None
        assert await store.read_timeline("c") == []
        stats = store.group_stats
        assert stats is not None and stats.largest == 2


def _fail_the_commit_holding(path: Path, key: str) -> None:
    """Make every COMMIT of a transaction that inserted the user message of `key` fail, for
    real: a trigger on that INSERT adds a row whose foreign key is deferred and dangling, so
    the statement succeeds and SQLite refuses the COMMIT ("FOREIGN KEY constraint failed",
    the transaction left open). The store's connections have foreign keys on."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("CREATE TABLE commit_guard_parent (id INTEGER PRIMARY KEY)")
        conn.execute(
            "CREATE TABLE commit_guard (parent INTEGER"
            " REFERENCES commit_guard_parent (id) DEFERRABLE INITIALLY DEFERRED)"
        )
        conn.execute(
            "CREATE TRIGGER commit_guard_on_key AFTER INSERT ON timeline"
            f" WHEN NEW.idempotency_key = '{key}'"
            " BEGIN INSERT INTO commit_guard (parent) VALUES (1); END"
        )
    finally:
        conn.close()


@pytest.mark.parametrize("batched", [False, True], ids=["lone", "batch"])
async def test_sqlite_a_failed_commit_fails_every_write_it_held(
    tmp_path: Path, batched: bool
) -> None:
    """Trace: one user message alone (`db.write`), or three of three sessions in one batch
    (`_write_together`), one of them the doomed key; every statement succeeds and the COMMIT
    fails. Property: every caller of that transaction gets a StorageError (none is told its
    message is stored), nothing of it is in the file, and the connection is not left inside
    the failed transaction (the next write commits)."""
    path = tmp_path / "commit.db"
    sessions = ("a", "b", "c") if batched else ("a",)
    async with SqliteStore.open(path) as store:
        for sid in sessions:
            await store.create_session(_record(sid))
        _fail_the_commit_holding(path, "a-k")
        if batched:
            batch_everything(store)
        results: dict[str, object] = {}

        async def attempt(sid: str) -> None:
            try:
                results[sid] = await _insert(store, sid, f"{sid}-m", f"{sid}-k")
            except StorageError as exc:
                results[sid] = exc

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for sid in sessions:
                    tg.start_soon(attempt, sid)
        stats = store.group_stats
        assert stats is not None and stats.largest == len(sessions)  # one transaction
        for sid in sessions:
            assert isinstance(results[sid], StorageError), (sid, results[sid])
            assert await store.find_key(sid, f"{sid}-k") is None
            assert await store.read_timeline(sid) == []
        with anyio.fail_after(10):
            assert await _insert(store, "a", "a-m2", "a-k2") == InsertOutcome(
                "a-m2", True, b"digest of a-m2"
            )
        assert [e.message_id for e in await store.read_timeline("a")] == ["a-m2"]
