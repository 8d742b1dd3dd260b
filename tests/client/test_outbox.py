"""The outbox: the contract on every backend, and what only the SQLite file promises.

SQLite-specific: pending submissions survive closing and reopening the file (a client
restart) and a SIGKILL right after `add`; two outbox objects share one file; the schema
version table; cancellation never abandons a transaction.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import signal
import sqlite3
import stat
import sys
import threading
from typing import TYPE_CHECKING

import anyio
import anyio.from_thread
import orjson
import pytest

from acp_once.client.outbox import (
    KeyConflict,
    MemoryOutbox,
    Outbox,
    OutboxError,
    Submission,
    open_outbox,
)
from acp_once.client.outbox.contract import CHECKS, Check, OutboxFactory, run_contract
from acp_once.client.outbox.sqlite import LATEST_VERSION, SqliteOutbox, current_version

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager
    from pathlib import Path


def _prompt(text: str) -> bytes:
    return orjson.dumps([{"type": "text", "text": text}])


@pytest.fixture(params=["memory", "sqlite"])
def outbox_factory(request: pytest.FixtureRequest, tmp_path: Path) -> OutboxFactory:
    """Opens an outbox on fresh, empty storage at each call (a new file for SQLite)."""
    if request.param == "memory":
        return MemoryOutbox
    counter = itertools.count()

    def open_sqlite() -> AbstractAsyncContextManager[Outbox]:
        return SqliteOutbox.open(tmp_path / f"outbox-{next(counter)}.db")

    return open_sqlite


# -- the contract -------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
async def test_contract(check: Check, outbox_factory: OutboxFactory) -> None:
    await check(outbox_factory)


@pytest.mark.anyio
async def test_run_contract_reports_no_failures(outbox_factory: OutboxFactory) -> None:
    assert await run_contract(outbox_factory) == []


class _LifoOutbox(MemoryOutbox):
    """Breaks the contract on purpose: it lists the newest submission first."""

    async def pending(self, session_id: str | None = None) -> list[Submission]:
        return list(reversed(await super().pending(session_id)))


@pytest.mark.anyio
async def test_run_contract_catches_a_broken_outbox() -> None:
    failures = await run_contract(_LifoOutbox)
    names = {name for name, _ in failures}
    assert "check_seq_orders_across_sessions" in names
    assert "check_add_then_read" not in names  # one submission has no order to get wrong
    assert all(isinstance(exc, AssertionError) for _, exc in failures)


def test_backends_satisfy_the_protocol() -> None:
    assert isinstance(MemoryOutbox(), Outbox)
    assert issubclass(SqliteOutbox, Outbox)


# -- open_outbox --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_open_outbox_memory_starts_empty_each_time() -> None:
    async with open_outbox("memory:") as outbox:
        assert isinstance(outbox, MemoryOutbox)
        await outbox.add("s", _prompt("x"))
    async with open_outbox("memory:") as outbox:
        assert await outbox.pending() == []
    with pytest.raises(OutboxError, match="closed"):
        await outbox.pending()


@pytest.mark.anyio
async def test_open_outbox_sqlite_keeps_pending_across_opens(tmp_path: Path) -> None:
    url = f"sqlite:{tmp_path / 'outbox.db'}"
    async with open_outbox(url) as outbox:
        assert isinstance(outbox, SqliteOutbox)
        added = await outbox.add("s", _prompt("x"))
    async with open_outbox(url) as outbox:
        assert await outbox.pending() == [added]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("outbox.db", "no scheme"),
        ("memory:extra", "nothing after the colon"),
        ("sqlite:", "needs a path"),
        ("postgresql://db", "unsupported outbox URL scheme 'postgresql'"),
    ],
)
async def test_open_outbox_refuses_bad_urls(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        async with open_outbox(url):
            pass


# -- SQLite: a client restart ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_pending_submissions_survive_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    async with SqliteOutbox.open(path) as outbox:
        a1 = await outbox.add("sess_a", _prompt("a1"), now=100.0)
        b1 = await outbox.add("sess_b", _prompt("b1"), idempotency_key="app-key", now=101.0)
        a2 = await outbox.add("sess_a", _prompt("a2"), now=102.0)
        done = await outbox.add("sess_b", _prompt("done"), now=103.0)
        await outbox.record_attempt(a1.submission_id)
        await outbox.record_attempt(a1.submission_id)
        await outbox.complete(done.submission_id)
        before = await outbox.pending()
    assert outbox._conn is None

    reopened = await SqliteOutbox.open(path)  # the explicit lifecycle, as after a restart
    try:
        after = await reopened.pending()
        assert after == before
        assert [s.submission_id for s in after] == [
            a1.submission_id,
            b1.submission_id,
            a2.submission_id,
        ]
        assert after[0].attempts == 2
        assert after[1].idempotency_key == "app-key"
        assert await reopened.pending("sess_a") == [after[0], after[2]]
        # The order goes on past everything ever added, the completed newest one included.
        later = await reopened.add("sess_a", _prompt("a3"))
        assert later.seq > done.seq
        # The key is still pending: a replayed add finds it, another prompt conflicts.
        replay = await reopened.add("sess_b", _prompt("b1"), idempotency_key="app-key")
        assert replay == after[1]
        with pytest.raises(KeyConflict):
            await reopened.add("sess_b", _prompt("other"), idempotency_key="app-key")
    finally:
        await reopened.aclose()


_KILLED_CLIENT = """
import os, signal, sys
import anyio
from acp_once.client.outbox.sqlite import SqliteOutbox

