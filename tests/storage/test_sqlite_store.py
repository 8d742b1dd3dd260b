"""What only the SQLite backend promises: durability, sharing a file, migrations, cancellation."""

from __future__ import annotations

import shutil
import sqlite3
import threading
from typing import TYPE_CHECKING

import anyio
import anyio.from_thread
import orjson
import pytest

from acp_once.storage import (
    InsertOutcome,
    KeyRecord,
    SchemaOutOfDate,
    SessionMissing,
    SessionRecord,
    SqliteStore,
    StorageError,
    migrate_database,
)
from acp_once.storage.sqlite import FIND_KEY_SQL
from acp_once.storage.sqlite.checkpoint import (
    _RESTART_INTERVAL_S,  # pyright: ignore[reportPrivateUsage]
    _WAL_RESTART_CAP,  # pyright: ignore[reportPrivateUsage]
    _WAL_RESTART_PAGES,  # pyright: ignore[reportPrivateUsage]
    _restart_due,  # pyright: ignore[reportPrivateUsage]
)
from acp_once.storage.sqlite.schema import LATEST_VERSION, apply_migrations, current_version
from acp_once.support.sqlite import Connection, enable_wal

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    from acp_once.storage.sqlite.checkpoint import Checkpointer


def _record(session_id: str = "sess_1", *, updated_at: float = 100.0) -> SessionRecord:
    return SessionRecord(session_id, "/work", ("/lib",), "title", 50.0, updated_at)


def _update(message_id: str) -> bytes:
    return orjson.dumps({"sessionUpdate": "user_message", "messageId": message_id})


async def _insert(
    store: SqliteStore, message_id: str, key: str | None, session_id: str = "sess_1"
) -> InsertOutcome:
    return await store.insert_user_message(
        session_id,
        message_id=message_id,
        update=_update(message_id),
        idempotency_key=key,
        prompt_digest=b"digest" if key else None,
    )


class _PauseAtInsert:
    """A trace callback that stops the store's worker thread inside its write transaction.

    It fires once, when the INSERT into the timeline starts (after BEGIN IMMEDIATE), sets
    `reached` and blocks that thread until `release` is set. It is never unregistered while
    the store may be mid-statement: changing callbacks then would deadlock on SQLite's mutex.
    """

    def __init__(self) -> None:
        self.reached = anyio.Event()
        self.release = threading.Event()
        self._fired = False

    def __call__(self, statement: str) -> None:
        if not self._fired and statement.startswith("INSERT INTO timeline"):
            self._fired = True
            anyio.from_thread.run_sync(self.reached.set)
            self.release.wait(timeout=30)


def _raw(store: SqliteStore) -> sqlite3.Connection:
    """The store's worker-thread connection, for white-box checks while the store is idle
    (tests that instrument it open the store with `inline=False`, so every call uses it)."""
    conn = store._conn
    assert conn is not None
    return conn


# -- durability and sharing ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_data_survives_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "sessions.db"
    async with SqliteStore.open(path) as store:
        await store.create_session(_record())
        await _insert(store, "m1", "key-1")
        await store.append_update("sess_1", b'{"sessionUpdate":"agent_message"}', message_id="a")
        before = await store.read_timeline("sess_1")
        record = await store.get_session("sess_1")
    assert store._conn is None

    store = await SqliteStore.open(path)  # the explicit lifecycle
    try:
        assert await store.get_session("sess_1") == record
        assert await store.read_timeline("sess_1") == before
        assert await store.find_key("sess_1", "key-1") == KeyRecord("m1", b"digest")
        assert await _insert(store, "m2", "key-1") == InsertOutcome("m1", False, b"digest")
        assert await store.count_user_messages("sess_1") == 1
    finally:
        await store.aclose()


