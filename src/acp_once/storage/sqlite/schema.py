"""The SQLite store's schema: its numbered migrations, and opening a file at the right version.

`MIGRATIONS.steps[i]` takes a database from version `i` to version `i + 1` (append-only: a
released step is never edited); applied versions are rows of `schema_version`
(`acp_once.support.migrations`).
"""

from __future__ import annotations

import os
import sqlite3
from typing import TYPE_CHECKING, Final

import anyio.to_thread

from acp_once.storage.base import SchemaOutOfDate, StorageError
from acp_once.support import sqlite as db
from acp_once.support.migrations import Migration, Migrations

if TYPE_CHECKING:
    from acp_once.support.sqlite import Connection, Synchronous

__all__ = [
    "LATEST_VERSION",
    "MIGRATIONS",
    "apply_migrations",
    "connect",
    "current_version",
    "database_status",
    "migrate_database",
    "prepare_schema",
]

MIGRATIONS: Final = Migrations(
    (
        Migration(
            "sessions, their timeline, and idempotency keys as columns of the user-message row",
            (
                """
                CREATE TABLE sessions (
                    session_id             TEXT PRIMARY KEY NOT NULL,
                    cwd                    TEXT NOT NULL,
                    additional_directories BLOB NOT NULL,  -- JSON array of strings
                    title                  TEXT,
                    created_at             REAL NOT NULL,
                    updated_at             REAL NOT NULL,
                    forked_from            TEXT             -- no foreign key: the source may go
                )
                """,
                "CREATE INDEX sessions_by_recency ON sessions (updated_at DESC, session_id)",
                "CREATE INDEX sessions_by_cwd ON sessions (cwd, updated_at DESC, session_id)",
                """
                CREATE TABLE timeline (
                    session_id      TEXT NOT NULL
                                    REFERENCES sessions (session_id) ON DELETE CASCADE,
                    seq             INTEGER NOT NULL,
                    message_id      TEXT,
                    payload         BLOB NOT NULL,   -- the session/update `update` object (JSON)
                    is_user_message INTEGER NOT NULL DEFAULT 0 CHECK (is_user_message IN (0, 1)),
                    idempotency_key TEXT,            -- private: never read back into a record
                    prompt_digest   BLOB,
                    PRIMARY KEY (session_id, seq),
                    CHECK (idempotency_key IS NULL OR is_user_message = 1)
                )
                """,
                # The guard of "at most once": one row per (session, key), enforced by SQLite.
                """
                CREATE UNIQUE INDEX timeline_user_keys ON timeline (session_id, idempotency_key)
                WHERE idempotency_key IS NOT NULL
                """,
            ),
        ),
        Migration(
            "the tenant that created a session (NULL: created without one)",
            (
                "ALTER TABLE sessions ADD COLUMN tenant TEXT",
                # A tenant's `session/list` reads its own rows in page order, not everyone's.
                "CREATE INDEX sessions_by_tenant ON sessions (tenant, updated_at DESC, session_id)",
            ),
        ),
        Migration(
            "sessions numbered, and the timeline keyed by that number instead of the text id",
            (
                # Why: a session's timeline rows land in the middle of both timeline indexes,
                # and an entry with a 37-character text id fills a leaf about five times faster
                # than one with an integer, so SQLite rebalanced leaves there far more often (a
                # transaction of the group commit takes ~20% less time with the integer).
                # AUTOINCREMENT: a number is never given again, so a writer that remembers the
                # number of a deleted session can never write into another one.
                "ALTER TABLE timeline RENAME TO timeline_v2",
                "ALTER TABLE sessions RENAME TO sessions_v2",
                "DROP INDEX sessions_by_recency",
                "DROP INDEX sessions_by_cwd",
                "DROP INDEX sessions_by_tenant",
                "DROP INDEX timeline_user_keys",
                """
                CREATE TABLE sessions (
                    number                 INTEGER PRIMARY KEY AUTOINCREMENT,
                    session_id             TEXT NOT NULL UNIQUE,
                    cwd                    TEXT NOT NULL,
                    additional_directories BLOB NOT NULL,  -- JSON array of strings
                    title                  TEXT,
                    created_at             REAL NOT NULL,
                    updated_at             REAL NOT NULL,
                    forked_from            TEXT,            -- no foreign key: the source may go
                    tenant                 TEXT             -- NULL: created without one
                )
                """,
                """
                INSERT INTO sessions (session_id, cwd, additional_directories, title, created_at,
                                      updated_at, forked_from, tenant)
                SELECT session_id, cwd, additional_directories, title, created_at, updated_at,
                       forked_from, tenant
                FROM sessions_v2 ORDER BY created_at, session_id
                """,
                """
                CREATE TABLE timeline (
                    session         INTEGER NOT NULL
                                    REFERENCES sessions (number) ON DELETE CASCADE,
                    seq             INTEGER NOT NULL,
                    message_id      TEXT,
                    payload         BLOB NOT NULL,   -- the session/update `update` object (JSON)
                    is_user_message INTEGER NOT NULL DEFAULT 0 CHECK (is_user_message IN (0, 1)),
                    idempotency_key TEXT,            -- private: never read back into a record
                    prompt_digest   BLOB,
                    PRIMARY KEY (session, seq),
                    CHECK (idempotency_key IS NULL OR is_user_message = 1)
                )
                """,
                """
                INSERT INTO timeline (session, seq, message_id, payload, is_user_message,
                                      idempotency_key, prompt_digest)
                SELECT s.number, t.seq, t.message_id, t.payload, t.is_user_message,
                       t.idempotency_key, t.prompt_digest
                FROM timeline_v2 AS t JOIN sessions AS s ON s.session_id = t.session_id
                ORDER BY s.number, t.seq
                """,
                "DROP TABLE timeline_v2",
                "DROP TABLE sessions_v2",
                "CREATE INDEX sessions_by_recency ON sessions (updated_at DESC, session_id)",
                "CREATE INDEX sessions_by_cwd ON sessions (cwd, updated_at DESC, session_id)",
                "CREATE INDEX sessions_by_tenant ON sessions (tenant, updated_at DESC, session_id)",
                # The guard of "at most once": one row per (session, key), enforced by SQLite.
                """
                CREATE UNIQUE INDEX timeline_user_keys ON timeline (session, idempotency_key)
                WHERE idempotency_key IS NOT NULL
                """,
            ),
        ),
    ),
    version_table="schema_version",
)