async def main() -> None:
    outbox = await SqliteOutbox.open(sys.argv[1])
    submission = await outbox.add("sess", b'[{"type":"text","text":"hi"}]', idempotency_key="k-1")
    print(submission.submission_id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no checkpoint: a crash

anyio.run(main)
"""


@pytest.mark.anyio
@pytest.mark.slow
async def test_an_added_submission_survives_sigkill(tmp_path: Path) -> None:
    """synchronous=NORMAL in WAL mode: a commit survives the death of the process."""
    path = tmp_path / "crash.db"
    with anyio.fail_after(60):
        result = await anyio.run_process(
            [sys.executable, "-c", _KILLED_CLIENT, str(path)], check=False
        )
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()
    submission_id = result.stdout.decode().strip()
    async with SqliteOutbox.open(path) as outbox:
        pending = await outbox.pending()
    assert [s.submission_id for s in pending] == [submission_id]
    assert pending[0].idempotency_key == "k-1"
    assert pending[0].prompt == b'[{"type":"text","text":"hi"}]'


@pytest.mark.anyio
async def test_add_has_committed_when_it_returns(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    async with SqliteOutbox.open(path) as outbox:
        added = await outbox.add("s", _prompt("x"), idempotency_key="k")
        raw = sqlite3.connect(path)  # another connection sees only committed rows
        try:
            rows = raw.execute(
                "SELECT submission_id, idempotency_key, prompt FROM outbox_submissions"
            ).fetchall()
        finally:
            raw.close()
        assert rows == [(added.submission_id, "k", added.prompt)]


# -- SQLite: two outbox objects on one file -------------------------------------------------------


@pytest.mark.anyio
async def test_two_outboxes_on_one_file_share_it(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    async with SqliteOutbox.open(path) as first, SqliteOutbox.open(path) as second:
        added = await first.add("s", _prompt("x"), idempotency_key="k")
        assert await second.get(added.submission_id) == added
        await second.record_attempt(added.submission_id)
        got = await first.get(added.submission_id)
        assert got is not None
        assert got.attempts == 1
        with pytest.raises(KeyConflict):
            await second.add("s", _prompt("y"), idempotency_key="k")
        assert await second.add("s", _prompt("x"), idempotency_key="k") == got
        await second.complete(added.submission_id)
        assert await first.pending() == []


@pytest.mark.anyio
async def test_two_outboxes_adding_at_once_keep_one_order(tmp_path: Path) -> None:
    path = tmp_path / "race.db"
    async with SqliteOutbox.open(path) as first, SqliteOutbox.open(path) as second:
        added: list[Submission] = []

        async def add(outbox: SqliteOutbox, n: int) -> None:
            added.append(await outbox.add(f"s{n % 3}", _prompt(f"p{n}")))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for n in range(20):
                    tg.start_soon(add, first, n)
                    tg.start_soon(add, second, 100 + n)
        seqs = [s.seq for s in added]
        assert len(set(seqs)) == 40
        assert await first.pending() == await second.pending()
        assert await first.pending() == sorted(added, key=lambda s: s.seq)


# -- SQLite: configuration and schema -------------------------------------------------------------


def _raw(outbox: SqliteOutbox) -> sqlite3.Connection:
    """The outbox's own connection, for white-box checks while it is idle."""
    conn = outbox._conn
    assert conn is not None
    return conn


@pytest.mark.anyio
async def test_connection_settings(tmp_path: Path) -> None:
    async with SqliteOutbox.open(tmp_path / "a.db") as outbox:
        conn = _raw(outbox)
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("PRAGMA synchronous").fetchone() == (1,)  # NORMAL
        assert conn.execute("PRAGMA busy_timeout").fetchone() == (5000,)
    async with SqliteOutbox.open(
        tmp_path / "b.db", synchronous="FULL", busy_timeout_ms=1234
    ) as outbox:
        conn = _raw(outbox)
        assert conn.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
        assert conn.execute("PRAGMA busy_timeout").fetchone() == (1234,)


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="synchronous"):
        SqliteOutbox.open(tmp_path / "a.db", synchronous="OFF")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="busy_timeout_ms"):
        SqliteOutbox.open(tmp_path / "a.db", busy_timeout_ms=-1)