@pytest.mark.anyio
async def test_a_second_store_on_the_same_file_sees_writes(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    async with SqliteStore.open(path) as agent, SqliteStore.open(path) as observer:
        await agent.create_session(_record())
        assert await observer.get_session("sess_1") == _record()
        await _insert(agent, "m1", "key-1")
        assert await observer.count_user_messages("sess_1", idempotency_key="key-1") == 1
        assert await _insert(observer, "m2", "key-1") == InsertOutcome("m1", False, b"digest")
        await _insert(observer, "m3", None)
        assert [e.message_id for e in await agent.read_timeline("sess_1")] == ["m1", "m3"]


@pytest.mark.anyio
async def test_two_stores_racing_on_one_key_insert_once(tmp_path: Path) -> None:
    path = tmp_path / "race.db"
    async with SqliteStore.open(path) as first, SqliteStore.open(path) as second:
        await first.create_session(_record())
        outcomes: list[InsertOutcome] = []

        async def attempt(store: SqliteStore, n: int) -> None:
            outcomes.append(await _insert(store, f"m{n}", "the-key"))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for n in range(25):
                    tg.start_soon(attempt, first, n)
                    tg.start_soon(attempt, second, 100 + n)
        winners = [o for o in outcomes if o.inserted]
        assert len(outcomes) == 50
        assert len(winners) == 1
        assert {o.message_id for o in outcomes} == {winners[0].message_id}
        assert await first.count_user_messages("sess_1") == 1
        assert await second.count_user_messages("sess_1") == 1


@pytest.mark.anyio
async def test_the_unique_index_refuses_a_second_row_for_a_key(tmp_path: Path) -> None:
    """Even a writer that bypasses the store cannot record one key twice in a session."""
    path = tmp_path / "guard.db"
    async with SqliteStore.open(path) as store:
        await store.create_session(_record())
        await _insert(store, "m1", "key-1")
    raw = sqlite3.connect(path)
    try:
        insert = (
            "INSERT INTO timeline (session, seq, message_id, payload, is_user_message,"
            " idempotency_key) VALUES ((SELECT number FROM sessions WHERE session_id = 'sess_1'),"
            " 99, 'm2', x'7b7d', 1, 'key-1')"
        )
        with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
            raw.execute(insert)
        raw.execute(insert.replace("'key-1'", "'key-2'"))  # another key is fine
    finally:
        raw.close()


@pytest.mark.anyio
async def test_delete_leaves_no_orphan_rows(tmp_path: Path) -> None:
    path = tmp_path / "delete.db"
    async with SqliteStore.open(path) as store:
        await store.create_session(_record())
        await _insert(store, "m1", "key-1")
        assert await store.delete_session("sess_1")
        rows = _raw(store).execute("SELECT COUNT(*) FROM timeline").fetchone()
        assert rows == (0,)


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_connection_settings(tmp_path: Path) -> None:
    async with SqliteStore.open(tmp_path / "a.db") as store:
        conn = _raw(store)
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("PRAGMA synchronous").fetchone() == (1,)  # NORMAL
        assert conn.execute("PRAGMA foreign_keys").fetchone() == (1,)
        assert conn.execute("PRAGMA busy_timeout").fetchone() == (5000,)
    async with SqliteStore.open(
        tmp_path / "b.db", synchronous="FULL", busy_timeout_ms=1234
    ) as store:
        conn = _raw(store)
        assert conn.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
        assert conn.execute("PRAGMA busy_timeout").fetchone() == (1234,)


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="synchronous"):
        SqliteStore.open(tmp_path / "a.db", synchronous="OFF")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="busy_timeout_ms"):
        SqliteStore.open(tmp_path / "a.db", busy_timeout_ms=-1)


@pytest.mark.anyio
async def test_an_unopenable_path_is_a_storage_error(tmp_path: Path) -> None:
    # a missing directory is created (0700), so the unopenable path is under a regular file
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(StorageError, match="cannot open"):
        await SqliteStore.open(tmp_path / "a-file" / "a.db")


# -- migrations ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_new_file_without_migrate_is_out_of_date(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    with pytest.raises(SchemaOutOfDate, match="acp-once db migrate") as caught:
        await SqliteStore.open(path, migrate=False)
    assert (caught.value.found, caught.value.required) == (0, LATEST_VERSION)
    assert isinstance(caught.value, StorageError)
    assert await migrate_database(path) == (0, LATEST_VERSION)
    assert await migrate_database(path) == (LATEST_VERSION, LATEST_VERSION)
    async with SqliteStore.open(path, migrate=False) as store:
        await store.create_session(_record())
        assert await store.get_session("sess_1") == _record()


