"""The PostgreSQL store's schema: its numbered migrations (`acp_once.support.migrations`),
their runner, and the `acp-once db migrate` / `db status` backends.

Every table is in the store's schema: `{s}` in a statement is that schema (quoted).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
import psycopg
from psycopg import sql

from acp_once.storage.base import SchemaOutOfDate, StorageError
from acp_once.storage.postgres.connection import (
    Conn,
    compose,
    connect,
    execute,
    fetch_one,
    storage_error,
    transact,
)
from acp_once.storage.postgres.urls import DEFAULT_SCHEMA, check_schema, describe_postgres
from acp_once.support.migrations import Migration, Migrations

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = [
    "LATEST_VERSION",
    "MIGRATIONS",
    "apply_migrations",
    "current_version",
    "migrate_postgres",
    "postgres_status",
    "prepare_schema",
]

_T = TypeVar("_T")

_LOCK_CLASS: Final = 0x6163706F  # "acpo": first half of the advisory lock of migrations

MIGRATIONS: Final = Migrations(
    (
        Migration(
            "sessions, their timeline, and idempotency keys as columns of the user-message row",
            (
                # COLLATE "C": ids order by code point, like the other backends (and Python).
                """
                CREATE TABLE {s}.sessions (
                    session_id             text COLLATE "C" PRIMARY KEY,
                    cwd                    text COLLATE "C" NOT NULL,
                    additional_directories text[] NOT NULL,
                    title                  text,
                    created_at             double precision NOT NULL,
                    updated_at             double precision NOT NULL,
                    forked_from            text,  -- no foreign key: the source may go
                    next_seq               bigint NOT NULL DEFAULT 1 CHECK (next_seq >= 1)
                )
                """,
                "CREATE INDEX sessions_by_recency ON {s}.sessions (updated_at DESC, session_id)",
                "CREATE INDEX sessions_by_cwd ON {s}.sessions (cwd, updated_at DESC, session_id)",
                """
                CREATE TABLE {s}.timeline (
                    session_id      text COLLATE "C" NOT NULL
                                    REFERENCES {s}.sessions (session_id) ON DELETE CASCADE,
                    seq             bigint NOT NULL,
                    message_id      text,
                    payload         bytea NOT NULL,  -- the session/update `update` object (JSON)
                    is_user_message boolean NOT NULL DEFAULT false,
                    idempotency_key bytea,           -- private: never read back into a record
                    prompt_digest   bytea,
                    PRIMARY KEY (session_id, seq),
                    CHECK (idempotency_key IS NULL OR is_user_message)
                )
                """,
                # The guard of "at most once": one row per (session, key), enforced by PostgreSQL.
                """
                CREATE UNIQUE INDEX timeline_user_keys ON {s}.timeline (session_id, idempotency_key)
                WHERE idempotency_key IS NOT NULL
                """,
            ),
        ),
        Migration(
            "several nodes: session leases with fencing, the cluster's prompt queue,"
            " node heartbeats and large session events (see acp_once.cluster.sql)",
            (
                # One row per node process (`instance`); `seen_at` is its heartbeat, `stats` what
                # `/ops/status` shows. Times are the database's clock: nodes' clocks may disagree.
                """
                CREATE TABLE {s}.cluster_nodes (
                    instance   text COLLATE "C" PRIMARY KEY,
                    node_id    text NOT NULL,
                    started_at timestamptz NOT NULL DEFAULT now(),
                    seen_at    timestamptz NOT NULL DEFAULT now(),
                    stats      jsonb NOT NULL DEFAULT '{{}}'
                )
                """,
                # The lease of a session's foreground work. The row is kept when released (owner
                # NULL) so that `epoch`, the fencing token, only ever grows.
                """
                CREATE TABLE {s}.session_leases (
                    session_id text COLLATE "C" PRIMARY KEY,
                    owner      text COLLATE "C",
                    node_id    text,
                    epoch      bigint NOT NULL DEFAULT 0,
                    expires_at timestamptz NOT NULL DEFAULT '-infinity'
                )
                """,
                "CREATE INDEX session_leases_by_owner ON {s}.session_leases (owner)",
                # Prompts accepted and not inserted yet (held), in arrival order (`id`), whichever
                # node received them; the lease owner inserts them. The key is private: it is never
                # in a NOTIFY payload, a log line or an error.
                """
                CREATE TABLE {s}.prompt_queue (
                    id              bigserial PRIMARY KEY,
                    session_id      text COLLATE "C" NOT NULL,
                    idempotency_key bytea,
                    prompt_digest   bytea NOT NULL,
                    content         bytea NOT NULL,  -- the prompt's content blocks (JSON)
                    origin          text COLLATE "C" NOT NULL,  -- the instance that received it
                    waiters         integer NOT NULL DEFAULT 1,  -- nodes with a request waiting
                    state           text NOT NULL DEFAULT 'queued' CHECK (state IN
                                    ('queued', 'inserted', 'recorded', 'withdrawn', 'dropped',
                                     'abandoned', 'failed')),
                    message_id      text,
                    same_prompt     boolean,
                    created_at      timestamptz NOT NULL DEFAULT now()
                )
                """,
                """
                CREATE INDEX prompt_queue_open ON {s}.prompt_queue (session_id, id)
                WHERE state = 'queued'
                """,
                # One queued prompt per (session, key): a second request with the key waits on it.
                """
                CREATE UNIQUE INDEX prompt_queue_keys
                ON {s}.prompt_queue (session_id, idempotency_key)
                WHERE state = 'queued' AND idempotency_key IS NOT NULL
                """,
                # Session updates too large for a NOTIFY payload travel through this table.
                """
                CREATE TABLE {s}.session_events (
                    id         bigserial PRIMARY KEY,
                    session_id text NOT NULL,
                    payload    bytea NOT NULL,
                    created_at timestamptz NOT NULL DEFAULT now()
                )
                """,
            ),
        ),
        Migration(
            "the tenant that created a session (NULL: created without one)",
            (
                'ALTER TABLE {s}.sessions ADD COLUMN tenant text COLLATE "C"',
                # A tenant's `session/list` reads its own rows in page order, not everyone's.
                "CREATE INDEX sessions_by_tenant"
                " ON {s}.sessions (tenant, updated_at DESC, session_id)",
            ),
        ),
        Migration(
            "the shard set a database belongs to (see acp_once.storage.postgres.shards)",
            (
                # One row: this database's own id, and the ids of its set's shards in order
                # (NULL while it is no shard). A session's shard is a hash of its id modulo
                # the set's size, so the set is fixed once recorded.
                """
                CREATE TABLE {s}.shard_set (
                    only_row    boolean PRIMARY KEY DEFAULT true CHECK (only_row),
                    shard_id    text NOT NULL,
                    members     text[],
                    recorded_at timestamptz NOT NULL DEFAULT now()
                )
                """,
            ),
        ),
        Migration(
            "the timeline's foreign key to its session dropped (a session's delete removes its"
            " timeline itself)",
            (
                # Every write to the timeline locks its session's row in the same statement
                # or transaction (and writes nothing when there is none), so the key only
                # checked what was already true, once per row: ~15% of PostgreSQL's CPU a
                # prompt. `delete_session` deletes the session's rows after its own.
                "ALTER TABLE {s}.timeline DROP CONSTRAINT IF EXISTS timeline_session_id_fkey",
            ),
        ),
    ),
    version_table="schema_version",
)

LATEST_VERSION: Final = MIGRATIONS.latest
"""The schema version this code needs."""

_VERSION_TABLE_EXISTS: Final = sql.SQL(
    "SELECT 1 FROM pg_catalog.pg_tables WHERE schemaname = %s AND tablename = %s"
)


async def current_version(conn: Conn, schema: str) -> int:
    """Return the highest applied version; 0 when the schema or its version table is missing."""
    table = MIGRATIONS.version_table
    if await fetch_one(conn, _VERSION_TABLE_EXISTS, (schema, table)) is None:
        return 0
    query = sql.SQL("SELECT COALESCE(MAX(version), 0) FROM {}").format(
        sql.Identifier(schema, table)
    )
    row = await fetch_one(conn, query)
    assert row is not None
    return int(row[0])


async def apply_migrations(conn: Conn, schema: str, *, target: int = LATEST_VERSION) -> list[int]:
    """Apply the pending migrations up to `target` in one transaction; return those applied.

    Safe when several processes migrate one schema at once: a transaction-level advisory lock
    per schema serialises them and the version is read again under it, so each migration runs
    once. The schema is created if missing.

    Raises:
        ValueError: `target` is out of range (nothing is written).
        psycopg.Error: a statement failed (nothing is written).
    """
    MIGRATIONS.pending(0, target)  # checks `target` before anything is sent
    table = sql.Identifier(schema, MIGRATIONS.version_table)

    async def work(conn: Conn) -> list[int]:
        await execute(
            conn, sql.SQL("SELECT pg_advisory_xact_lock(%s, hashtext(%s))"), (_LOCK_CLASS, schema)
        )
        await execute(conn, compose("CREATE SCHEMA IF NOT EXISTS {s}", schema))
        await execute(
            conn,
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} ("
                " version integer PRIMARY KEY,"
                " applied_at timestamptz NOT NULL DEFAULT now(),"
                " description text NOT NULL)"
            ).format(table),
        )
        record = sql.SQL("INSERT INTO {} (version, description) VALUES (%s, %s)").format(table)
        applied: list[int] = []
        for version, migration in MIGRATIONS.pending(await current_version(conn, schema), target):
            for statement in migration.statements:
                await execute(conn, compose(statement, schema))
            await execute(conn, record, (version, migration.description))
            applied.append(version)
        return applied

    return await transact(conn, work, begin=True)


async def _read_version(conn: Conn, schema: str) -> int:
    return await transact(conn, functools.partial(current_version, schema=schema), begin=False)


_SHARD_OF: Final = (
    "SELECT array_position(members, shard_id), cardinality(members) FROM {s}.shard_set"
)


async def prepare_schema(
    conn: Conn, schema: str, *, migrate: bool, where: str, alone: bool = True
) -> None:
    """Bring the schema to the latest version (with `migrate`), or check that it is; with
    `alone` (a store of its own, not a shard), check that it is no shard of a larger set.

    Raises:
        SchemaOutOfDate: `migrate` is False and the schema is older than required.
        StorageError: the schema is newer than this code supports, or it is one shard of
            several (opened alone, it would miss the sessions of the others).
        psycopg.Error: PostgreSQL refused.
    """
    found = await _read_version(conn, schema)
    if found < LATEST_VERSION:
        if not migrate:
            raise SchemaOutOfDate(found=found, required=LATEST_VERSION, where=where)
        await apply_migrations(conn, schema)
        found = await _read_version(conn, schema)
    if (message := MIGRATIONS.too_new(found, where)) is not None:
        raise StorageError(message)
    if alone:
        row = await transact(
            conn,
            functools.partial(_fetch_shard, query=compose(_SHARD_OF, schema)),
            begin=False,
        )
        if row is not None and row[1] is not None and row[1] > 1:
            raise StorageError(
                f"{where}: this database is shard {row[0]} of {row[1]} of a sharded store;"
                f" give all {row[1]} of them, in their order (--store repeated)"
            )


async def _fetch_shard(conn: Conn, query: sql.Composed) -> tuple[Any, ...] | None:
    return await fetch_one(conn, query)


async def _on_one_connection(dsn: str, schema: str, work: Callable[[Conn], Awaitable[_T]]) -> _T:
    """Run `work` on a connection of its own, closed after it; psycopg errors come out as
    `StorageError`s (see `storage_error`)."""
    check_schema(schema)
    where = describe_postgres(dsn, schema)
    conn = await connect(dsn, where, 30.0)
    try:
        result = await work(conn)
    except psycopg.Error as exc:
        error = storage_error(exc, where)
    else:
        return result
    finally:
        with anyio.CancelScope(shield=True):
            await conn.close()
    raise error


async def migrate_postgres(dsn: str, schema: str = DEFAULT_SCHEMA) -> tuple[int, int]:
    """Bring the schema to the latest version; the `acp-once db migrate` backend.

    Returns (version before, version after). Creates the schema if it does not exist.

    Raises:
        StorageError: the database cannot be reached or refuses the change.
    """

    async def work(conn: Conn) -> tuple[int, int]:
        before = await _read_version(conn, schema)
        await apply_migrations(conn, schema)
        return before, await _read_version(conn, schema)

    return await _on_one_connection(dsn, schema, work)


async def postgres_status(dsn: str, schema: str = DEFAULT_SCHEMA) -> tuple[int, int]:
    """Return (the schema's version, the latest version); the `acp-once db status` backend.

    A missing schema is version 0 and is not created.

    Raises:
        StorageError: the database cannot be reached.
    """
    found = await _on_one_connection(dsn, schema, functools.partial(_read_version, schema=schema))
    return found, LATEST_VERSION