@pytest.mark.anyio
async def test_an_unopenable_path_is_an_outbox_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").touch()  # a missing directory is created; one under a file cannot be
    with pytest.raises(OutboxError, match="cannot create the outbox"):
        await SqliteOutbox.open(tmp_path / "a-file" / "dir" / "a.db")
    with pytest.raises(OutboxError, match="cannot open the outbox"):
        await SqliteOutbox.open(tmp_path)  # a directory is no database


@pytest.mark.anyio
async def test_the_schema_version_table_records_each_migration_once(tmp_path: Path) -> None:
    path = tmp_path / "versions.db"
    outboxes: list[SqliteOutbox] = []

    async def open_one() -> None:
        outboxes.append(await SqliteOutbox.open(path))

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:  # two openers race on a new file
                tg.start_soon(open_one)
                tg.start_soon(open_one)
        added = await outboxes[0].add("s", _prompt("x"))
        assert await outboxes[1].pending() == [added]
    finally:
        for outbox in outboxes:
            await outbox.aclose()
    async with SqliteOutbox.open(path) as again:  # reopening applies nothing more
        conn = _raw(again)
        rows = conn.execute("SELECT version FROM outbox_schema_version ORDER BY version")
        assert [v for (v,) in rows] == list(range(1, LATEST_VERSION + 1))
        assert current_version(conn) == LATEST_VERSION


@pytest.mark.anyio
async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    async with SqliteOutbox.open(path):
        pass
    raw = sqlite3.connect(path)
    try:
        with raw:
            raw.execute(
                "INSERT INTO outbox_schema_version VALUES (?, 0, 'from the future')",
                (LATEST_VERSION + 1,),
            )
    finally:
        raw.close()
    with pytest.raises(OutboxError, match="newer"):
        await SqliteOutbox.open(path)