@pytest.mark.anyio
async def test_a_partly_migrated_file_is_out_of_date_until_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    raw = sqlite3.connect(path, isolation_level=None, factory=Connection)
    try:
        assert apply_migrations(raw, target=LATEST_VERSION - 1) == list(range(1, LATEST_VERSION))
    finally:
        raw.close()
    with pytest.raises(SchemaOutOfDate, match="acp-once db migrate") as caught:
        await SqliteStore.open(path, migrate=False)
    assert caught.value.found == LATEST_VERSION - 1
    async with SqliteStore.open(path) as store:  # migrate=True is the default
        versions = _raw(store).execute("SELECT version FROM schema_version ORDER BY version")
        assert [v for (v,) in versions] == list(range(1, LATEST_VERSION + 1))


@pytest.mark.anyio
async def test_version_3_numbers_the_sessions_and_keeps_every_row_and_key(tmp_path: Path) -> None:
    """A file written at version 2 (timeline keyed by the text id) keeps its sessions, its
    history, its keys and their guard through the migration that keys it by number."""
    path = tmp_path / "v2.db"
    raw = sqlite3.connect(path, isolation_level=None, factory=Connection)
    try:
        assert apply_migrations(raw, target=2) == [1, 2]
        raw.execute("PRAGMA foreign_keys = ON")
        raw.execute("BEGIN")
        for sid, created, tenant in (("sess_b", 20.0, "t1"), ("sess_a", 10.0, None)):
            raw.execute(
                "INSERT INTO sessions (session_id, cwd, additional_directories, title,"
                " created_at, updated_at, forked_from, tenant) VALUES (?, '/w', '[]', ?, ?, ?,"
                " NULL, ?)",
                (sid, f"title {sid}", created, created + 1, tenant),
            )
            for seq in (1, 2, 3):
                keyed = seq != 2
                raw.execute(
                    "INSERT INTO timeline (session_id, seq, message_id, payload,"
                    " is_user_message, idempotency_key, prompt_digest)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        sid,
                        seq,
                        f"m-{sid}-{seq}",
                        _update(f"m-{sid}-{seq}"),
                        1 if keyed else 0,
                        f"key-{seq}" if keyed else None,
                        b"digest" if keyed else None,
                    ),
                )
        raw.execute("COMMIT")
    finally:
        raw.close()
    async with SqliteStore.open(path) as store:
        assert current_version(_raw(store)) == 3
        # numbered in creation order
        numbers = _raw(store).execute("SELECT session_id, number FROM sessions ORDER BY number")
        assert [sid for sid, _ in numbers] == ["sess_a", "sess_b"]
        for sid in ("sess_a", "sess_b"):
            record = await store.get_session(sid)
            assert record is not None and record.title == f"title {sid}"
            entries = await store.read_timeline(sid)
            assert [(e.seq, e.message_id) for e in entries] == [
                (seq, f"m-{sid}-{seq}") for seq in (1, 2, 3)
            ]
            assert await store.find_key(sid, "key-3") == KeyRecord(f"m-{sid}-3", b"digest")
            assert await store.find_key(sid, "key-2") is None
            # the guard still holds, and the next write follows the migrated history
            again = await _insert(store, "m-new", "key-1", session_id=sid)
            assert (again.message_id, again.inserted) == (f"m-{sid}-1", False)
            fresh = await _insert(store, f"m-{sid}-4", "key-4", session_id=sid)
            assert fresh.inserted
            assert [e.seq for e in await store.read_timeline(sid)] == [1, 2, 3, 4]
        listed, _ = await store.list_sessions(tenant="t1")
        assert [r.session_id for r in listed] == ["sess_b"]
        tables = _raw(store).execute("SELECT name FROM sqlite_master WHERE name LIKE '%_v2'")
        assert tables.fetchall() == []


@pytest.mark.anyio
async def test_a_session_created_again_under_its_id_gets_a_new_number(tmp_path: Path) -> None:
    """A store that remembers the number of a session another store deleted and created
    again writes into the new session, never into a number that is given twice."""
    path = tmp_path / "again.db"
    async with SqliteStore.open(path) as first, SqliteStore.open(path) as second:
        await first.create_session(_record())
        await _insert(first, "m1", "key-1")  # `first` remembers the session's number
        assert await second.delete_session("sess_1")
        await second.create_session(_record())
        outcome = await _insert(first, "m2", "key-1")
        assert outcome.inserted  # the key belonged to the deleted session's history
        assert [e.message_id for e in await second.read_timeline("sess_1")] == ["m2"]
        numbers = _raw(second).execute("SELECT number FROM sessions").fetchall()
        assert numbers == [(2,)]