LATEST_VERSION: Final = MIGRATIONS.latest
"""The schema version this code needs."""


def current_version(conn: sqlite3.Connection) -> int:
    """Return the highest applied version; 0 for a database without the version table."""
    return db.current_version(conn, MIGRATIONS)


def apply_migrations(conn: Connection, *, target: int = LATEST_VERSION) -> list[int]:
    """Apply the pending migrations up to `target`; see `acp_once.support.sqlite`.

    Raises:
        ValueError: `target` is out of range.
        sqlite3.Error: a statement failed (nothing is written).
    """
    return db.apply_migrations(conn, MIGRATIONS, target=target)


def connect(path: str, synchronous: Synchronous, busy_timeout_ms: int) -> Connection:
    """A connection to the store's file (`acp_once.support.sqlite.connect`), foreign keys on.

    Raises:
        sqlite3.Error: the file cannot be opened or set up.
    """
    conn = db.connect(path, synchronous, busy_timeout_ms)
    try:
        conn.execute("PRAGMA foreign_keys = ON")
    except BaseException:
        conn.close()
        raise
    return conn


def prepare_schema(conn: Connection, *, migrate: bool, where: str) -> None:
    """Bring the schema to the latest version (with `migrate`), or check that it is.

    Raises:
        SchemaOutOfDate: `migrate` is False and the schema is older than required.
        StorageError: the schema is newer than this code supports.
        sqlite3.Error: a migration failed.
    """
    found = current_version(conn)
    if found < LATEST_VERSION:
        if not migrate:
            raise SchemaOutOfDate(found=found, required=LATEST_VERSION, where=where)
        apply_migrations(conn)  # reads the version again under the write lock
        found = current_version(conn)
    if (message := MIGRATIONS.too_new(found, where)) is not None:
        raise StorageError(message)


async def migrate_database(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Bring the database at `path` to the latest schema; the `acp-once db migrate` backend.

    Returns (version before, version after). Creates the file if it does not exist.

    Raises:
        StorageError: the file cannot be opened or migrated.
    """
    where = os.fspath(path)

    def work() -> tuple[int, int]:
        try:
            conn = connect(db.prepare_file(where), "NORMAL", 5000)
            try:
                before = current_version(conn)
                apply_migrations(conn)
                return before, current_version(conn)
            finally:
                conn.close()
        except (sqlite3.Error, OSError) as exc:
            raise StorageError(f"{where}: {exc}") from exc

    return await anyio.to_thread.run_sync(work)


async def database_status(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Return (the schema version of the database at `path`, the latest version); the
    `acp-once db status` backend. A missing file is version 0 and is not created.

    Raises:
        StorageError: the file cannot be read.
    """
    where = os.fspath(path)

    def work() -> int:
        full = os.path.expanduser(where)  # `~` is the home directory, as when opening
        if not os.path.exists(full):
            return 0
        try:
            conn = connect(full, "NORMAL", 5000)
            try:
                return current_version(conn)
            finally:
                conn.close()
        except (sqlite3.Error, OSError) as exc:
            raise StorageError(f"{where}: {exc}") from exc

    return await anyio.to_thread.run_sync(work), LATEST_VERSION
