"""Guarded writes: a condition, contributed as SQL by the caller, that a write of the
PostgreSQL store holds to in its own statement.

A `WriteGuard` is a small object passed as `guard=` to `PostgresStore.insert_user_message`,
`append_update` and `append_updates`. The store composes the guard's SQL (`GuardSql`) into the
write's one statement (one round trip, one entry of a group-commit batch), and reads the
guard's result columns back through `WriteGuard.refused`: the write is stored only when the
guard holds, and a guard that does not hold is that write's own answer (a `FencingError`,
nothing written), whatever the other writes of its batch do. The store knows nothing of what
a guard means; the cluster's lease fence (`acp_once.cluster.fence.Fence`) is one.

The guarded insert, in lock order (`{s}` is the schema):

    WITH <before>, ok AS (SELECT <holds> AS holds),
     l AS (the session row, locked only when ok.holds), rec AS (the key's recorded message),
     ins AS (the INSERT), adv AS (next_seq advanced),
     res AS (SELECT seq, mid, digest, held)    -- see `GuardSql.after`
     <, after>
    SELECT <session exists>, ok.holds, res.seq, res.mid, res.digest, <columns> FROM ok, res

and the guarded append (of several entries, or of one: `append_one`, without the arrays):

    WITH <before>, ok AS (SELECT <holds> AS holds),
     s AS (UPDATE sessions ... WHERE ... AND ok.holds), w AS (INSERT ... RETURNING seq)
    SELECT <session exists>, ok.holds, ARRAY(seqs of w), <columns> FROM ok

`<session exists>` is looked up only when nothing was written.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from psycopg import sql

from acp_once.storage.postgres.connection import compose
from acp_once.storage.postgres.sql import BUMP, TWO_ROWS

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from acp_once.storage.base import FencingError

__all__ = ["GuardSql", "GuardedStatements", "WriteGuard", "guarded_statements"]


@dataclass(frozen=True, slots=True)
class GuardSql:
    """The SQL a guard adds to a write's statement; `{s}` stands for the store's schema.

    The statement's parameters are the guard's own (`WriteGuard.guard_params`) and the
    store's, which the guard's SQL may read: `%(sid)s` (the session id) always; for an insert
    also `%(mid)s` (the new message id) and `%(digest)s` (the prompt digest, bytea). The
    guard's parameter names must differ from the store's: `sid`, `mid`, `payload`, `key`,
    `digest`, `now`, `n`, `mids`, `payloads`.

    Statements are composed once per schema and `GuardSql` value: a guard gives one of a few
    constant values, never one built per write.
    """

    before: str
    """Common table expressions (`name AS (...)`, comma-separated), evaluated before the
    session row is locked: the place for the guard's own row locks, in its lock order."""
    holds: str
    """A boolean expression over the `before` expressions: the write happens only if true."""
    columns: str
    """Expressions (comma-separated) read back into `WriteGuard.refused`, over the `before`
    expressions and, in an insert, the `after` ones."""
    after: str = ""
    """Inserts only: common table expressions run with the insert, which may read `res`, one
    row `(seq, mid, digest, held)`: the new row's seq (NULL when nothing was inserted), the
    message id and digest recorded with the key when it was recorded already, and whether
    the guard held and the session row was locked."""


class WriteGuard(Protocol):
    """A condition a write of `PostgresStore` is stored under (see the module docstring)."""

    @property
    def guard_sql(self) -> GuardSql:
        """The SQL the guard adds to the write's statement (one of a few constant values)."""
        ...

    def guard_params(self) -> Mapping[str, object]:
        """The values of the guard's own parameters in `guard_sql`."""
        ...

    def refused(self, session_id: str, columns: Sequence[Any]) -> FencingError | None:
        """Read the guard's result columns (`GuardSql.columns`, in order) of a write on an
        existing session: the error that is the write's answer when the guard did not hold
        (nothing was written), else None. The store answers `FencingError` itself when the
        guard did not hold and this gives no error."""
        ...