@pytest.mark.anyio
async def test_migrations_run_once(tmp_path: Path) -> None:
    path = tmp_path / "once.db"
    stores: list[SqliteStore] = []

    async def open_one() -> None:
        stores.append(await SqliteStore.open(path))

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:  # two openers race on a new file
                tg.start_soon(open_one)
                tg.start_soon(open_one)
        await stores[0].create_session(_record())
        assert await stores[1].get_session("sess_1") == _record()
    finally:
        for store in stores:
            await store.aclose()
    async with SqliteStore.open(path) as again:
        rows = _raw(again).execute("SELECT COUNT(*) FROM schema_version").fetchone()
        assert rows == (LATEST_VERSION,)
        assert current_version(_raw(again)) == LATEST_VERSION


@pytest.mark.anyio
async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    assert await migrate_database(path) == (0, LATEST_VERSION)
    raw = sqlite3.connect(path)
    try:
        with raw:
            raw.execute(
                "INSERT INTO schema_version VALUES (?, 0, 'from the future')",
                (LATEST_VERSION + 1,),
            )
    finally:
        raw.close()
    with pytest.raises(StorageError, match="newer") as caught:
        await SqliteStore.open(path)
    assert not isinstance(caught.value, SchemaOutOfDate)


# -- cancellation -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_write_cancelled_mid_call_finishes_its_transaction(tmp_path: Path) -> None:
    path = tmp_path / "cancel.db"
    async with SqliteStore.open(path, inline=False) as store:
        await store.create_session(_record())
        pause = _PauseAtInsert()
        _raw(store).set_trace_callback(pause)
        scope = anyio.CancelScope()
        done = anyio.Event()
        outcomes: list[InsertOutcome] = []

        async def victim() -> None:
            with scope:
                outcomes.append(await _insert(store, "m1", "key-1"))
            done.set()

        try:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(victim)
                    await pause.reached.wait()  # the worker is inside the transaction
                    scope.cancel()
                    await anyio.wait_all_tasks_blocked()
                    # Not abandoned: the cancelled caller still waits for its transaction.
                    assert not done.is_set()
                    pause.release.set()
                    await done.wait()
        finally:
            pause.release.set()

        # The caller learnt that it committed (the cancellation came after the call returned:
        # a stored message its caller never heard of would get no turn)
        assert outcomes == [InsertOutcome("m1", True, b"digest")]
        # The transaction committed as a whole: the message and its key, together.
        assert await store.find_key("sess_1", "key-1") == KeyRecord("m1", b"digest")
        assert [e.message_id for e in await store.read_timeline("sess_1")] == ["m1"]
        # And the store is usable and consistent afterwards.
        assert await _insert(store, "m2", "key-1") == InsertOutcome("m1", False, b"digest")
        assert (await _insert(store, "m3", "key-3")).inserted
        assert not _raw(store).in_transaction
    async with SqliteStore.open(path) as reopened:
        assert await reopened.count_user_messages("sess_1") == 2


@pytest.mark.anyio
async def test_a_write_cancelled_before_its_turn_writes_nothing(tmp_path: Path) -> None:
    async with SqliteStore.open(tmp_path / "queued.db", inline=False) as store:
        await store.create_session(_record())
        pause = _PauseAtInsert()
        _raw(store).set_trace_callback(pause)
        queued_scope = anyio.CancelScope()

        async def first() -> None:
            await _insert(store, "m1", "key-1")

        async def queued() -> None:
            with queued_scope:
                await _insert(store, "m2", "key-2")

        try:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(first)
                    await pause.reached.wait()
                    tg.start_soon(queued)
                    await anyio.wait_all_tasks_blocked()  # `queued` waits for its turn
                    queued_scope.cancel()
                    pause.release.set()
        finally:
            pause.release.set()

        assert queued_scope.cancelled_caught
        assert await store.find_key("sess_1", "key-2") is None
        assert await store.find_key("sess_1", "key-1") == KeyRecord("m1", b"digest")
        assert await store.count_user_messages("sess_1") == 1


