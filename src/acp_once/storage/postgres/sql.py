"""Every SQL statement of the PostgreSQL store, composed once per schema, and the mapping
between session rows and `SessionRecord`s (the guarded writes are composed in `guard.py`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from psycopg import sql

from acp_once.storage.base import SessionRecord
from acp_once.storage.postgres.connection import compose

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "BUMP",
    "SESSION_COLUMNS",
    "TWO_ROWS",
    "Statements",
    "from_row",
    "statements",
    "to_params",
]

SESSION_COLUMNS: Final = (
    "session_id, cwd, additional_directories, title, created_at, updated_at, forked_from, tenant"
)


BUMP: Final = (
    "updated_at = CASE WHEN updated_at <= %(now)s::float8 - 1.0 THEN %(now)s::float8"
    " ELSE updated_at END"
)
"""How a timeline write sets its session's `updated_at`: to now, unless it is less than a
second old (never back). `session/list` shows `updatedAt` in whole seconds, and the session
row's update then leaves every index of `sessions` as it is, so PostgreSQL writes it as a
heap-only tuple: no index entry for the two or more writes of every prompt."""


TWO_ROWS: Final = (
    "(VALUES (0, %(mid)s::text, %(payload)s::bytea), (1, %(mid2)s::text, %(payload2)s::bytea))"
    " AS u(i, mid, payload)"
)
"""The two entries of an append of two (a turn's last update and its end record, the runtime's
most frequent `append_updates`) as plain parameters: psycopg dumps a list parameter as an
array in Python, ~20 µs a call for two short lists."""


@dataclass(frozen=True, slots=True)
class Statements:
    """Every statement of the store, composed once for one schema (`statements`)."""

    insert_session: sql.Composed
    get_session: sql.Composed
    list_sessions: sql.Composed
    delete_session: sql.Composed
    delete_timeline: sql.Composed
    lock_session: sql.Composed
    find_key: sql.Composed
    insert_entry: sql.Composed
    insert_one: sql.Composed
    append_entry: sql.Composed
    read_timeline: sql.Composed
    read_tail: sql.Composed
    count_user: sql.Composed
    count_key: sql.Composed
    fork_session: sql.Composed
    copy_timeline: sql.Composed
    append_many: sql.Composed
    append_two: sql.Composed
    export_timeline: sql.Composed
    import_session: sql.Composed
    import_timeline: sql.Composed
    schema: str


@functools.lru_cache(maxsize=64)
def statements(schema: str) -> Statements:
    """The store's statements for `schema`, composed once per schema."""

    def q(template: str) -> sql.Composed:
        return compose(template, schema)

    return Statements(
        insert_session=q(
            f"INSERT INTO {{s}}.sessions ({SESSION_COLUMNS})"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
            " ON CONFLICT (session_id) DO NOTHING RETURNING 1"
        ),
        get_session=q(f"SELECT {SESSION_COLUMNS} FROM {{s}}.sessions WHERE session_id = %s"),
        # %(cwd)s and %(after)s may be NULL: one statement (one plan) for every listing.
        list_sessions=q(
            f"SELECT {SESSION_COLUMNS} FROM {{s}}.sessions"
            " WHERE (%(cwd)s::text IS NULL OR cwd = %(cwd)s::text)"
            # %(any_tenant)s: every tenant; else %(tenant)s exactly, NULL meaning no tenant.
            " AND (%(any_tenant)s::boolean OR tenant IS NOT DISTINCT FROM %(tenant)s::text)"
            " AND (%(after_at)s::float8 IS NULL OR updated_at < %(after_at)s::float8"
            "      OR (updated_at = %(after_at)s::float8 AND session_id > %(after_id)s::text))"
            " ORDER BY updated_at DESC, session_id ASC LIMIT %(limit)s"
        ),
        delete_session=q("DELETE FROM {s}.sessions WHERE session_id = %s"),
        delete_timeline=q("DELETE FROM {s}.timeline WHERE session_id = %s"),
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
            f"  {BUMP} FROM ins"
            " WHERE session_id = %(sid)s RETURNING ins.seq"
        ),
        # A whole unguarded insert in one statement (grouped writes: one trip, or one entry of a
        # pipeline): the session row locked, the key looked up, the row inserted at
        # `next_seq` unless the key is there, `next_seq` advanced. The lookup reads the
        # statement's snapshot: a key committed by a writer this statement waited for (on the
        # session lock) is not in it, but ON CONFLICT sees it and inserts nothing; the
        # answer (no seq, no recorded message) then asks the caller to look the key up again,
        # in a statement of its own, which sees it.
        insert_one=q(
            "WITH l AS (SELECT next_seq FROM {s}.sessions WHERE session_id = %(sid)s"
            "  FOR NO KEY UPDATE),"
            " rec AS (SELECT message_id, prompt_digest FROM {s}.timeline"
            "  WHERE session_id = %(sid)s AND idempotency_key = %(key)s::bytea),"
            " ins AS (INSERT INTO {s}.timeline (session_id, seq, message_id, payload,"
            "  is_user_message, idempotency_key, prompt_digest)"
            "  SELECT %(sid)s, l.next_seq, %(mid)s, %(payload)s::bytea, true, %(key)s::bytea,"
            "  %(digest)s::bytea FROM l WHERE NOT EXISTS (SELECT 1 FROM rec)"
            "  ON CONFLICT (session_id, idempotency_key) WHERE idempotency_key IS NOT NULL"
            "  DO NOTHING RETURNING seq),"
            " adv AS (UPDATE {s}.sessions SET next_seq = ins.seq + 1,"
            f"  {BUMP} FROM ins"
            "  WHERE session_id = %(sid)s RETURNING ins.seq)"
            " SELECT EXISTS (SELECT 1 FROM l), (SELECT seq FROM adv),"
            "  (SELECT message_id FROM rec), (SELECT prompt_digest FROM rec)"
        ),
        append_entry=q(
            "WITH s AS ("
            " UPDATE {s}.sessions SET next_seq = next_seq + 1,"
            f"  {BUMP}"
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
            f"INSERT INTO {{s}}.sessions ({SESSION_COLUMNS}, next_seq)"
            " SELECT %s, %s, %s, %s, %s, %s, %s, %s, src.next_seq FROM {s}.sessions src"
            " WHERE src.session_id = %s"
            " ON CONFLICT (session_id) DO NOTHING RETURNING 1"
        ),
        # Keys (and digests, which belong to them) are deliberately not copied into a fork.
        copy_timeline=q(
            "INSERT INTO {s}.timeline (session_id, seq, message_id, payload, is_user_message)"
            " SELECT %s, seq, message_id, payload, is_user_message FROM {s}.timeline"
            " WHERE session_id = %s"
        ),
        # `append_updates`: several entries at consecutive seqs in one statement.
        append_many=q(
            "WITH s AS ("
            " UPDATE {s}.sessions SET next_seq = next_seq + %(n)s::bigint,"
            f"  {BUMP}"
            " WHERE session_id = %(sid)s"
            " RETURNING next_seq - %(n)s::bigint AS first)"
            " INSERT INTO {s}.timeline (session_id, seq, message_id, payload)"
            " SELECT %(sid)s, s.first + u.i - 1, u.mid, u.payload FROM s,"
            "  unnest(%(mids)s::text[], %(payloads)s::bytea[])"
            "  WITH ORDINALITY AS u(mid, payload, i)"
            " RETURNING seq"
        ),
        # `append_many` of two entries, without arrays (`TWO_ROWS`).
        append_two=q(
            "WITH s AS ("
            " UPDATE {s}.sessions SET next_seq = next_seq + 2,"
            f"  {BUMP}"
            " WHERE session_id = %(sid)s RETURNING next_seq - 2 AS first)"
            " INSERT INTO {s}.timeline (session_id, seq, message_id, payload)"
            f" SELECT %(sid)s, s.first + u.i, u.mid, u.payload FROM s, {TWO_ROWS}"
            " RETURNING seq"
        ),
        # A fork between shards (`acp_once.storage.sharded`): the source's timeline out, the
        # new session in; keys and digests stay behind, as in `copy_timeline`.
        export_timeline=q(
            "SELECT seq, message_id, payload, is_user_message FROM {s}.timeline"
            " WHERE session_id = %s ORDER BY seq"
        ),
        import_session=q(
            f"INSERT INTO {{s}}.sessions ({SESSION_COLUMNS}, next_seq)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
            " ON CONFLICT (session_id) DO NOTHING RETURNING 1"
        ),
        import_timeline=q(
            "INSERT INTO {s}.timeline (session_id, seq, message_id, payload, is_user_message)"
            " SELECT %(sid)s, u.seq, u.mid, u.payload, u.is_user FROM"
            " unnest(%(seqs)s::bigint[], %(mids)s::text[], %(payloads)s::bytea[],"
            "  %(users)s::boolean[]) AS u(seq, mid, payload, is_user)"
        ),
        schema=schema,
    )


def to_params(record: SessionRecord) -> tuple[object, ...]:
    """The parameters of a session row, in `SESSION_COLUMNS` order."""
    return (
        record.session_id,
        record.cwd,
        list(record.additional_directories),
        record.title,
        record.created_at,
        record.updated_at,
        record.forked_from,
        record.tenant,
    )


def from_row(row: Sequence[Any]) -> SessionRecord:
    """The record of a session row selected as `SESSION_COLUMNS`."""
    session_id, cwd, dirs, title, created_at, updated_at, forked_from, tenant = row
    return SessionRecord(
        session_id=session_id,
        cwd=cwd,
        additional_directories=tuple(dirs),
        title=title,
        created_at=float(created_at),
        updated_at=float(updated_at),
        forked_from=forked_from,
        tenant=tenant,
    )