@dataclass(frozen=True, slots=True)
class GuardedStatements:
    """A guard's insert and append, composed for one schema."""

    insert: sql.Composed
    append: sql.Composed | None
    """Several entries (`%(n)s`, `%(mids)s`, `%(payloads)s`); None for a guard with `after`
    expressions, which guards inserts only."""
    append_one: sql.Composed | None
    """One entry (`%(mid)s`, `%(payload)s`): `append` without the arrays, as often as a turn
    writes; None as `append`."""
    append_two: sql.Composed | None
    """Two entries (`%(mid)s`, `%(payload)s`, `%(mid2)s`, `%(payload2)s`): `append` without
    the arrays, for a turn's last update and its end record; None as `append`."""


_EXISTS_UNLESS: Final = (
    "CASE WHEN {written} THEN true"
    " ELSE EXISTS (SELECT 1 FROM {{s}}.sessions WHERE session_id = %(sid)s) END"
)
"""Whether the session exists, looked up only when nothing was written (CASE is lazy)."""


@functools.lru_cache(maxsize=64)
def guarded_statements(schema: str, guard: GuardSql) -> GuardedStatements:
    """The guarded insert and append of `guard` in `schema`, composed once."""
    insert = compose(
        f"WITH {guard.before},"
        f" ok AS (SELECT {guard.holds} AS holds),"
        " l AS (SELECT next_seq FROM {s}.sessions WHERE session_id = %(sid)s"
        "  AND (SELECT holds FROM ok) FOR NO KEY UPDATE),"
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
        "  WHERE session_id = %(sid)s RETURNING ins.seq),"
        " res AS (SELECT (SELECT seq FROM adv) AS seq, (SELECT message_id FROM rec) AS mid,"
        "  (SELECT prompt_digest FROM rec) AS digest, EXISTS (SELECT 1 FROM l) AS held)"
        + (f", {guard.after}" if guard.after else "")
        + f" SELECT {_EXISTS_UNLESS.format(written='res.held')},"
        f"  ok.holds, res.seq, res.mid, res.digest, {guard.columns} FROM ok, res",
        schema,
    )
    if guard.after:
        return GuardedStatements(insert, None, None, None)
    head = f"WITH {guard.before}, ok AS (SELECT {guard.holds} AS holds),"
    written = _EXISTS_UNLESS.format(written="EXISTS (SELECT 1 FROM w)")
    append = compose(
        head + " s AS (UPDATE {s}.sessions SET next_seq = next_seq + %(n)s::bigint,"
        f"  {BUMP}"
        "  WHERE session_id = %(sid)s AND (SELECT holds FROM ok)"
        "  RETURNING next_seq - %(n)s::bigint AS first),"
        " w AS (INSERT INTO {s}.timeline (session_id, seq, message_id, payload)"
        "  SELECT %(sid)s, s.first + u.i - 1, u.mid, u.payload FROM s,"
        "  unnest(%(mids)s::text[], %(payloads)s::bytea[])"
        "  WITH ORDINALITY AS u(mid, payload, i) RETURNING seq)"
        f" SELECT {written}, ok.holds, ARRAY(SELECT seq FROM w ORDER BY seq),"
        f"  {guard.columns} FROM ok",
        schema,
    )
    append_one = compose(
        head + " s AS (UPDATE {s}.sessions SET next_seq = next_seq + 1,"
        f"  {BUMP}"
        "  WHERE session_id = %(sid)s AND (SELECT holds FROM ok) RETURNING next_seq - 1 AS seq),"
        " w AS (INSERT INTO {s}.timeline (session_id, seq, message_id, payload)"
        "  SELECT %(sid)s, s.seq, %(mid)s, %(payload)s FROM s RETURNING seq)"
        f" SELECT {written}, ok.holds, ARRAY(SELECT seq FROM w), {guard.columns} FROM ok",
        schema,
    )
    append_two = compose(
        head + " s AS (UPDATE {s}.sessions SET next_seq = next_seq + 2,"
        f"  {BUMP}"
        "  WHERE session_id = %(sid)s AND (SELECT holds FROM ok) RETURNING next_seq - 2 AS first),"
        f" w AS (INSERT INTO {{s}}.timeline (session_id, seq, message_id, payload)"
        f"  SELECT %(sid)s, s.first + u.i, u.mid, u.payload FROM s, {TWO_ROWS} RETURNING seq)"
        f" SELECT {written}, ok.holds, ARRAY(SELECT seq FROM w ORDER BY seq),"
        f"  {guard.columns} FROM ok",
        schema,
    )
    return GuardedStatements(insert, append, append_one, append_two)
