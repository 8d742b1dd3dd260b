"""Switching a SQLite database to WAL journal mode safely when several openers race."""

from __future__ import annotations

import sqlite3
import time

__all__ = ["enable_wal"]


def enable_wal(conn: sqlite3.Connection, busy_timeout_ms: int) -> None:
    """Put `conn`'s database in WAL journal mode (a no-op when it already is).

    SQLite does not consult the busy handler while it changes the journal mode: when two
    connections open a new file at the same moment (two processes, or a store and an outbox
    on one file), one of them gets SQLITE_BUSY, "database is locked", at once. We retry for
    up to `busy_timeout_ms`, as the busy handler would have waited. Blocking: call it in a
    worker thread.

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
