"""Numbered, append-only schema migrations of the SQLite store.

`MIGRATIONS[i]` takes a database from version `i` to version `i + 1`. A migration, once
released, is never edited: a schema change is a new entry at the end. Applied versions are
recorded in the `schema_version` table (one row per version), so a database says which
migrations it has had. Each migration is a tuple of single statements (not a script) because
`sqlite3.Connection.executescript` would commit the surrounding transaction.

All functions here are synchronous and take an open `sqlite3.Connection` in autocommit mode
(`isolation_level=None`); the store calls them from its worker thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import sqlite3

__all__ = ["LATEST_VERSION", "MIGRATIONS", "Migration", "apply_migrations", "current_version"]


@dataclass(frozen=True, slots=True)
class Migration:
    description: str
    statements: tuple[str, ...]


MIGRATIONS: Final[tuple[Migration, ...]] = (
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
)

LATEST_VERSION: Final = len(MIGRATIONS)
"""The schema version this code needs."""

_CREATE_VERSION_TABLE: Final = """
    CREATE TABLE IF NOT EXISTS schema_version (
        version    INTEGER PRIMARY KEY NOT NULL,
        applied_at REAL NOT NULL,
        description TEXT NOT NULL
    )
"""


def current_version(conn: sqlite3.Connection) -> int:
    """Return the highest applied version; 0 for a database without the version table."""
    exists = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    ).fetchone()
    if exists is None:
        return 0
    row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()
    return int(row[0])


def apply_migrations(conn: sqlite3.Connection, *, target: int = LATEST_VERSION) -> list[int]:
    """Apply the pending migrations up to `target` in one `BEGIN IMMEDIATE` transaction.

    Safe when several processes migrate the same file at once: the version is read again
    under the write lock, so each migration runs once. Returns the versions applied (empty
    when the database was current).
    """
    if not 0 <= target <= LATEST_VERSION:
        raise ValueError(f"target must be between 0 and {LATEST_VERSION}, got {target}")
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(_CREATE_VERSION_TABLE)
        found = current_version(conn)
        applied: list[int] = []
        for version in range(found + 1, target + 1):
            migration = MIGRATIONS[version - 1]
            for statement in migration.statements:
                conn.execute(statement)
            conn.execute(
                "INSERT INTO schema_version (version, applied_at, description) VALUES (?, ?, ?)",
                (version, time.time(), migration.description),
            )
            applied.append(version)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return applied