@pytest.mark.anyio
async def test_aclose_waits_for_the_call_in_flight(tmp_path: Path) -> None:
    path = tmp_path / "close.db"
    store = await SqliteStore.open(path, inline=False)
    await store.create_session(_record())
    pause = _PauseAtInsert()
    _raw(store).set_trace_callback(pause)
    outcomes: list[InsertOutcome] = []

    async def writer() -> None:
        outcomes.append(await _insert(store, "m1", "key-1"))

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer)
                await pause.reached.wait()
                tg.start_soon(store.aclose)
                await anyio.wait_all_tasks_blocked()
                pause.release.set()
    finally:
        pause.release.set()
    assert outcomes == [InsertOutcome("m1", True, b"digest")]
    with pytest.raises(StorageError, match="closed"):
        await store.get_session("sess_1")
    async with SqliteStore.open(path) as reopened:
        assert await reopened.find_key("sess_1", "key-1") == KeyRecord("m1", b"digest")


# -- find_key never scans -----------------------------------------------------------------------


def _bulk_insert(conn: sqlite3.Connection, session_id: str, count: int) -> None:
    rows = (
        (session_id, n, f"m{n}", _update(f"m{n}"), 1, f"key-{n}", None) for n in range(1, count + 1)
    )
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany(
        "INSERT INTO timeline (session, seq, message_id, payload, is_user_message,"
        " idempotency_key, prompt_digest)"
        " VALUES ((SELECT number FROM sessions WHERE session_id = ?), ?, ?, ?, ?, ?, ?)",
        rows,
    )
    conn.execute("COMMIT")


@pytest.mark.anyio
async def test_find_key_is_an_index_lookup(tmp_path: Path) -> None:
    async with SqliteStore.open(tmp_path / "big.db", inline=False) as store:
        await store.create_session(_record("big"))
        await store.create_session(_record("small"))
        conn = _raw(store)
        _bulk_insert(conn, "big", 20_000)
        _bulk_insert(conn, "small", 10)
        conn.execute("ANALYZE")

        plan = conn.execute(f"EXPLAIN QUERY PLAN {FIND_KEY_SQL}", ("big", "key-1")).fetchall()
        details = [row[-1] for row in plan]
        # one probe of the key index, and one of the sessions' id index for the number
        assert len(details) == 3, details
        assert details[0].startswith("SEARCH timeline USING INDEX timeline_user_keys"), details
        assert "idempotency_key=?" in details[0], details
        assert details[1] == "SCALAR SUBQUERY 1", details
        assert details[2].startswith("SEARCH sessions USING COVERING INDEX"), details

        # Count SQLite VM steps (not time): a lookup costs the same in both sessions, while
        # a statement that does scan the session's rows costs thousands of times more.
        steps = 0

        def count_step() -> int:
            nonlocal steps
            steps += 1
            return 0

        async def cost(call: Awaitable[object]) -> int:
            nonlocal steps
            steps = 0
            await call
            return steps

        conn.set_progress_handler(count_step, 1)
        try:
            big = await cost(store.find_key("big", "key-19999"))
            small = await cost(store.find_key("small", "key-7"))
            missing = await cost(store.find_key("big", "no-such-key"))
            scan = await cost(store.count_user_messages("big"))
        finally:
            conn.set_progress_handler(None, 1)
        assert await store.find_key("big", "key-19999") == KeyRecord("m19999", None)
        assert big <= small + 10, (big, small)
        assert missing <= small + 10, (missing, small)
        assert scan > 100 * big, (scan, big)


async def _insert_waits_until_released(
    store: SqliteStore, *, check: Callable[[], Awaitable[None]], release: Callable[[], object]
) -> None:
    """Start a keyed insert that must block (in the worker thread, not on the event loop);
    once it waits, run `check`, then `release` what blocks it; it must then write exactly
    once."""
    done = anyio.Event()

    async def write() -> None:
        await _insert(store, "m1", "key-1")
        done.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            await anyio.wait_all_tasks_blocked()
            assert not done.is_set()  # waiting, in the thread
            await check()
            release()
            await done.wait()
    assert await store.count_user_messages("sess_1") == 1
    assert await store.find_key("sess_1", "key-1") == KeyRecord("m1", b"digest")


@pytest.mark.anyio
async def test_inline_write_waits_in_the_thread_while_another_connection_writes(
    tmp_path: Path,
) -> None:
    """The inline fast path never waits on the event loop: when another connection holds the
    write lock, the call goes to the worker thread, which waits for the lock, and then
    writes exactly once."""
    path = tmp_path / "busy.db"
    async with SqliteStore.open(path) as store:
        await store.create_session(_record())
        other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            other.execute("BEGIN IMMEDIATE")  # another process is writing

            async def still_writing() -> None:
                assert await anyio.to_thread.run_sync(lambda: other.in_transaction)

            await _insert_waits_until_released(
                store, check=still_writing, release=lambda: other.execute("COMMIT")
            )
        finally:
            other.close()


