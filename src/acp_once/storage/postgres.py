"""The PostgreSQL store: psycopg 3 async on a connection pool, for several agent nodes.

Layout (see `MIGRATIONS`), every table in one schema (`acp_once` by default, any name with
`schema=`), so several stores or test runs share a database without meeting:

* `sessions`: one row per session, with `next_seq`, the counter of its timeline;
* `timeline`: the retained `session/update` objects of each session in `seq` order. **The
  idempotency key is a nullable column of the user-message row itself** (`bytea`: the key's
  UTF-8 bytes, so keys compare byte for byte whatever the collation), guarded by the partial
  unique index `timeline_user_keys (session_id, idempotency_key) WHERE idempotency_key IS NOT
  NULL`, exactly as in the SQLite store: the key and its message are one row written by one
  INSERT, so neither can exist without the other; the key is forgotten with its row; a fork
  copies rows with `idempotency_key = NULL`; `find_key` is one probe of that index.

Concurrency (READ COMMITTED, which every write transaction asks for explicitly):

* `insert_user_message` locks the session row (`SELECT ... FOR NO KEY UPDATE`), looks the key
  up *after* the lock (a new statement sees every transaction that held the lock before), then
  inserts the row at `next_seq` and bumps `next_seq` and `updated_at` in one statement. Writers
  of one session are serialised by that lock, across connections, pools and processes, so
  `seq` is strictly increasing and two inserts of one new key insert once. The INSERT also says
  `ON CONFLICT (session_id, idempotency_key) ... DO NOTHING`: a writer that bypasses the lock
  still cannot record a key twice, and we then answer the recorded message.
* A fenced insert (several nodes, `fence=`) is one statement instead: under the session's
  lease only its owner inserts, one at a time, so the statement's snapshot already holds every
  key recorded before it (see `insert_fenced`); the unique index still refuses a duplicate.
* `append_update` is one statement (`UPDATE sessions ... RETURNING` feeding the INSERT), atomic
  on its own and serialised by the same row lock.

Cancellation (the encode/databases #460 lesson): a connection goes back to the pool only when
it is idle. When a call ends any other way (an error, or a cancellation at any await,
including in the middle of a statement) the store rolls the transaction back, shielded from
the cancellation and bounded in time, and closes the connection if it cannot be brought back
to idle; the pool then replaces it. The COMMIT itself is shielded, so a cancellation delivered
during it never leaves the caller unsure of the outcome for a reason of ours: once COMMIT is
sent, the call completes. `insert_user_message` is shielded as a whole (bounded): its fenced
form is one statement that commits on its own, which a cancellation cannot reliably stop, and
its caller must learn whether the message was stored (see `_insert_shielded`).

Keys are private (R29): PostgreSQL error messages can quote the values of a unique index
(`DETAIL: Key (session_id, idempotency_key)=(...)`). Every psycopg error is turned into a
`StorageError` built from the SQLSTATE and the primary message only, and raised *without* the
original exception attached (no `__cause__`, no `__context__`), so no traceback prints it.

Lifecycle (the LangGraph lessons #2570, #5327, #6741, #7304): `PostgresStore.open(dsn)` opens
and owns a pool (closed by `aclose`); `PostgresStore.open(pool)` uses the caller's
`AsyncConnectionPool` and leaves it open. Connections may be in autocommit mode or not; the
store opens its own transaction blocks either way. Migrations are explicit and numbered
(`MIGRATIONS`, a `schema_version` table); `open` applies them unless `migrate=False`, which
raises `SchemaOutOfDate` naming `acp-once db migrate` instead.
"""

from __future__ import annotations

import contextlib
import functools
import time
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Self, TypeVar

import anyio
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool

