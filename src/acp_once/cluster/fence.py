"""The fencing token of the cluster's writes: `Fence`, a `WriteGuard` of the PostgreSQL store.

A write under a fence is stored only while the fence's owner holds the session's lease at its
epoch (`session_leases`; see `acp_once.cluster.sql`), checked in the write's own statement:
the lease row is locked `FOR SHARE` first, so a takeover (an UPDATE of that row) waits until
the write commits, and a write after a takeover sees the new epoch and is refused
(`FencingError`, nothing written). With `row`, the insert of a queued prompt also locks that
row of `prompt_queue` (`FOR UPDATE`: a withdrawal that comes meanwhile waits, then finds it
inserted: insertion wins, R27), writes only while it is still queued (else `QueueRowGone`),
and in the same statement marks it `inserted` (or `recorded`, when the key was) and
announces that outcome (`acp_once.cluster.notify.outcome_sql`).

Under the lease only its owner inserts, one at a time, so the store's guarded insert may look
the key up in its statement's snapshot: the session's earlier inserts were the owner's,
committed before it (this node's, one at a time, or an earlier owner's, before its lease was
taken), and the unique index still refuses a duplicate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from acp_once.cluster.notify import outcome_sql
from acp_once.storage.base import FencingError, StorageError
from acp_once.storage.postgres.guard import GuardSql

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ["Fence", "QueueRowGone"]

_LEASE: Final = (
    "f AS (SELECT 1 FROM {s}.session_leases WHERE session_id = %(sid)s"
    "  AND owner = %(owner)s::text AND epoch = %(epoch)s::bigint FOR SHARE)"
)

_FENCE: Final = GuardSql(
    before=_LEASE, holds="EXISTS (SELECT 1 FROM f)", columns="EXISTS (SELECT 1 FROM f)"
)
"""The lease alone: inserts and appends."""

_FENCE_AND_ROW: Final = GuardSql(
    # in lock order: the lease (FOR SHARE), then the queued prompt (FOR UPDATE)
    before=_LEASE + ", r AS (SELECT 1 FROM {s}.prompt_queue WHERE id = %(row)s::bigint"
    "  AND state = 'queued' FOR UPDATE)",
    holds="EXISTS (SELECT 1 FROM f) AND EXISTS (SELECT 1 FROM r)",
    columns="EXISTS (SELECT 1 FROM f), EXISTS (SELECT 1 FROM r), (SELECT count(*) FROM flip)",
    after=(
        "flip AS (UPDATE {s}.prompt_queue AS q SET"
        "  state = CASE WHEN res.seq IS NULL THEN 'recorded' ELSE 'inserted' END,"
        "  message_id = COALESCE(res.mid, %(mid)s),"
        "  same_prompt = res.seq IS NOT NULL OR res.digest IS NULL"
        "   OR res.digest = %(digest)s::bytea"
        "  FROM res WHERE q.id = %(row)s::bigint AND res.held"
        "  AND (res.seq IS NOT NULL OR res.mid IS NOT NULL)"
        "  RETURNING pg_notify(%(channel)s::text, "
        + outcome_sql("q.id", "q.state", "q.message_id", "q.same_prompt")
        + "))"
    ),
)
"""The lease and a queued prompt, settled by the insert: inserts only."""


class QueueRowGone(FencingError):
    """The queued prompt of a fenced insert (`Fence.row`) was withdrawn (or dropped) before
    the owner could insert it: a normal outcome of a race, nothing was written."""

    def __init__(self, session_id: str, row: int) -> None:
        StorageError.__init__(self, f"queued prompt {row} was withdrawn before insertion")
        self.session_id = session_id
        self.row = row


@dataclass(frozen=True, slots=True)
class Fence:
    """A fencing token: a write is accepted only while `owner` holds the session's lease at
    `epoch` (see the module docstring). A `WriteGuard` of `PostgresStore`'s writes."""

    owner: str
    epoch: int
    row: int | None = None
    """A queued prompt (`prompt_queue.id`) the write inserts: it must still be queued, and it
    stays locked until the write commits, so a withdrawal that comes meanwhile waits and then
    finds it inserted (insertion wins, R27). Inserts only."""
    channel: str | None = None
    """With `row`: the insert also marks the row `inserted` (or `recorded`, when the key was)
    with the message id, and announces that on this NOTIFY channel
    (`acp_once.cluster.notify.outcome`)."""

    @property
    def guard_sql(self) -> GuardSql:
        """`WriteGuard.guard_sql`: the lease, and the queued row when there is one."""
        return _FENCE if self.row is None else _FENCE_AND_ROW

    def guard_params(self) -> Mapping[str, object]:
        """`WriteGuard.guard_params`."""
        if self.row is None:
            return {"owner": self.owner, "epoch": self.epoch}
        return {"owner": self.owner, "epoch": self.epoch, "row": self.row, "channel": self.channel}

    def refused(self, session_id: str, columns: Sequence[Any]) -> FencingError | None:
        """`WriteGuard.refused`: `FencingError` when the lease moved on, `QueueRowGone` when
        the queued row is no longer queued (or, locked by the insert, was not settled)."""
        if not columns[0]:
            return FencingError(session_id)
        if self.row is None:
            return None
        _, queued, flipped = columns
        if not queued or not flipped:
            return QueueRowGone(session_id, self.row)
        return None