@pytest.mark.anyio
async def test_the_outbox_shares_a_file_with_other_tables(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    raw = sqlite3.connect(path)
    try:
        with raw:
            raw.execute("CREATE TABLE schema_version (version INTEGER)")
            raw.execute("INSERT INTO schema_version VALUES (7)")
    finally:
        raw.close()
    async with SqliteOutbox.open(path) as outbox:
        assert current_version(_raw(outbox)) == LATEST_VERSION
        await outbox.add("s", _prompt("x"))
        assert _raw(outbox).execute("SELECT version FROM schema_version").fetchall() == [(7,)]


@pytest.mark.anyio
async def test_the_unique_index_refuses_a_second_row_for_a_key(tmp_path: Path) -> None:
    path = tmp_path / "guard.db"
    async with SqliteOutbox.open(path) as outbox:
        await outbox.add("s", _prompt("x"), idempotency_key="k")
    raw = sqlite3.connect(path)
    try:
        insert = (
            "INSERT INTO outbox_submissions"
            " (submission_id, session_id, idempotency_key, prompt, created_at)"
            " VALUES ('other', 's', 'k', x'5b5d', 0)"
        )
        with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
            raw.execute(insert)
        raw.execute(insert.replace("'s'", "'t'"))  # the same key in another session is fine
    finally:
        raw.close()


# -- SQLite: cancellation -----------------------------------------------------------------------


class _PauseAtInsert:
    """A trace callback that stops the worker thread inside its write transaction.

    It fires once, when the INSERT of a submission starts (after BEGIN IMMEDIATE), sets
    `reached` and blocks that thread until `release` is set. It is never unregistered while
    the outbox may be mid-statement.
    """

    def __init__(self) -> None:
        self.reached = anyio.Event()
        self.release = threading.Event()
        self._fired = False

    def __call__(self, statement: str) -> None:
        if not self._fired and statement.startswith("INSERT INTO outbox_submissions"):
            self._fired = True
            anyio.from_thread.run_sync(self.reached.set)
            self.release.wait(timeout=30)


@pytest.mark.anyio
async def test_an_add_cancelled_mid_write_finishes_its_transaction(tmp_path: Path) -> None:
    path = tmp_path / "cancel.db"
    async with SqliteOutbox.open(path) as outbox:
        pause = _PauseAtInsert()
        _raw(outbox).set_trace_callback(pause)
        scope = anyio.CancelScope()
        done = anyio.Event()

        async def victim() -> None:
            with scope:
                await outbox.add("s", _prompt("x"), idempotency_key="k-1")
            done.set()

        try:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(victim)
                    await pause.reached.wait()  # the worker is inside the transaction
                    scope.cancel()
                    await anyio.wait_all_tasks_blocked()
                    assert not done.is_set()  # not abandoned: the caller waits for it
                    pause.release.set()
                    await done.wait()
        finally:
            pause.release.set()

        # The cancelled add committed as a whole (whether or not the cancellation reached its
        # caller); the recovery loop will find and send it.
        pending = await outbox.pending()
        assert [(s.session_id, s.idempotency_key, s.attempts) for s in pending] == [("s", "k-1", 0)]
        assert not _raw(outbox).in_transaction
        assert (await outbox.add("s", _prompt("y"))).seq > pending[0].seq
    async with SqliteOutbox.open(path) as reopened:
        assert len(await reopened.pending()) == 2


@pytest.mark.anyio
async def test_an_add_cancelled_before_its_turn_writes_nothing(tmp_path: Path) -> None:
    async with SqliteOutbox.open(tmp_path / "queued.db") as outbox:
        pause = _PauseAtInsert()
        _raw(outbox).set_trace_callback(pause)
        queued_scope = anyio.CancelScope()
        first: list[Submission] = []

        async def add_first() -> None:
            first.append(await outbox.add("s", _prompt("first")))

        async def queued() -> None:
            with queued_scope:
                await outbox.add("s", _prompt("queued"))

        try:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(add_first)
                    await pause.reached.wait()
                    tg.start_soon(queued)
                    await anyio.wait_all_tasks_blocked()  # `queued` waits for its turn
                    queued_scope.cancel()
                    pause.release.set()
        finally:
            pause.release.set()

        assert queued_scope.cancelled_caught
        assert await outbox.pending() == first


@pytest.mark.anyio
async def test_aclose_waits_for_the_call_in_flight(tmp_path: Path) -> None:
    path = tmp_path / "close.db"
    outbox = await SqliteOutbox.open(path)
    pause = _PauseAtInsert()
    _raw(outbox).set_trace_callback(pause)
    added: list[Submission] = []

    async def writer() -> None:
        added.append(await outbox.add("s", _prompt("x")))

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(writer)
                await pause.reached.wait()
                tg.start_soon(outbox.aclose)
                await anyio.wait_all_tasks_blocked()
                pause.release.set()
    finally:
        pause.release.set()
    assert len(added) == 1
    with pytest.raises(OutboxError, match="closed"):
        await outbox.pending()
    async with SqliteOutbox.open(path) as reopened:
        assert await reopened.pending() == added


@pytest.mark.anyio
async def test_a_new_outbox_file_is_private_and_tilde_is_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the outbox holds prompts: 0600 file in a new 0700 directory, whatever the umask allows
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    old = os.umask(0o022)
    try:
        async with open_outbox("sqlite:~/outbox-dir/o.db") as outbox:
            assert await outbox.pending() == []
        existing = tmp_path / "mine.db"
        existing.touch(mode=0o644)
        os.chmod(existing, 0o644)
        async with SqliteOutbox.open(existing):
            pass
    finally:
        os.umask(old)
    path = home / "outbox-dir" / "o.db"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for sidecar in (pathlib.Path(f"{path}-wal"), pathlib.Path(f"{path}-shm")):
        if sidecar.exists():
            assert stat.S_IMODE(sidecar.stat().st_mode) == 0o600
    assert not (work / "~").exists()
    assert stat.S_IMODE(existing.stat().st_mode) == 0o644  # an existing file keeps its mode
