"""SQLite connections set up the one way the SQLite store and the SQLite outbox both want:
autocommit (transactions are ours), a busy timeout, WAL journal mode, a `synchronous` level;
`BEGIN IMMEDIATE` transactions; and the migration runner on such a connection.

Everything here blocks: call it in a worker thread (or, for a small call, where blocking
briefly is the point).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar, get_args

if TYPE_CHECKING:
    from collections.abc import Callable

    from acp_once.support.migrations import Migrations

__all__ = [
    "Connection",
    "Synchronous",
    "apply_migrations",
    "check_options",
    "connect",
    "current_version",
    "enable_wal",
    "prepare_file",
    "write",
]

Synchronous = Literal["NORMAL", "FULL", "EXTRA"]
"""Accepted values of SQLite's `synchronous` pragma (`OFF` is refused: it can corrupt)."""

_T = TypeVar("_T")


class Connection(sqlite3.Connection):
    """A connection with one cursor kept for the hot path (`cur`).

    `Connection.execute` makes a new cursor per statement; the store's small transactions run
    five statements each, and reusing one cursor saves ~7,000 instructions per transaction.
    Executing a statement on it resets the previous one, so no read stays open between
    calls. Used by one thread at a time, like the connection itself.
    """

    cur: sqlite3.Cursor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cur = self.cursor()


def check_options(synchronous: str, busy_timeout_ms: int) -> None:
    """Check the options of `connect` before anything is opened.

    Raises:
        ValueError: an unknown `synchronous` level or a negative busy timeout.
    """
    if synchronous not in get_args(Synchronous):
        raise ValueError(f"synchronous must be one of {get_args(Synchronous)}")
    if busy_timeout_ms < 0:
        raise ValueError("busy_timeout_ms must not be negative")


def prepare_file(path: str) -> str:
    """Expand `~` in `path` and create the database file if it is missing; return the path.

    The file holds users' prompts (the store's and the outbox's alike): it is created 0600
    (SQLite gives its `-wal` and `-shm` files the database file's mode), and a missing parent
    directory is created 0700. An
    existing file or directory keeps its mode (the user chose it). In-memory databases and
    `file:` URIs are returned unchanged. `~` is expanded here, not by a shell: `sqlite:~/x.db`
    would otherwise create a directory named `~` in the working directory.

    Raises:
        OSError: the directory or the file cannot be created.
    """
    if path == ":memory:" or path.startswith("file:"):
        return path
    path = os.path.expanduser(path)
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)  # makedirs applies the mode to each
    with contextlib.suppress(FileExistsError):  # an existing file keeps its mode
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    return path


def connect(path: str, synchronous: Synchronous, busy_timeout_ms: int) -> Connection:
    """Open `path` in autocommit mode (we issue BEGIN IMMEDIATE / COMMIT ourselves), usable
    from any one thread at a time, in WAL mode, with the busy timeout and `synchronous` level.

    Raises:
        sqlite3.Error: the file cannot be opened or set up (the connection is then closed).
    """
    conn = sqlite3.connect(
        path,
        isolation_level=None,
        check_same_thread=False,
        timeout=busy_timeout_ms / 1000,
        factory=Connection,
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {busy_timeout_ms:d}")
        enable_wal(conn, busy_timeout_ms)
        conn.execute(f"PRAGMA synchronous = {synchronous}")
    except BaseException:
        conn.close()
        raise
    return conn


def enable_wal(conn: sqlite3.Connection, busy_timeout_ms: int) -> None:
    """Put `conn`'s database in WAL journal mode (a no-op when it already is).

    SQLite does not consult the busy handler while it changes the journal mode: when two
    connections open a new file at the same moment (two processes, or a store and an outbox
    on one file), one of them gets SQLITE_BUSY, "database is locked", at once. We retry for
    up to `busy_timeout_ms`, as the busy handler would have waited.

    Raises:
        sqlite3.OperationalError: still busy after `busy_timeout_ms`, or another failure.
    """
    deadline = time.monotonic() + busy_timeout_ms / 1000
    delay = 0.001
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")  # answers 'memory' for ':memory:'; fine
            return
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                raise
        time.sleep(delay)  # a retry back-off in a worker thread, not synchronisation
        delay = min(delay * 2, 0.05)


def write(conn: Connection, work: Callable[..., _T], *args: Any) -> _T:
    """Run `work(conn, *args)` in one `BEGIN IMMEDIATE` transaction: all of it commits, or
    none of it.

    The write lock is taken up front, so what `work` reads cannot change before it writes,
    even from another process. `work` may end the transaction itself with a ROLLBACK (a
    keyed retry that must leave nothing written); then there is nothing to commit. Errors of
    `work` propagate after the rollback.
    """
    cur = conn.cur
    cur.execute("BEGIN IMMEDIATE")
    try:
        result = work(conn, *args)
        if conn.in_transaction:
            cur.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            cur.execute("ROLLBACK")
        raise
    return result


def current_version(conn: sqlite3.Connection, migrations: Migrations) -> int:
    """Return the highest applied version; 0 for a database without the version table."""
    exists = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
        (migrations.version_table,),
    ).fetchone()
    if exists is None:
        return 0
    table = migrations.version_table
    row = conn.execute(f"SELECT COALESCE(MAX(version), 0) FROM {table}").fetchone()
    return int(row[0])


_CREATE_VERSION_TABLE: Final = """
    CREATE TABLE IF NOT EXISTS {table} (
        version     INTEGER PRIMARY KEY NOT NULL,
        applied_at  REAL NOT NULL,
        description TEXT NOT NULL
    )
"""


def apply_migrations(
    conn: Connection, migrations: Migrations, *, target: int | None = None
) -> list[int]:
    """Apply the pending migrations up to `target` (the latest by default) in one
    `BEGIN IMMEDIATE` transaction; return the versions applied (empty when current).

    Safe when several processes migrate one file at once: the version is read again under
    the write lock, so each migration runs once. Each step is single statements, not a
    script: `executescript` would commit the surrounding transaction.

    Raises:
        ValueError: `target` is out of range (nothing is written).
        sqlite3.Error: a statement failed (nothing is written).
    """
    migrations.pending(0, target)  # checks `target` before the write lock is taken

    def work(conn: Connection) -> list[int]:
        table = migrations.version_table
        conn.execute(_CREATE_VERSION_TABLE.format(table=table))
        applied: list[int] = []
        for version, migration in migrations.pending(current_version(conn, migrations), target):
            for statement in migration.statements:
                conn.execute(statement)
            conn.execute(
                f"INSERT INTO {table} (version, applied_at, description) VALUES (?, ?, ?)",
                (version, time.time(), migration.description),
            )
            applied.append(version)
        return applied

    return write(conn, work)