@pytest.mark.anyio
async def test_inline_writes_are_checkpointed(tmp_path: Path) -> None:
    """Inline writes do not checkpoint themselves: every 250th call asks the checkpoint
    thread, and when a burst with no pause outruns it, the caller checkpoints itself, so the
    write-ahead log does not grow without bound (10,000 appends write ~45,000 pages; restarts
    (from 3,000 frames after a passive checkpoint, at once past the cap) and the lag limit
    keep it near the cap at most)."""
    path = tmp_path / "wal.db"
    async with SqliteStore.open(path) as store:
        await store.create_session(_record())
        wal = path.with_name(path.name + "-wal")
        largest = 0
        for i in range(10_000):
            await store.append_update("sess_1", b'{"n":%d}' % i)
            if i % 100 == 0:
                largest = max(largest, wal.stat().st_size // 4096)
        assert largest < _WAL_RESTART_CAP + 1500, f"the WAL grew to {largest} pages"
        assert await store.count_user_messages("sess_1") == 0
        (last,) = await store.read_timeline_tail("sess_1")
        assert last.seq == 10_000 and last.update == b'{"n":9999}'


def test_a_restart_is_due_past_the_threshold_once_the_interval_passed_or_past_the_cap() -> None:
    interval = _RESTART_INTERVAL_S
    assert not _restart_due(_WAL_RESTART_PAGES, since_last=10 * interval)
    assert _restart_due(_WAL_RESTART_PAGES + 1, since_last=interval)
    assert not _restart_due(_WAL_RESTART_PAGES + 1, since_last=interval / 2)
    assert not _restart_due(_WAL_RESTART_CAP, since_last=0.0)
    assert _restart_due(_WAL_RESTART_CAP + 1, since_last=0.0)
    assert _restart_due(_WAL_RESTART_PAGES + 1, since_last=float("inf"))  # the first one


def _two_checkpoints(checkpointer: Checkpointer) -> bool:
    """Wait (blocking) until the checkpoint thread has completed two checkpoints; False if
    10 s pass without one."""
    while checkpointer.checkpoints < 2:
        if not checkpointer.checkpointed.wait(10.0):
            return False
        checkpointer.checkpointed.clear()
    return True


@pytest.mark.anyio
async def test_checkpoints_run_in_their_own_thread_and_stop_with_the_store(tmp_path: Path) -> None:
    """The checkpoint thread checkpoints while inline calls go on (the log's frames reach the
    database file), and closing the store stops and joins it."""
    path = tmp_path / "ck.db"
    store = await SqliteStore.open(path)
    checkpointer = store._checkpointer  # pyright: ignore[reportPrivateUsage]
    assert checkpointer is not None
    thread = checkpointer._thread  # pyright: ignore[reportPrivateUsage]
    assert thread.is_alive()
    await store.create_session(_record())
    for i in range(300):  # one poke at the 250th inline call
        await store.append_update("sess_1", b'{"n":%d}' % i)

    # the poked checkpoint, then the one of the pause, which runs with no write in progress
    assert await anyio.to_thread.run_sync(_two_checkpoints, checkpointer)
    # what was checkpointed is in the main file: a copy of that file alone, with no log beside
    # it, holds every row. Only a checkpoint that copied the whole log leaves the file a
    # consistent database: one that stopped at a reader's snapshot skips each page whose
    # latest frame is past that snapshot. The copy is taken holding the checkpointer's lock,
    # so no checkpoint writes the file meanwhile.
    copy = tmp_path / "ck-main-file-only.db"

    def count_in_file() -> int:
        with checkpointer.lock:
            shutil.copyfile(path, copy)
        reader = sqlite3.connect(copy)
        try:
            (count,) = reader.execute("SELECT COUNT(*) FROM timeline").fetchone()
        finally:
            reader.close()
        return int(count)

    assert await anyio.to_thread.run_sync(count_in_file) == 300
    await store.aclose()
    assert not thread.is_alive()
    assert store._checkpointer is None  # pyright: ignore[reportPrivateUsage]


@pytest.mark.anyio
async def test_a_pause_in_the_writes_lets_the_log_rewind(tmp_path: Path) -> None:
    """After a poke, the checkpoint thread checkpoints once more when the writes pause; that
    passive checkpoint copies the whole log, so the next write starts it from the beginning
    (no restart, which would hold writers off)."""
    path = tmp_path / "idle.db"
    async with SqliteStore.open(path) as store:
        checkpointer = store._checkpointer  # pyright: ignore[reportPrivateUsage]
        assert checkpointer is not None
        await store.create_session(_record())
        for i in range(260):  # one poke at the 250th inline call, then ten more writes
            await store.append_update("sess_1", b'{"n":%d}' % i)
        # the poked checkpoint, then the one of the pause
        assert await anyio.to_thread.run_sync(_two_checkpoints, checkpointer)
        await store.append_update("sess_1", b'{"n":"after"}')
        probe = sqlite3.connect(path, isolation_level=None)
        try:
            # frames in the log: only the last write's, had it been rewound
            _, frames, _ = probe.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        finally:
            probe.close()
        assert 0 < frames < 10, frames
        (last,) = await store.read_timeline_tail("sess_1")
        assert last.seq == 261


@pytest.mark.anyio
async def test_calls_wait_in_the_thread_while_a_restart_holds_writers_off(
    tmp_path: Path,
) -> None:
    """While the checkpoint thread runs a RESTART checkpoint (`restarting` held), calls do not
    run inline: they wait for its end in the worker thread, then write exactly once."""
    path = tmp_path / "restart.db"
    async with SqliteStore.open(path) as store:
        checkpointer = store._checkpointer  # pyright: ignore[reportPrivateUsage]
        assert checkpointer is not None
        await store.create_session(_record())
        checkpointer.restarting.acquire()  # as the checkpoint thread does around a RESTART
        try:

            async def in_the_thread() -> None:
                assert store._thread_calls == 1  # pyright: ignore[reportPrivateUsage]

            await _insert_waits_until_released(
                store, check=in_the_thread, release=checkpointer.restarting.release
            )
        finally:
            if checkpointer.restarting.locked():
                checkpointer.restarting.release()


def test_openers_racing_on_a_new_file_both_get_wal(tmp_path: Path) -> None:
    """SQLite answers "database is locked" at once (no busy handler) to one of two
    connections switching a new file to WAL together; `enable_wal` waits instead. 200 races,
    each two threads released by one barrier (the bare pragma failed ~25% of them)."""
    failures: list[BaseException] = []

    def open_one(path: Path, barrier: threading.Barrier) -> None:
        barrier.wait(10)
        try:
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            try:
                enable_wal(conn, 5000)
                (mode,) = conn.execute("PRAGMA journal_mode").fetchone()
                assert mode == "wal"
            finally:
                conn.close()
        except BaseException as exc:  # collected: a thread's exception would be lost
            failures.append(exc)

    for i in range(200):
        barrier = threading.Barrier(2)
        threads = [
            threading.Thread(target=open_one, args=(tmp_path / f"{i}.db", barrier))
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert failures == []


@pytest.mark.anyio
async def test_updated_at_moves_in_steps_of_a_second_and_never_back(tmp_path: Path) -> None:
    # A write within BUMP_RESOLUTION of the last bump leaves the session row (and its two
    # indexes) unwritten; `session/list` shows whole seconds, so nothing visible is lost.
    now = [1_000.0]
    async with SqliteStore.open(tmp_path / "s.db", clock=lambda: now[0]) as store:
        await store.create_session(_record(updated_at=1_000.0))
        now[0] = 1_000.5
        await _insert(store, "m1", None)
        await store.append_updates("sess_1", [(b"{}", None)])
        record = await store.get_session("sess_1")
        assert record is not None and record.updated_at == 1_000.0  # within the second
        now[0] = 1_001.0
        await store.append_update("sess_1", b"{}")
        record = await store.get_session("sess_1")
        assert record is not None and record.updated_at == 1_001.0  # a second later: bumped
        now[0] = 900.0  # a clock that went back never moves it back
        await _insert(store, "m2", "k")
        record = await store.get_session("sess_1")
        assert record is not None and record.updated_at == 1_001.0
        # a write to a session that does not exist is still refused, bump or no bump
        with pytest.raises(SessionMissing):
            await store.append_update("nope", b"{}")
        assert [e.seq for e in await store.read_timeline("sess_1")] == [1, 2, 3, 4]