from acp_once.storage.base import (
    UNCHANGED,
    FencingError,
    InsertOutcome,
    KeyRecord,
    Opening,
    SchemaOutOfDate,
    SessionExists,
    SessionMissing,
    SessionRecord,
    StorageError,
    TimelineEntry,
    Unchanged,
    check_limit,
    decode_cursor,
    encode_cursor,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence
    from types import TracebackType

__all__ = [
    "DEFAULT_SCHEMA",
    "LATEST_VERSION",
    "Fence",
    "FencingError",
    "MIGRATIONS",
    "Migration",
    "PostgresStore",
    "QueueRowGone",
    "apply_migrations",
    "current_version",
    "describe_postgres",
    "migrate_postgres",
    "parse_postgres_url",
    "postgres_status",
]

DEFAULT_SCHEMA: Final = "acp_once"

_T = TypeVar("_T")
_Conn = psycopg.AsyncConnection[Any]
_Pool = AsyncConnectionPool[Any]
_Query = sql.SQL | sql.Composed

_CLEANUP_TIMEOUT: Final = 5.0
"""Seconds a rollback after a failed or cancelled call may take before we close instead."""

_INSERT_TIMEOUT: Final = 60.0
"""Seconds a user message insert, shielded from cancellation, may take (`_insert_shielded`)."""

_LOCK_CLASS: Final = 0x6163706F  # "acpo": first half of the advisory lock of migrations


@dataclass(frozen=True, slots=True)
class Fence:
    """A fencing token: a write is accepted only while `owner` holds the session's lease at
    `epoch` (the `session_leases` table; see `acp_once.storage.pg_cluster`)."""

    owner: str
    epoch: int
    row: int | None = None
    """A queued prompt (`prompt_queue.id`) the write inserts: it must still be queued, and it
    stays locked until the write commits, so a withdrawal that comes meanwhile waits and then
    finds it inserted (insertion wins, R27)."""
    channel: str | None = None
    """With `row`: the insert also marks the row `inserted` (or `recorded`,
    when the key was) with the message id, and announces that on this NOTIFY channel as
    `{"k": "o", "r": row, "st": state, "m": message_id, "p": same_prompt}`."""
    legacy_digest: bytes | None = None
    """With `row`: the prompt's digest as earlier versions computed it (SHA-256), so that a key
    one of them recorded for the same prompt is settled as the same prompt (`same_prompt` in
    `acp_once.agent.runtime`)."""


class QueueRowGone(FencingError):
    """The queued prompt of a fenced insert (`Fence.row`) was withdrawn (or dropped) before
    the owner could insert it: a normal outcome of a race, nothing was written."""

    def __init__(self, session_id: str, row: int) -> None:
        StorageError.__init__(self, f"queued prompt {row} was withdrawn before insertion")
        self.session_id = session_id
        self.row = row


# -- migrations ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema change. `{s}` in a statement is the store's schema (quoted)."""

    description: str
    statements: tuple[str, ...]


MIGRATIONS: Final[tuple[Migration, ...]] = (
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
        "several nodes: session leases with fencing, the cluster's prompt queue, node heartbeats"
        " and large session events (see acp_once.storage.pg_cluster)",
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
            CREATE UNIQUE INDEX prompt_queue_keys ON {s}.prompt_queue (session_id, idempotency_key)
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
)

LATEST_VERSION: Final = len(MIGRATIONS)
"""The schema version this code needs."""

_VERSION_TABLE_EXISTS: Final = sql.SQL(
    "SELECT 1 FROM pg_catalog.pg_tables WHERE schemaname = %s AND tablename = 'schema_version'"
)


def _q(template: str, schema: str) -> sql.Composed:
    return sql.SQL(template).format(s=sql.Identifier(schema))


async def current_version(conn: _Conn, schema: str) -> int:
    """Return the highest applied version; 0 when the schema or its version table is missing."""
    if await _one(conn, _VERSION_TABLE_EXISTS, (schema,)) is None:
        return 0
    row = await _one(conn, _q("SELECT COALESCE(MAX(version), 0) FROM {s}.schema_version", schema))
    assert row is not None
    return int(row[0])


async def apply_migrations(conn: _Conn, schema: str, *, target: int = LATEST_VERSION) -> list[int]:
    """Apply the pending migrations up to `target` in one transaction; return those applied.

    Safe when several processes migrate one schema at once: a transaction-level advisory lock
    per schema serialises them and the version is read again under it, so each migration runs
    once. The schema is created if missing.
    """
    if not 0 <= target <= LATEST_VERSION:
        raise ValueError(f"target must be between 0 and {LATEST_VERSION}, got {target}")

    async def work(conn: _Conn) -> list[int]:
        await _exec(
            conn, sql.SQL("SELECT pg_advisory_xact_lock(%s, hashtext(%s))"), (_LOCK_CLASS, schema)
        )
        await _exec(conn, _q("CREATE SCHEMA IF NOT EXISTS {s}", schema))
        await _exec(
            conn,
            _q(
                "CREATE TABLE IF NOT EXISTS {s}.schema_version ("
                " version integer PRIMARY KEY,"
                " applied_at timestamptz NOT NULL DEFAULT now(),"
                " description text NOT NULL)",
                schema,
            ),
        )
        found = await current_version(conn, schema)
        applied: list[int] = []
        for version in range(found + 1, target + 1):
            migration = MIGRATIONS[version - 1]
            for statement in migration.statements:
                await _exec(conn, _q(statement, schema))
            await _exec(
                conn,
                _q("INSERT INTO {s}.schema_version (version, description) VALUES (%s, %s)", schema),
                (version, migration.description),
            )
            applied.append(version)
        return applied

    return await _transact(conn, work, begin=True)


async def _prepare_schema(conn: _Conn, schema: str, *, migrate: bool, where: str) -> None:
    found = await _transact(conn, functools.partial(current_version, schema=schema), begin=False)
    if found < LATEST_VERSION:
        if not migrate:
            raise SchemaOutOfDate(found=found, required=LATEST_VERSION, where=where)
        await apply_migrations(conn, schema)
        found = await _transact(
            conn, functools.partial(current_version, schema=schema), begin=False
        )
    if found > LATEST_VERSION:
        raise StorageError(
            f"{where}: database schema version {found} is newer than this acp-once supports"
            f" ({LATEST_VERSION}); upgrade acp-once"
        )


# -- SQL ----------------------------------------------------------------------------------------

_SESSION_COLUMNS: Final = (
    "session_id, cwd, additional_directories, title, created_at, updated_at, forked_from"
)


@dataclass(frozen=True, slots=True)
class _Statements:
    """Every statement of the store, composed once for one schema."""

    insert_session: sql.Composed
    get_session: sql.Composed
    list_sessions: sql.Composed
    delete_session: sql.Composed
    lock_session: sql.Composed
    find_key: sql.Composed
    insert_entry: sql.Composed
    insert_fenced: sql.Composed
    append_entry: sql.Composed
    read_timeline: sql.Composed
    read_tail: sql.Composed
    count_user: sql.Composed
    count_key: sql.Composed
    fork_session: sql.Composed
    copy_timeline: sql.Composed
    append_fenced: sql.Composed
    append_many: sql.Composed
    schema: str


@functools.lru_cache(maxsize=64)
def _statements(schema: str) -> _Statements:
    def q(template: str) -> sql.Composed:
        return _q(template, schema)

    return _Statements(
        insert_session=q(
            f"INSERT INTO {{s}}.sessions ({_SESSION_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s)"
            " ON CONFLICT (session_id) DO NOTHING RETURNING 1"
        ),
        get_session=q(f"SELECT {_SESSION_COLUMNS} FROM {{s}}.sessions WHERE session_id = %s"),
        # %(cwd)s and %(after)s may be NULL: one statement (one plan) for every listing.
        list_sessions=q(
            f"SELECT {_SESSION_COLUMNS} FROM {{s}}.sessions"
            " WHERE (%(cwd)s::text IS NULL OR cwd = %(cwd)s::text)"
            " AND (%(after_at)s::float8 IS NULL OR updated_at < %(after_at)s::float8"
            "      OR (updated_at = %(after_at)s::float8 AND session_id > %(after_id)s::text))"
            " ORDER BY updated_at DESC, session_id ASC LIMIT %(limit)s"
        ),
        delete_session=q("DELETE FROM {s}.sessions WHERE session_id = %s"),
        lock_session=q("SELECT next_seq FROM {s}.sessions WHERE session_id = %s FOR NO KEY UPDATE"),
        find_key=q(
            "SELECT message_id, prompt_digest FROM {s}.timeline"
            " WHERE session_id = %s AND idempotency_key = %s"
        ),
        # Inserts the row and advances the session in one statement; no row comes back when
        # the key was recorded meanwhile by a writer that did not take the session lock.
        insert_entry=q(
            "WITH ins AS ("
            " INSERT INTO {s}.timeline (session_id, seq, message_id, payload, is_user_message,"
            "  idempotency_key, prompt_digest) VALUES (%(sid)s, %(seq)s, %(mid)s, %(payload)s,"
            "  true, %(key)s, %(digest)s)"
            " ON CONFLICT (session_id, idempotency_key) WHERE idempotency_key IS NOT NULL"
            " DO NOTHING RETURNING seq)"
            " UPDATE {s}.sessions SET next_seq = ins.seq + 1,"
            "  updated_at = GREATEST(updated_at, %(now)s) FROM ins"
            " WHERE session_id = %(sid)s RETURNING ins.seq"
        ),
        # A whole fenced insert in one statement (autocommit, one trip), in lock order: the
        # fence (FOR SHARE: a takeover, an UPDATE of the lease row, waits until this write
        # commits, and a write after it sees the new epoch and is refused), the queued prompt
        # if any (FOR UPDATE: a withdrawal waits, then finds it inserted), the session row,
        # then the INSERT, `next_seq`, and the queued row's outcome with its NOTIFY. The key
        # is looked up in the statement's snapshot, which is enough under the fence: the
        # session's earlier inserts were the lease owner's, committed before this statement
        # (this node's, one at a time, or an earlier owner's, before its lease was taken), and
        # ON CONFLICT still refuses a duplicate.
        insert_fenced=q(
            "WITH f AS (SELECT 1 FROM {s}.session_leases WHERE session_id = %(sid)s"
            "  AND owner = %(owner)s AND epoch = %(epoch)s FOR SHARE),"
            " r AS (SELECT 1 FROM {s}.prompt_queue WHERE id = %(row)s::bigint"
            "  AND state = 'queued' FOR UPDATE),"
            " ok AS (SELECT EXISTS (SELECT 1 FROM f) AS fenced,"
            "  %(row)s::bigint IS NULL OR EXISTS (SELECT 1 FROM r) AS queued),"
            " l AS (SELECT next_seq FROM {s}.sessions WHERE session_id = %(sid)s"
            "  AND (SELECT fenced AND queued FROM ok) FOR NO KEY UPDATE),"
            " rec AS (SELECT message_id, prompt_digest FROM {s}.timeline"
            "  WHERE session_id = %(sid)s AND idempotency_key = %(key)s::bytea),"
            " ins AS (INSERT INTO {s}.timeline (session_id, seq, message_id, payload,"
            "  is_user_message, idempotency_key, prompt_digest)"
            "  SELECT %(sid)s, l.next_seq, %(mid)s, %(payload)s::bytea, true, %(key)s::bytea,"
            "  %(digest)s::bytea FROM l WHERE NOT EXISTS (SELECT 1 FROM rec)"
            "  ON CONFLICT (session_id, idempotency_key) WHERE idempotency_key IS NOT NULL"
            "  DO NOTHING RETURNING seq),"
            " adv AS (UPDATE {s}.sessions SET next_seq = ins.seq + 1,"
            "  updated_at = GREATEST(updated_at, %(now)s) FROM ins"
            "  WHERE session_id = %(sid)s RETURNING ins.seq),"
            " res AS (SELECT (SELECT seq FROM adv) AS seq, (SELECT message_id FROM rec) AS mid,"
            "  (SELECT prompt_digest FROM rec) AS digest),"
            " flip AS (UPDATE {s}.prompt_queue AS q SET"
            "  state = CASE WHEN res.seq IS NULL THEN 'recorded' ELSE 'inserted' END,"
            "  message_id = COALESCE(res.mid, %(mid)s),"
            "  same_prompt = res.seq IS NOT NULL OR res.digest IS NULL"
            "   OR res.digest = %(digest)s::bytea"
            "   OR COALESCE(res.digest = %(legacy)s::bytea, false)"
            "  FROM res WHERE q.id = %(row)s::bigint AND EXISTS (SELECT 1 FROM l)"
            "  AND (res.seq IS NOT NULL OR res.mid IS NOT NULL)"
            "  RETURNING pg_notify(%(channel)s::text, json_build_object('k', 'o', 'r', q.id,"
            "   'st', q.state, 'm', q.message_id, 'p', q.same_prompt)::text))"
            " SELECT ok.fenced, ok.queued,"
            "  EXISTS (SELECT 1 FROM {s}.sessions WHERE session_id = %(sid)s),"
            "  res.seq, res.mid, res.digest, (SELECT count(*) FROM flip) FROM ok, res"
        ),
        append_entry=q(
            "WITH s AS ("
            " UPDATE {s}.sessions SET next_seq = next_seq + 1,"
            "  updated_at = GREATEST(updated_at, %(now)s)"
            " WHERE session_id = %(sid)s RETURNING next_seq - 1 AS seq)"
            " INSERT INTO {s}.timeline (session_id, seq, message_id, payload)"
            " SELECT %(sid)s, s.seq, %(mid)s, %(payload)s FROM s RETURNING seq"
        ),
        read_timeline=q(
            "SELECT seq, message_id, payload FROM {s}.timeline"
            " WHERE session_id = %s AND seq > %s ORDER BY seq LIMIT %s"
        ),
        read_tail=q(
            "SELECT seq, message_id, payload FROM {s}.timeline"
            " WHERE session_id = %s ORDER BY seq DESC LIMIT %s"
        ),
        count_user=q("SELECT COUNT(*) FROM {s}.timeline WHERE session_id = %s AND is_user_message"),
        count_key=q(
            "SELECT COUNT(*) FROM {s}.timeline WHERE session_id = %s AND idempotency_key = %s"
        ),
        fork_session=q(
            f"INSERT INTO {{s}}.sessions ({_SESSION_COLUMNS}, next_seq)"
            " SELECT %s, %s, %s, %s, %s, %s, %s, src.next_seq FROM {s}.sessions src"
            " WHERE src.session_id = %s"
            " ON CONFLICT (session_id) DO NOTHING RETURNING 1"
        ),
        # Keys (and digests, which belong to them) are deliberately not copied into a fork.
        copy_timeline=q(
            "INSERT INTO {s}.timeline (session_id, seq, message_id, payload, is_user_message)"
            " SELECT %s, seq, message_id, payload, is_user_message FROM {s}.timeline"
            " WHERE session_id = %s"
        ),
        # `append_entry` and the fence check in one statement: a turn's writes cost one trip.
        append_fenced=q(
            "WITH f AS (SELECT 1 FROM {s}.session_leases WHERE session_id = %(sid)s"
            "  AND owner = %(owner)s AND epoch = %(epoch)s FOR SHARE),"
            " s AS ("
            " UPDATE {s}.sessions SET next_seq = next_seq + 1,"
            "  updated_at = GREATEST(updated_at, %(now)s)"
            " WHERE session_id = %(sid)s AND EXISTS (SELECT 1 FROM f)"
            " RETURNING next_seq - 1 AS seq)"
            " INSERT INTO {s}.timeline (session_id, seq, message_id, payload)"
            " SELECT %(sid)s, s.seq, %(mid)s, %(payload)s FROM s RETURNING seq"
        ),
        # `append_updates`: several entries at consecutive seqs in one statement, fenced when
        # %(owner)s is not NULL (as `append_fenced`).
        append_many=q(
            "WITH f AS (SELECT 1 FROM {s}.session_leases WHERE session_id = %(sid)s"
            "  AND owner = %(owner)s::text AND epoch = %(epoch)s::bigint FOR SHARE),"
            " s AS ("
            " UPDATE {s}.sessions SET next_seq = next_seq + %(n)s::bigint,"
            "  updated_at = GREATEST(updated_at, %(now)s)"
            " WHERE session_id = %(sid)s"
            "  AND (%(owner)s::text IS NULL OR EXISTS (SELECT 1 FROM f))"
            " RETURNING next_seq - %(n)s::bigint AS first)"
            " INSERT INTO {s}.timeline (session_id, seq, message_id, payload)"
            " SELECT %(sid)s, s.first + u.i - 1, u.mid, u.payload FROM s,"
            "  unnest(%(mids)s::text[], %(payloads)s::bytea[])"
            "  WITH ORDINALITY AS u(mid, payload, i)"
            " RETURNING seq"
        ),
        schema=schema,
    )


def _key_bytes(key: str) -> bytes:
    # surrogatepass: any Python str is a valid key, stored byte-exactly, never an encode error
    # (whose message would quote the key).
    return key.encode("utf-8", "surrogatepass")


_SessionRow = tuple[str, str, list[str], str | None, float, float, str | None]


def _to_params(record: SessionRecord) -> tuple[object, ...]:
    return (
        record.session_id,
        record.cwd,
        list(record.additional_directories),
        record.title,
        record.created_at,
        record.updated_at,
        record.forked_from,
    )


def _from_row(row: Sequence[Any]) -> SessionRecord:
    session_id, cwd, dirs, title, created_at, updated_at, forked_from = row
    return SessionRecord(
        session_id=session_id,
        cwd=cwd,
        additional_directories=tuple(dirs),
        title=title,
        created_at=float(created_at),
        updated_at=float(updated_at),
        forked_from=forked_from,
    )


# -- connection helpers -------------------------------------------------------------------------


async def _exec(conn: _Conn, query: _Query, params: Sequence[Any] = ()) -> None:
    async with conn.cursor(binary=True, row_factory=tuple_row) as cur:
        await cur.execute(query, params)


async def _one(
    conn: _Conn, query: _Query, params: Sequence[Any] | Mapping[str, Any] = ()
) -> tuple[Any, ...] | None:
    # Our own tuple rows and binary results, whatever the row factory of a caller's pool.
    async with conn.cursor(binary=True, row_factory=tuple_row) as cur:
        await cur.execute(query, params)
        return await cur.fetchone()


async def _all(
    conn: _Conn, query: _Query, params: Sequence[Any] | Mapping[str, Any] = ()
) -> list[tuple[Any, ...]]:
    async with conn.cursor(binary=True, row_factory=tuple_row) as cur:
        await cur.execute(query, params)
        return await cur.fetchall()


async def _transact(conn: _Conn, work: Callable[[_Conn], Awaitable[_T]], *, begin: bool) -> _T:
    """Run `work(conn)` and commit; with `begin`, in an explicit READ COMMITTED block.

    Works on connections in autocommit mode (we send BEGIN) and not (psycopg sends BEGIN
    before the first statement; we then set the isolation level of that transaction). The
    COMMIT is shielded from cancellation. On any exception nothing is rolled back here: the
    caller owns the connection and cleans it (`_release`).
    """
    if begin:
        if conn.autocommit:
            await _exec(conn, sql.SQL("BEGIN ISOLATION LEVEL READ COMMITTED"))
        else:
            await _exec(conn, sql.SQL("SET TRANSACTION ISOLATION LEVEL READ COMMITTED"))
    result = await work(conn)
    with anyio.CancelScope(shield=True):
        await conn.commit()
    return result


async def _clean(conn: _Conn) -> bool:
    """Bring a connection whose call failed or was cancelled back to idle, or close it.

    Must run shielded. Returns True when the connection is idle and can be reused.
    """
    status = conn.info.transaction_status
    if status in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
        with anyio.move_on_after(_CLEANUP_TIMEOUT):
            with contextlib.suppress(psycopg.Error):
                await conn.rollback()
    if conn.info.transaction_status == TransactionStatus.IDLE:
        return True
    # Still busy (a statement in flight, a rollback that did not answer) or broken: a
    # connection in an unknown state never goes back to the pool.
    await conn.close()
    return False


def describe_postgres(conninfo: str, schema: str) -> str:
    """Where a store lives, for messages: host, port, database and schema, never a password."""
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.Error:
        return f"postgresql (schema {schema})"
    host = params.get("host") or params.get("hostaddr") or "localhost"
    port = params.get("port") or 5432
    dbname = params.get("dbname") or params.get("user") or ""
    return f"postgresql://{host}:{port}/{dbname} (schema {schema})"


def _storage_error(exc: psycopg.Error, where: str) -> StorageError:
    """A StorageError for a psycopg error, without the values PostgreSQL may quote.

    Only the SQLSTATE and the primary message go in: never DETAIL (which quotes the columns of
    a violated unique index, the key included) nor HINT. Data exceptions (class 22) may quote
    a value even in their primary message, so they carry the SQLSTATE only. Raise the result
    outside the `except` block, so that the psycopg error is not kept as its context.
    """
    state = exc.sqlstate
    name = type(exc).__name__
    if state is None:  # raised by psycopg itself (connection, adaptation): no server values
        text = str(exc).splitlines()[0] if str(exc) else name
        return StorageError(f"{where}: {name}: {text}")
    if state.startswith("22"):
        return StorageError(f"{where}: {name} (SQLSTATE {state})")
    primary = exc.diag.message_primary or name
    return StorageError(f"{where}: {name} (SQLSTATE {state}): {primary}")


def parse_postgres_url(url: str) -> tuple[str, str]:
    """Split a `postgresql://` store URL into (libpq conninfo, schema).

    The schema comes from the acp-once parameter `?schema=NAME` (default `acp_once`), which is
    removed; every other parameter is left to libpq.

    Raises:
        ValueError: the URL is not a `postgresql://` or `postgres://` URL, or the schema is
            empty or too long.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError("a PostgreSQL store URL starts with postgresql:// or postgres://")
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    schemas = [value for name, value in query if name == "schema"]
    schema = schemas[-1] if schemas else DEFAULT_SCHEMA
    _check_schema(schema)
    if not schemas:
        return url, schema
    rest = urllib.parse.urlencode([(n, v) for n, v in query if n != "schema"])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), schema


def _check_schema(schema: str) -> None:
    if not schema or len(schema.encode()) > 63 or "\x00" in schema:
        raise ValueError("the PostgreSQL schema name must be 1 to 63 bytes long")


# -- the store ----------------------------------------------------------------------------------


class PostgresStore:
    """A `SessionStore` in a PostgreSQL schema. Create it with `PostgresStore.open(...)`."""

    def __init__(
        self,
        pool: _Pool,
        *,
        schema: str,
        owns_pool: bool,
        where: str,
        clock: Callable[[], float],
    ) -> None:
        """Wrap an open pool on a migrated schema; use `PostgresStore.open` instead."""
        self._pool: _Pool | None = pool
        self._owns_pool = owns_pool
        self._sql = _statements(schema)
        self._where = where
        self._clock = clock

    @classmethod
    def open(
        cls,
        dsn_or_pool: str | _Pool,
        *,
        migrate: bool = True,
        schema: str = DEFAULT_SCHEMA,
        min_size: int = 1,
        max_size: int = 10,
        prepare_threshold: int | None = 5,
        connect_timeout: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> Opening[PostgresStore]:
        """Open the store in `schema`; await it or `async with` it.

        Args:
            dsn_or_pool: a libpq connection string or URL (the store then opens, owns and
                closes an `AsyncConnectionPool`), or the caller's open `AsyncConnectionPool`
                (left open by `aclose`; its connections may or may not be in autocommit mode).
            migrate: apply pending schema migrations (creating the schema if needed). With
                False, an out-of-date schema raises `SchemaOutOfDate` instead.
            schema: the PostgreSQL schema holding the store's tables.
            min_size, max_size: the size of the store's own pool.
            prepare_threshold: psycopg's server-side prepared statements; None turns them off
                (needed behind PgBouncer in transaction mode). Own pool only.
            connect_timeout: seconds to wait for the first connections. Own pool only.
            clock: "now" in seconds since the epoch, for bumping `updated_at`.

        Raises:
            SchemaOutOfDate: `migrate=False` and the schema is older than required.
            StorageError: the database cannot be reached, or its schema is newer than
                supported.
        """
        _check_schema(schema)
        if not 1 <= min_size <= max_size:
            raise ValueError("the pool sizes must satisfy 1 <= min_size <= max_size")
        if isinstance(dsn_or_pool, AsyncConnectionPool):
            given: _Pool | None = dsn_or_pool
            conninfo = dsn_or_pool.conninfo if isinstance(dsn_or_pool.conninfo, str) else ""
        else:
            given, conninfo = None, dsn_or_pool
        where = describe_postgres(conninfo, schema)

        async def open_given(pool: _Pool) -> PostgresStore:
            await _use(
                pool,
                functools.partial(_prepare_schema, schema=schema, migrate=migrate, where=where),
                where=where,
            )
            return cls(pool, schema=schema, owns_pool=False, where=where, clock=clock)

        async def open_own() -> PostgresStore:
            conn = await _connect(conninfo, where, connect_timeout)
            error: StorageError | None = None
            try:
                await _prepare_schema(conn, schema, migrate=migrate, where=where)
            except psycopg.Error as exc:
                error = _storage_error(exc, where)
            finally:
                with anyio.CancelScope(shield=True):
                    await conn.close()
            if error is not None:
                raise error
            pool: _Pool = AsyncConnectionPool(
                conninfo,
                open=False,
                min_size=min_size,
                max_size=max_size,
                kwargs={"autocommit": True, "prepare_threshold": prepare_threshold},
                name=f"acp-once {schema}",
            )
            try:
                await pool.open(wait=True, timeout=connect_timeout)
            except BaseException as exc:
                with anyio.CancelScope(shield=True):
                    await pool.close()
                if isinstance(exc, psycopg.Error):
                    raise StorageError(f"{where}: cannot open the connection pool") from None
                raise
            return cls(pool, schema=schema, owns_pool=True, where=where, clock=clock)

        async def open_() -> PostgresStore:
            return await (open_own() if given is None else open_given(given))

        return Opening(open_, PostgresStore.aclose)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._pool is None else "open"
        return f"<PostgresStore {self._where} {state}>"

    async def _call(self, work: Callable[[_Conn], Awaitable[_T]], *, begin: bool = False) -> _T:
        pool = self._pool
        if pool is None:
            raise StorageError("the store is closed")
        return await _use(
            pool, functools.partial(_transact, work=work, begin=begin), where=self._where
        )

    # -- sessions ----------------------------------------------------------------------------

    async def create_session(self, record: SessionRecord) -> None:
        query = self._sql.insert_session

        async def work(conn: _Conn) -> None:
            if await _one(conn, query, _to_params(record)) is None:
                raise SessionExists(record.session_id)

        await self._call(work)

    async def get_session(self, session_id: str) -> SessionRecord | None:
        query = self._sql.get_session

        async def work(conn: _Conn) -> SessionRecord | None:
            row = await _one(conn, query, (session_id,))
            return None if row is None else _from_row(row)

        return await self._call(work)

    async def list_sessions(
        self, *, cwd: str | None = None, cursor: str | None = None, limit: int = 100
    ) -> tuple[list[SessionRecord], str | None]:
        check_limit(limit)
        after_at, after_id = (None, None) if cursor is None else decode_cursor(cursor)
        params: dict[str, object] = {
            "cwd": cwd,
            "after_at": after_at,
            "after_id": after_id,
            "limit": limit + 1,  # one more than asked tells whether a next page exists
        }
        query = self._sql.list_sessions

        async def work(conn: _Conn) -> list[SessionRecord]:
            return [_from_row(row) for row in await _all(conn, query, params)]

        records = await self._call(work)
        page = records[:limit]
        next_cursor = None
        if len(records) > limit:
            last = page[-1]
            next_cursor = encode_cursor(last.updated_at, last.session_id)
        return page, next_cursor

    async def delete_session(self, session_id: str) -> bool:
        query = self._sql.delete_session

        async def work(conn: _Conn) -> bool:
            async with conn.cursor(binary=True, row_factory=tuple_row) as cur:
                await cur.execute(query, (session_id,))  # the timeline goes by ON DELETE CASCADE
                return cur.rowcount > 0

        return await self._call(work)

    async def update_session(
        self,
        session_id: str,
        *,
        title: str | Unchanged | None = UNCHANGED,
        updated_at: float | Unchanged = UNCHANGED,
    ) -> SessionRecord:
        assignments: list[sql.Composable] = []
        params: list[object] = []
        if not isinstance(title, Unchanged):
            assignments.append(sql.SQL("title = %s"))
            params.append(title)
        if not isinstance(updated_at, Unchanged):
            assignments.append(sql.SQL("updated_at = %s"))
            params.append(updated_at)
        params.append(session_id)
        if assignments:
            query: _Query = sql.SQL(
                "UPDATE {table} SET {assignments} WHERE session_id = %s RETURNING {columns}"
            ).format(
                table=sql.Identifier(self._sql.schema, "sessions"),
                assignments=sql.SQL(", ").join(assignments),
                columns=sql.SQL(_SESSION_COLUMNS),
            )
        else:
            query = self._sql.get_session

        async def work(conn: _Conn) -> SessionRecord:
            row = await _one(conn, query, params)
            if row is None:
                raise SessionMissing(session_id)
            return _from_row(row)

        return await self._call(work)

    async def fork_session(self, source_id: str, new_record: SessionRecord) -> None:
        statements = self._sql

        async def work(conn: _Conn) -> None:
            # The lock keeps the source's timeline and `next_seq` still while we copy them.
            if await _one(conn, statements.lock_session, (source_id,)) is None:
                raise SessionMissing(source_id)
            params = (*_to_params(new_record), source_id)
            if await _one(conn, statements.fork_session, params) is None:
                raise SessionExists(new_record.session_id)
            await _exec(conn, statements.copy_timeline, (new_record.session_id, source_id))

        await self._call(work, begin=True)

    # -- timeline and keys -------------------------------------------------------------------

    async def insert_user_message(
        self,
        session_id: str,
        *,
        message_id: str,
        update: bytes,
        idempotency_key: str | None,
        prompt_digest: bytes | None,
        fence: Fence | None = None,
    ) -> InsertOutcome:
        """`SessionStore.insert_user_message`, fenced for several nodes with `fence`.

        With `fence`, one statement (one round trip) that writes only while the fence's owner
        holds the session's lease at its epoch (else `FencingError`, nothing written); with
        `fence.row`, only while that queued prompt is still queued (else `QueueRowGone`,
        nothing written), and the same statement settles the row (see `Fence.channel`).
        """
        now = self._clock()
        key = None if idempotency_key is None else _key_bytes(idempotency_key)
        statements = self._sql

        async def recorded(conn: _Conn) -> InsertOutcome | None:
            row = await _one(conn, statements.find_key, (session_id, key))
            return None if row is None else InsertOutcome(row[0], False, row[1])

        async def one_statement(conn: _Conn, fence: Fence) -> InsertOutcome:
            params = {
                "sid": session_id,
                "owner": fence.owner,
                "epoch": fence.epoch,
                "row": fence.row,
                "channel": fence.channel,
                "mid": message_id,
                "payload": update,
                "key": key,
                "digest": prompt_digest,
                "legacy": fence.legacy_digest,
                "now": now,
            }
            found = await _one(conn, statements.insert_fenced, params)
            assert found is not None  # FROM ok, res: one row
            fenced, queued, exists, seq, mid, digest, flipped = found
            if not exists:
                raise SessionMissing(session_id)
            if not fenced:
                raise FencingError(session_id)
            if not queued:
                assert fence.row is not None
                raise QueueRowGone(session_id, fence.row)
            if seq is not None:
                outcome = InsertOutcome(message_id, True, prompt_digest)
            elif mid is not None:
                outcome = InsertOutcome(mid, False, digest)
            else:  # pragma: no cover - a key recorded outside the fence, during the statement
                raise StorageError(f"{self._where}: the key was recorded concurrently")
            if fence.row is not None and not flipped:  # pragma: no cover - the row was locked
                raise QueueRowGone(session_id, fence.row)
            return outcome

        if fence is not None:
            return await self._insert_shielded(functools.partial(one_statement, fence=fence))

        async def insert(conn: _Conn) -> InsertOutcome:
            locked = await _one(conn, statements.lock_session, (session_id,))
            if locked is None:
                raise SessionMissing(session_id)
            if key is not None and (found := await recorded(conn)) is not None:
                return found  # nothing written; COMMIT only releases the lock
            params = {
                "sid": session_id,
                "seq": locked[0],
                "mid": message_id,
                "payload": update,
                "key": key,
                "digest": prompt_digest,
                "now": now,
            }
            if await _one(conn, statements.insert_entry, params) is None:
                # The unique index refused the key: a writer that bypassed the session lock
                # recorded it first (and committed, or ON CONFLICT would still wait). It wins.
                found = await recorded(conn)
                if found is None:  # pragma: no cover - the index just said it is there
                    raise StorageError(f"{self._where}: the key vanished during the insert")
                return found
            return InsertOutcome(message_id, True, prompt_digest)

        return await self._insert_shielded(insert, begin=True)

    async def _insert_shielded(
        self, work: Callable[[_Conn], Awaitable[InsertOutcome]], *, begin: bool = False
    ) -> InsertOutcome:
        """Run an insert to its end, whatever cancels the caller meanwhile.

        A cancellation in the middle of a statement only asks the server to stop it: the
        fenced insert is one statement that commits on its own (autocommit), and when the
        cancel comes too late it is stored all the same, while the caller sees only the
        cancellation. The runtime would then never start the message's turn, and a keyed
        retry would be answered with its id (`SessionStore.insert_user_message`). Shielded,
        the caller learns the outcome first; the cancellation comes at its next checkpoint.
        Bounded by `_INSERT_TIMEOUT`.

        Raises:
            StorageError: as `_call`, or the insert ran out of time (then it may or may not
                have been stored; a keyed retry finds it if it was).
        """
        with anyio.move_on_after(_INSERT_TIMEOUT, shield=True) as scope:
            return await self._call(work, begin=begin)
        assert scope.cancelled_caught
        raise StorageError(
            f"{self._where}: a user message insert took over {_INSERT_TIMEOUT:.0f} s"
            " (it may or may not have been stored)"
        )

    async def find_key(self, session_id: str, key: str) -> KeyRecord | None:
        query = self._sql.find_key

        async def work(conn: _Conn) -> KeyRecord | None:
            row = await _one(conn, query, (session_id, _key_bytes(key)))
            return None if row is None else KeyRecord(row[0], row[1])

        return await self._call(work)

    async def append_update(
        self,
        session_id: str,
        update: bytes,
        *,
        message_id: str | None = None,
        fence: Fence | None = None,
    ) -> int:
        """`SessionStore.append_update`; with `fence`, only while the fence holds (see
        `insert_user_message`), else `FencingError` and nothing is written."""
        params: dict[str, object] = {
            "sid": session_id,
            "mid": message_id,
            "payload": update,
            "now": self._clock(),
        }
        query = self._sql.append_entry
        if fence is not None:
            query = self._sql.append_fenced
            params.update(owner=fence.owner, epoch=fence.epoch)

        async def work(conn: _Conn) -> int:
            row = await _one(conn, query, params)
            if row is None:
                if fence is not None and await _one(conn, self._sql.get_session, (session_id,)):
                    raise FencingError(session_id)
                raise SessionMissing(session_id)
            return int(row[0])

        return await self._call(work)

    async def append_updates(
        self,
        session_id: str,
        updates: Sequence[tuple[bytes, str | None]],
        *,
        fence: Fence | None = None,
    ) -> list[int]:
        """`AppendsUpdates.append_updates` in one statement; with `fence`, only while the
        fence holds (else `FencingError` and nothing is written).

        Raises:
            SessionMissing: the session does not exist (nothing is written).
            FencingError: `fence` was given and no longer holds.
        """
        if not updates:
            return []
        params: dict[str, object] = {
            "sid": session_id,
            "owner": None if fence is None else fence.owner,
            "epoch": None if fence is None else fence.epoch,
            "n": len(updates),
            "now": self._clock(),
            "mids": [mid for _, mid in updates],
            "payloads": [update for update, _ in updates],
        }

        async def work(conn: _Conn) -> list[int]:
            rows = await _all(conn, self._sql.append_many, params)
            if not rows:
                if fence is not None and await _one(conn, self._sql.get_session, (session_id,)):
                    raise FencingError(session_id)
                raise SessionMissing(session_id)
            return sorted(int(row[0]) for row in rows)

        return await self._call(work)

    @property
    def schema(self) -> str:
        """The PostgreSQL schema holding the store's tables."""
        return self._sql.schema

    @property
    def where(self) -> str:
        """Where the store lives, for messages (no password)."""
        return self._where

    async def run(self, work: Callable[[_Conn], Awaitable[_T]], *, begin: bool = True) -> _T:
        """Run `work(conn)` in one transaction on a pooled connection (for the storage-level
        helpers next to this module, such as `pg_cluster`).

        Raises:
            StorageError: the store is closed, or PostgreSQL refused (psycopg errors are
                wrapped without their values); errors of `work` itself propagate.
        """
        return await self._call(work, begin=begin)

    async def read_timeline(
        self, session_id: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TimelineEntry]:
        check_limit(limit)
        query = self._sql.read_timeline

        async def work(conn: _Conn) -> list[TimelineEntry]:
            rows = await _all(conn, query, (session_id, after_seq, limit))
            return [TimelineEntry(session_id, seq, mid, payload) for seq, mid, payload in rows]

        return await self._call(work)

    async def read_timeline_tail(self, session_id: str, *, limit: int = 1) -> list[TimelineEntry]:
        check_limit(limit)
        query = self._sql.read_tail

        async def work(conn: _Conn) -> list[TimelineEntry]:
            rows = await _all(conn, query, (session_id, limit))
            return [
                TimelineEntry(session_id, seq, mid, payload) for seq, mid, payload in reversed(rows)
            ]

        return await self._call(work)

    async def count_user_messages(
        self, session_id: str, *, idempotency_key: str | None = None
    ) -> int:
        statements = self._sql

        async def work(conn: _Conn) -> int:
            if idempotency_key is None:
                row = await _one(conn, statements.count_user, (session_id,))
            else:
                params = (session_id, _key_bytes(idempotency_key))
                row = await _one(conn, statements.count_key, params)
            assert row is not None
            return int(row[0])

        return await self._call(work)

    async def aclose(self) -> None:
        """Stop using the pool, and close it if the store opened it. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None and self._owns_pool:
            with anyio.CancelScope(shield=True):  # bounded: the pool's own close timeout
                await pool.close()


async def _connect(conninfo: str, where: str, timeout: float) -> _Conn:
    try:
        return await psycopg.AsyncConnection.connect(
            conninfo, autocommit=True, connect_timeout=max(1, round(timeout))
        )
    except psycopg.Error as exc:
        error = StorageError(f"cannot connect to {_storage_error(exc, where)}")
    raise error


async def _use(pool: _Pool, work: Callable[[_Conn], Awaitable[_T]], *, where: str) -> _T:
    """Run `work` on a pooled connection; the connection goes back idle, or is closed.

    Every psycopg error comes out as a `StorageError` without its original (see
    `_storage_error`); our own errors (`SessionMissing`, ...) come out as they are.
    """
    try:
        conn = await pool.getconn()
    except psycopg.Error as exc:
        error = _storage_error(exc, where)
    else:
        idle = False
        try:
            result = await work(conn)
            idle = conn.info.transaction_status == TransactionStatus.IDLE
            return result
        except psycopg.Error as exc:
            error = _storage_error(exc, where)
        finally:
            with anyio.CancelScope(shield=True):
                if not idle:
                    await _clean(conn)
                await pool.putconn(conn)
    raise error


async def migrate_postgres(dsn: str, schema: str = DEFAULT_SCHEMA) -> tuple[int, int]:
    """Bring the schema to the latest version; the `acp-once db migrate` backend.

    Returns (version before, version after). Creates the schema if it does not exist.

    Raises:
        StorageError: the database cannot be reached or refuses the change.
    """
    _check_schema(schema)
    where = describe_postgres(dsn, schema)
    conn = await _connect(dsn, where, 30.0)
    try:
        before = await _transact(
            conn, functools.partial(current_version, schema=schema), begin=False
        )
        await apply_migrations(conn, schema)
        after = await _transact(
            conn, functools.partial(current_version, schema=schema), begin=False
        )
    except psycopg.Error as exc:
        error = _storage_error(exc, where)
    else:
        return before, after
    finally:
        with anyio.CancelScope(shield=True):
            await conn.close()
    raise error


async def postgres_status(dsn: str, schema: str = DEFAULT_SCHEMA) -> tuple[int, int]:
    """Return (the schema's version, the latest version); the `acp-once db status` backend.

    A missing schema is version 0 and is not created.

    Raises:
        StorageError: the database cannot be reached.
    """
    _check_schema(schema)
    where = describe_postgres(dsn, schema)
    conn = await _connect(dsn, where, 30.0)
    try:
        found = await _transact(
            conn, functools.partial(current_version, schema=schema), begin=False
        )
    except psycopg.Error as exc:
        error = _storage_error(exc, where)
    else:
        return found, LATEST_VERSION
    finally:
        with anyio.CancelScope(shield=True):
            await conn.close()
    raise error
