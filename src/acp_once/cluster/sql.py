"""The PostgreSQL side of several agent nodes sharing one store: leases, the prompt queue, events.

Records and SQL only (the coordinator that runs them is
`acp_once.cluster.PostgresCoordinator`), run on the store's pool through `PostgresStore.run`.
The tables come from migration 2 of `acp_once.storage.postgres`, where they stay: a database
migrated to version 2 has them, whichever version of this package created it, and
`acp-once db migrate` (which knows nothing of the cluster) keeps one chain of versions:

* `session_leases (session_id, owner, node_id, epoch, expires_at)`: who does a session's
  foreground work (inserting user messages, running turns). `owner` is a node *instance* (one
  process; a restarted node is a new instance), NULL when free. Taking a lease bumps `epoch`,
  the fencing token that every write under the lease carries (`acp_once.cluster.fence.Fence`,
  a guard of the store's writes, checked in the write's own statement). A lease may be taken
  when it is free or expired (`expires_at`, the database's clock, so nodes' clocks do not
  matter); the owner renews all its leases in one statement (`renew`) and releases a
  lease some time after the session went idle (`release`, refused while prompts are queued).
* `prompt_queue`: the prompts of a session that are accepted and not inserted yet (held), in
  arrival order (`id`), whichever node received them. The lease owner inserts them one by one:
  the insert, the flip of the row to `inserted` (or `recorded`: the key was inserted already)
  and the NOTIFY of the outcome are one statement (`PostgresStore.insert_user_message` with
  `guard=Fence(row=...)`), which locks the row first, and a withdrawal is an UPDATE of the
  same row guarded by `state = 'queued'`, so exactly one of "inserted" and "withdrawn" wins:
  a withdrawal during the insert waits and finds it inserted (R27), and an insert after a
  withdrawal writes nothing (`QueueRowGone`, a normal outcome). A unique index makes
  (session, key) queued at most once: a second request with the key on any node waits on
  that row (`waiters` counts the nodes waiting). Rows whose origin node is dead
  (no heartbeat within the lease TTL) are `abandoned` by the next owner: never answered, so the
  client's retry inserts once.
* `cluster_nodes`: a heartbeat and the figures of `/ops/status` per instance.
* `session_events`: session updates too large for a NOTIFY payload (8000 bytes); the payload
  then carries the event id.

Notifications go on one channel per schema, in the format of `acp_once.cluster.notify`.
Idempotency keys never appear in a payload (nor in a log line or an error message).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import anyio
import orjson
import psycopg
from psycopg import sql

from acp_once.cluster import notify
from acp_once.cluster.fence import Fence, QueueRowGone
from acp_once.cluster.notify import NOTIFY_LIMIT, channel_for
from acp_once.storage.base import FencingError
from acp_once.storage.postgres import PostgresStore
from acp_once.storage.postgres.connection import Conn as _Conn
from acp_once.storage.postgres.connection import Query as _Query
from acp_once.storage.postgres.connection import compose as _q
from acp_once.storage.postgres.connection import connect as _connect
from acp_once.storage.postgres.connection import execute as _exec
from acp_once.storage.postgres.connection import fetch_all as _all
from acp_once.storage.postgres.connection import fetch_one as _one
from acp_once.storage.postgres.connection import fetch_pipelined as _pipelined
from acp_once.storage.postgres.connection import key_bytes as _key_bytes
from acp_once.storage.postgres.connection import storage_error as _storage_error

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "NOTIFY_LIMIT",
    "Admission",
    "Attached",
    "Owned",
    "PgCluster",
    "QueueRowGone",
    "Queued",
    "QueuedPrompt",
    "RowOutcome",
    "channel_for",
]

_BEGIN: Final = sql.SQL("BEGIN ISOLATION LEVEL READ COMMITTED")
"""Sent in a pipeline with a transaction's first statements (`transact` commits it)."""

_FINISHED_RETENTION: Final = 600.0
"""Seconds finished queue rows, old events and dead nodes are kept (for late pollers and
`/ops/status`)."""


@dataclass(frozen=True, slots=True)
class QueuedPrompt:
    """One row of the prompt queue, as the lease owner reads it to insert it."""

    row: int
    session_id: str
    key: str | None
    digest: bytes
    content: bytes
    origin: str


@dataclass(frozen=True, slots=True)
class RowOutcome:
    """What became of a queued prompt. `state` is `queued` while it waits."""

    row: int
    state: str
    message_id: str | None
    same_prompt: bool | None
    lease_free: bool = False
    """The session's lease is free or expired (nobody will insert the row unless we take it)."""


@dataclass(frozen=True, slots=True)
class Attached:
    """A prompt with this key is queued already: wait on `row` (its digest is `digest`)."""

    row: int
    digest: bytes


@dataclass(frozen=True, slots=True)
class Queued:
    """The prompt was queued as `row` behind the work of `owner`."""

    row: int
    owner: str | None


@dataclass(frozen=True, slots=True)
class Owned:
    """The caller took the session's lease at `epoch`; `backlog`: prompts are queued already;
    `took_over`: from an owner whose lease expired (its work may be unfinished)."""

    epoch: int
    backlog: bool
    took_over: bool = False


Admission = Attached | Queued | Owned


@dataclass(frozen=True, slots=True)
class _Sql:
    ensure_lease: sql.Composed
    lock_lease: sql.Composed
    take_lease: sql.Composed
    renew: sql.Composed
    release_all: sql.Composed
    find_queued: sql.Composed
    attach: sql.Composed
    enqueue: sql.Composed
    enqueue_owned: sql.Composed
    free_if_idle: sql.Composed
    abandon_dead: sql.Composed
    next_row: sql.Composed
    flip: sql.Composed
    lock_lease_of_row: sql.Composed
    lock_lease_for_withdraw: sql.Composed
    withdraw: sql.Composed
    withdraw_session: sql.Composed
    detach: sql.Composed
    fail: sql.Composed
    outcomes: sql.Composed
    queued_sessions: sql.Composed
    heartbeat: sql.Composed
    peers: sql.Composed
    deregister: sql.Composed
    cleanup_rows: sql.Composed
    cleanup_events: sql.Composed
    cleanup_nodes: sql.Composed
    insert_event: sql.Composed
    read_event: sql.Composed
    status: sql.Composed
    lease_of: sql.Composed


def _statements(schema: str) -> _Sql:
    def q(template: str) -> sql.Composed:
        return _q(template, schema)

    alive = (
        "SELECT instance FROM {s}.cluster_nodes"
        " WHERE seen_at > now() - make_interval(secs => %(ttl)s)"
    )
    return _Sql(
        # creates the lease row if missing and locks it, in one statement (the no-op DO UPDATE
        # takes the row lock, as FOR UPDATE would)
        ensure_lease=q(
            "INSERT INTO {s}.session_leases AS l (session_id) VALUES (%s)"
            " ON CONFLICT (session_id) DO UPDATE SET session_id = EXCLUDED.session_id"
            " RETURNING l.owner, l.epoch, l.owner IS NULL OR l.expires_at < now()"
        ),
        lock_lease=q(
            "SELECT owner, epoch, owner IS NULL OR expires_at < now() FROM {s}.session_leases"
            " WHERE session_id = %s FOR UPDATE"
        ),
        # Takes the (locked) lease, abandons the queued prompts of dead nodes and says
        # whether others wait, in one statement: the last SELECT runs on the statement's
        # snapshot, where the rows just abandoned are still queued, so it leaves them out.
        take_lease=q(
            "WITH tk AS (UPDATE {s}.session_leases SET owner = %(me)s, node_id = %(node)s,"
            "  epoch = epoch + 1, expires_at = now() + make_interval(secs => %(ttl)s)"
            "  WHERE session_id = %(sid)s RETURNING epoch),"
            " ab AS (UPDATE {s}.prompt_queue SET state = 'abandoned'"
            "  WHERE session_id = %(sid)s AND state = 'queued'"
            f"  AND origin NOT IN ({alive}) RETURNING id)"
            " SELECT (SELECT epoch FROM tk), ARRAY(SELECT id FROM ab),"
            "  EXISTS (SELECT 1 FROM {s}.prompt_queue WHERE session_id = %(sid)s"
            "  AND state = 'queued' AND id NOT IN (SELECT id FROM ab))"
        ),
        # Every lease of this instance in one statement, its rows locked in session order
        # first: the order in which group commit's batches (fenced writes: FOR SHARE of the
        # lease row) take them, so that a renewal and a batch never wait for each other in a
        # cycle (a deadlock).
        renew=q(
            "WITH mine AS (SELECT session_id FROM {s}.session_leases"
            "  WHERE owner = %(me)s AND session_id = ANY(%(sids)s)"
            "  ORDER BY session_id FOR NO KEY UPDATE)"
            " UPDATE {s}.session_leases l SET expires_at = now() + make_interval(secs => %(ttl)s)"
            " FROM mine WHERE l.session_id = mine.session_id RETURNING l.session_id, l.epoch"
        ),
        # expired, not freed: the next owner sees a takeover and looks for unfinished turns
        release_all=q("UPDATE {s}.session_leases SET expires_at = '-infinity' WHERE owner = %s"),
        find_queued=q(
            "SELECT id, prompt_digest FROM {s}.prompt_queue"
            " WHERE session_id = %s AND idempotency_key = %s AND state = 'queued' FOR UPDATE"
        ),
        attach=q("UPDATE {s}.prompt_queue SET waiters = waiters + 1 WHERE id = %s"),
        enqueue=q(
            "INSERT INTO {s}.prompt_queue"
            " (session_id, idempotency_key, prompt_digest, content, origin)"
            " VALUES (%s, %s, %s, %s, %s) RETURNING id"
        ),
        # The lease owner queues a prompt behind its own work, in one statement (autocommit):
        # the fence (FOR SHARE, so it waits for another node's `admit`, which locks the lease
        # row, and queues after it), then the row, or one more waiter on the queued prompt
        # with the key (ON CONFLICT on `prompt_queue_keys`, which sees every committed row).
        # No row back: the fence failed. `xmax <> 0`: an existing row was updated.
        enqueue_owned=q(
            "WITH f AS (SELECT 1 FROM {s}.session_leases WHERE session_id = %(sid)s"
            "  AND owner = %(me)s AND epoch = %(epoch)s FOR SHARE)"
            " INSERT INTO {s}.prompt_queue AS q"
            " (session_id, idempotency_key, prompt_digest, content, origin)"
            " SELECT %(sid)s, %(key)s, %(digest)s, %(content)s, %(me)s FROM f"
            " ON CONFLICT (session_id, idempotency_key)"
            "  WHERE state = 'queued' AND idempotency_key IS NOT NULL"
            " DO UPDATE SET waiters = q.waiters + 1"
            " RETURNING q.id, q.prompt_digest, q.xmax <> 0"
        ),
        # after `lock_lease`, a new statement: it sees every prompt queued before the lock
        free_if_idle=q(
            "UPDATE {s}.session_leases SET owner = NULL, expires_at = '-infinity'"
            " WHERE session_id = %(sid)s AND owner = %(me)s AND epoch = %(epoch)s"
            " AND NOT EXISTS (SELECT 1 FROM {s}.prompt_queue"
            "  WHERE session_id = %(sid)s AND state = 'queued') RETURNING 1"
        ),
        abandon_dead=q(
            "UPDATE {s}.prompt_queue SET state = 'abandoned'"
            " WHERE session_id = %(sid)s AND state = 'queued'"
            f" AND origin NOT IN ({alive}) RETURNING id"
        ),
        next_row=q(
            "SELECT id, idempotency_key, prompt_digest, content, origin,"
            f" origin IN ({alive}) FROM {{s}}.prompt_queue"
            " WHERE session_id = %(sid)s AND state = 'queued' ORDER BY id LIMIT 1"
        ),
        # marks the row and notifies its outcome (delivered at COMMIT) in one statement
        flip=q(
            "UPDATE {s}.prompt_queue SET state = %s, message_id = %s, same_prompt = %s"
            " WHERE id = %s AND state = 'queued' RETURNING pg_notify(%s, %s)"
        ),
        # A withdrawal first waits for the fenced insert in flight, if any (FOR NO KEY UPDATE
        # conflicts with its FOR SHARE of the lease row), so that the statement after it sees
        # that insert committed: the owner may have inserted the key directly (a request on
        # the owner's node) while this row, with the same key, waited in the queue.
        lock_lease_of_row=q(
            "SELECT 1 FROM {s}.session_leases l JOIN {s}.prompt_queue q USING (session_id)"
            " WHERE q.id = %s FOR NO KEY UPDATE OF l"
        ),
        lock_lease_for_withdraw=q(
            "SELECT 1 FROM {s}.session_leases WHERE session_id = %s FOR NO KEY UPDATE"
        ),
        # Withdraw queued rows, except those whose key is recorded already: those are settled
        # as `recorded` with the message id (insertion wins, R27), and the same_prompt flag
        # the insert would have set.
        withdraw=q(_WITHDRAW.format(where="id = %(x)s")),
        withdraw_session=q(_WITHDRAW.format(where="session_id = %(x)s")),
        detach=q(
            "UPDATE {s}.prompt_queue SET waiters = waiters - 1,"
            " state = CASE WHEN waiters <= 1 THEN 'dropped' ELSE state END"
            " WHERE id = %s AND state = 'queued' RETURNING state"
        ),
        fail=q(
            "UPDATE {s}.prompt_queue SET state = 'failed'"
            " WHERE id = %s AND state = 'queued' RETURNING id"
        ),
        outcomes=q(
            "SELECT q.id, q.state, q.message_id, q.same_prompt,"
            " l.owner IS NULL OR l.expires_at < now()"
            " FROM {s}.prompt_queue q LEFT JOIN {s}.session_leases l USING (session_id)"
            " WHERE q.id = ANY(%s)"
        ),
        queued_sessions=q(
            "SELECT DISTINCT session_id FROM {s}.prompt_queue"
            " WHERE session_id = ANY(%s) AND state = 'queued'"
        ),
        heartbeat=q(
            "WITH beat AS (INSERT INTO {s}.cluster_nodes (instance, node_id, stats)"
            " VALUES (%(me)s, %(node)s, %(stats)s)"
            " ON CONFLICT (instance) DO UPDATE SET seen_at = now(), stats = EXCLUDED.stats)"
            " SELECT instance FROM {s}.cluster_nodes WHERE instance <> %(me)s"
            " AND seen_at > now() - make_interval(secs => %(horizon)s)"
        ),
        peers=q(
            "SELECT instance FROM {s}.cluster_nodes WHERE node_id <> %(node)s"
            " AND seen_at > now() - make_interval(secs => %(horizon)s)"
        ),
        deregister=q("DELETE FROM {s}.cluster_nodes WHERE instance = %s"),
        cleanup_rows=q(
            "DELETE FROM {s}.prompt_queue WHERE state <> 'queued'"
            " AND created_at < now() - make_interval(secs => %s)"
        ),
        cleanup_events=q(
            "DELETE FROM {s}.session_events WHERE created_at < now() - make_interval(secs => %s)"
        ),
        cleanup_nodes=q(
            "DELETE FROM {s}.cluster_nodes WHERE seen_at < now() - make_interval(secs => %s)"
        ),
        insert_event=q(
            "INSERT INTO {s}.session_events (session_id, payload) VALUES (%s, %s) RETURNING id"
        ),
        read_event=q("SELECT payload FROM {s}.session_events WHERE id = %s"),
        status=q(
            "SELECT n.node_id, n.instance, n.started_at, n.seen_at,"
            " n.seen_at > now() - make_interval(secs => %(ttl)s), n.stats,"
            " (SELECT count(*) FROM {s}.session_leases l"
            "  WHERE l.owner = n.instance AND l.expires_at > now()),"
            " (SELECT count(*) FROM {s}.prompt_queue q"
            "  WHERE q.origin = n.instance AND q.state = 'queued')"
            " FROM {s}.cluster_nodes n ORDER BY n.node_id, n.started_at"
        ),
        lease_of=q(
            "SELECT owner, node_id, epoch, owner IS NOT NULL AND expires_at >= now()"
            " FROM {s}.session_leases WHERE session_id = %s"
        ),
    )


_WITHDRAW = (
    "WITH q AS (SELECT id, session_id, idempotency_key, prompt_digest FROM {{s}}.prompt_queue"
    "  WHERE {where} AND state = 'queued' FOR UPDATE),"
    " rec AS (SELECT q.id, t.message_id, t.prompt_digest IS NULL"
    "  OR t.prompt_digest = q.prompt_digest AS same FROM q JOIN {{s}}.timeline t"
    "  ON t.session_id = q.session_id AND t.idempotency_key = q.idempotency_key)"
    " UPDATE {{s}}.prompt_queue p SET"
    "  state = CASE WHEN rec.id IS NULL THEN 'withdrawn' ELSE 'recorded' END,"
    "  message_id = rec.message_id, same_prompt = rec.same"
    " FROM q LEFT JOIN rec ON rec.id = q.id WHERE p.id = q.id"
    " RETURNING p.id, p.state, p.message_id, p.same_prompt"
)


class PgCluster:
    """The cluster tables of one `PostgresStore`, seen from one node instance.

    Args:
        store: the open store (its pool and schema are used).
        node_id: the operator's name for the node (`--node-id`).
        instance: this process's unique name (a restarted node is a new instance).
        lease_ttl: seconds a lease lasts without renewal; also the heartbeat's horizon.
    """

    def __init__(
        self, store: PostgresStore, *, node_id: str, instance: str, lease_ttl: float
    ) -> None:
        if lease_ttl <= 0:
            raise ValueError("lease_ttl must be positive")
        self.store = store
        self.node_id = node_id
        self.instance = instance
        self.lease_ttl = lease_ttl
        self.channel = channel_for(store.schema)
        self._sql = _statements(store.schema)
        self._notify = sql.SQL("SELECT pg_notify(%s, x) FROM unnest(%s::text[]) AS x")

    async def _notify_in(self, conn: _Conn, payloads: Sequence[str]) -> None:
        if payloads:
            await _exec(conn, self._notify, (self.channel, list(payloads)))

    # -- nodes --------------------------------------------------------------------------

    @property
    def _horizon(self) -> float:
        """Seconds since its last heartbeat an instance counts as alive for publishing: twice
        the lease TTL (an instance beats every third of it), so a slow heartbeat does not cut
        off a live node's updates."""
        return 2 * self.lease_ttl

    async def heartbeat(self, stats: dict[str, Any]) -> set[str]:
        """Record that this instance is alive, with its figures for `/ops/status`; the other
        instances alive (seen within twice the lease TTL) as the statement began."""
        params = {
            "me": self.instance,
            "node": self.node_id,
            "stats": orjson.dumps(stats).decode(),
            "horizon": self._horizon,
        }
        rows = await self.store.run(
            lambda conn: _all(conn, self._sql.heartbeat, params), begin=False
        )
        return {str(row[0]) for row in rows}

    async def announce(self) -> set[str]:
        """NOTIFY that this instance joined (committed), then read the instances of other
        nodes alive: every one of them either receives the join or had this instance in its
        heartbeat's answer before it sends its own join (`join`/`ack` in
        `acp_once.cluster.notify`). Instances of this node's id are left out: they are this
        node's earlier processes (a restart after a crash leaves one seen recently, which
        would never answer)."""

        async def work(conn: _Conn) -> list[tuple[Any, ...]]:
            await _exec(conn, self._notify, (self.channel, [notify.join(self.instance)]))
            params = {"node": self.node_id, "horizon": self._horizon}
            return await _all(conn, self._sql.peers, params)

        rows = await self.store.run(work, begin=False)
        return {str(row[0]) for row in rows}

    async def ack(self, joined: str) -> None:
        """NOTIFY that this instance saw the join of `joined`."""
        payloads = [notify.ack(self.instance, joined)]
        await self.store.run(lambda conn: self._notify_in(conn, payloads), begin=False)

    async def deregister(self) -> None:
        """Forget this instance (a clean shutdown): its queued prompts count as abandoned."""
        await self.store.run(
            lambda conn: _exec(conn, self._sql.deregister, (self.instance,)), begin=False
        )

    async def cleanup(self) -> None:
        """Delete finished queue rows, old events and long-dead nodes."""

        async def work(conn: _Conn) -> None:
            for query in (self._sql.cleanup_rows, self._sql.cleanup_events):
                await _exec(conn, query, (_FINISHED_RETENTION,))
            await _exec(conn, self._sql.cleanup_nodes, (6 * _FINISHED_RETENTION,))

        await self.store.run(work, begin=False)

    # -- leases -------------------------------------------------------------------------

    async def _abandon_dead(self, conn: _Conn, session_id: str) -> list[str]:
        rows = await _all(conn, self._sql.abandon_dead, {"sid": session_id, "ttl": self.lease_ttl})
        return [notify.outcome(row, "abandoned", None, None) for (row,) in rows]

    async def _take(self, conn: _Conn, session_id: str, took_over: bool) -> Owned:
        """Take the lease locked by the caller's transaction: (epoch, prompts queued)."""
        params = {"me": self.instance, "node": self.node_id, "ttl": self.lease_ttl}
        row = await _one(conn, self._sql.take_lease, {**params, "sid": session_id})
        assert row is not None
        epoch, abandoned, backlog = row
        await self._notify_in(conn, [notify.outcome(r, "abandoned", None, None) for r in abandoned])
        return Owned(int(epoch), bool(backlog), took_over)

    async def take(self, session_id: str) -> Owned | None:
        """Take the session's lease if it is free or expired; None when a live owner has it."""

        async def work(conn: _Conn) -> Owned | None:
            locked = await _one(conn, self._sql.ensure_lease, (session_id,))
            assert locked is not None
            if not locked[2]:
                return None
            return await self._take(conn, session_id, locked[0] is not None)

        return await self.store.run(work)

    async def release(self, session_id: str, epoch: int) -> bool:
        """Release the lease unless prompts are queued; True when the caller no longer holds
        it (released now, or lost before), False when it must go on inserting."""

        params = {"sid": session_id, "me": self.instance, "epoch": epoch}

        async def work(conn: _Conn) -> bool:
            # One round trip for BEGIN, the lock and the release (committed after it):
            # `free_if_idle` is a statement of its own after the lock, so it still sees every
            # prompt queued before the lock, and its own owner/epoch guard makes it a no-op
            # when the lock finds the lease moved on.
            _, locked, freed = await _pipelined(
                conn,
                [
                    (_BEGIN, ()),
                    (self._sql.lock_lease, (session_id,)),
                    (self._sql.free_if_idle, params),
                ],
            )
            if not locked or locked[0][0] != self.instance or locked[0][1] != epoch:
                return True
            return bool(freed)

        return await self.store.run(work, begin=False)

    async def renew(self, leases: dict[str, int]) -> set[str]:
        """Extend the leases `{session: epoch}` held; return the sessions whose lease is lost."""
        if not leases:
            return set()
        params = {"ttl": self.lease_ttl, "me": self.instance, "sids": sorted(leases)}

        async def work(conn: _Conn) -> list[tuple[Any, ...]]:
            return await _all(conn, self._sql.renew, params)

        kept = {
            sid
            for sid, epoch in await self.store.run(work, begin=False)
            if leases.get(sid) == epoch
        }
        return set(leases) - kept

    async def release_all(self) -> None:
        """Expire every lease this instance still holds (a shutdown with work in progress):
        another node may take them at once, and treats them as taken over (it looks for
        turns that did not finish)."""
        await self.store.run(
            lambda conn: _exec(conn, self._sql.release_all, (self.instance,)), begin=False
        )

    async def lease_of(self, session_id: str) -> tuple[str | None, str | None, int, bool]:
        """(owner instance, owner node, epoch, held by a live owner) of a session's lease."""
        row = await self.store.run(
            lambda conn: _one(conn, self._sql.lease_of, (session_id,)), begin=False
        )
        if row is None:
            return None, None, 0, False
        return row[0], row[1], int(row[2]), bool(row[3])

    # -- the prompt queue ---------------------------------------------------------------

    async def admit(
        self,
        session_id: str,
        key: str | None,
        digest: bytes,
        content: bytes,
        *,
        epoch: int | None,
    ) -> Admission:
        """Decide, in one transaction under the session's lease row, what a new prompt does.

        With `epoch` (the caller owns the lease and is busy): queue it, or wait on the queued
        prompt with the same key, in one statement. Without: wait on a queued prompt with the
        key; else take the lease if it is free or expired (`Owned`); else queue it behind the
        owner's work and wake the owner.

        Raises:
            FencingError: `epoch` was given and the caller no longer holds the lease.
            StorageError: the database failed.
        """
        key_bytes = None if key is None else _key_bytes(key)
        if epoch is not None:
            return await self._enqueue_owned(session_id, key_bytes, digest, content, epoch)

        async def work(conn: _Conn) -> Admission:
            # BEGIN, the lease row locked (created if missing) and the queued prompt with the
            # key looked up, in this order, in one round trip (pipeline mode).
            statements: list[tuple[_Query, Any]] = [
                (_BEGIN, ()),
                (self._sql.ensure_lease, (session_id,)),
            ]
            if key_bytes is not None:
                statements.append((self._sql.find_queued, (session_id, key_bytes)))
            results = await _pipelined(conn, statements)
            owner, _, free = results[1][0]
            if key_bytes is not None and results[2]:
                found = results[2][0]
                await _exec(conn, self._sql.attach, (found[0],))
                return Attached(int(found[0]), bytes(found[1]))
            if free:
                return await self._take(conn, session_id, owner is not None)
            params = (session_id, key_bytes, digest, content, self.instance)
            row = await _one(conn, self._sql.enqueue, params)
            assert row is not None
            if owner != self.instance:
                await self._notify_in(conn, [notify.wake(session_id, owner)])
            return Queued(int(row[0]), owner)

        return await self.store.run(work, begin=False)

    async def _enqueue_owned(
        self, session_id: str, key: bytes | None, digest: bytes, content: bytes, epoch: int
    ) -> Attached | Queued:
        params = {
            "sid": session_id,
            "me": self.instance,
            "epoch": epoch,
            "key": key,
            "digest": digest,
            "content": content,
        }
        row = await self.store.run(
            lambda conn: _one(conn, self._sql.enqueue_owned, params), begin=False
        )
        if row is None:
            raise FencingError(session_id)
        if row[2]:
            return Attached(int(row[0]), bytes(row[1]))
        return Queued(int(row[0]), self.instance)

    async def next_prompt(self, session_id: str) -> QueuedPrompt | None:
        """The session's oldest queued prompt (abandoning those whose origin is dead first)."""

        params = {"sid": session_id, "ttl": self.lease_ttl}

        async def work(conn: _Conn) -> tuple[Any, ...] | None:
            return await _one(conn, self._sql.next_row, params)

        async def abandon(conn: _Conn) -> None:
            await self._notify_in(conn, await self._abandon_dead(conn, session_id))

        while True:
            row = await self.store.run(work, begin=False)
            if row is None:
                return None
            row_id, key, digest, content, origin, alive = row
            if alive:
                text = None if key is None else bytes(key).decode("utf-8", "surrogatepass")
                return QueuedPrompt(
                    int(row_id), session_id, text, bytes(digest), bytes(content), origin
                )
            await self.store.run(abandon)  # its origin died: never answered, then look again

    async def _finish_rows(
        self, query: sql.Composed, params: tuple[Any, ...], state: str
    ) -> list[int]:
        async def work(conn: _Conn) -> list[int]:
            rows = [int(r[0]) for r in await _all(conn, query, params)]
            await self._notify_in(conn, [notify.outcome(r, state, None, None) for r in rows])
            return rows

        return await self.store.run(work)

    async def mark_inserted(self, row: int, message_id: str) -> None:
        """Mark a queued prompt inserted without a store write (a live-only message)."""

        payload = notify.outcome(row, "inserted", message_id, True)
        params = ("inserted", message_id, True, row, self.channel, payload)
        await self.store.run(lambda conn: _one(conn, self._sql.flip, params), begin=False)

    async def withdraw(self, row: int) -> RowOutcome | None:
        """Withdraw a queued prompt: its outcome, `withdrawn`, or `recorded` (with the message
        id) when its key was inserted meanwhile by the owner; None when it is no longer
        queued (inserted: R27)."""

        async def work(conn: _Conn) -> RowOutcome | None:
            await _all(conn, self._sql.lock_lease_of_row, (row,))
            outcomes = await self._withdraw_in(conn, self._sql.withdraw, row)
            return outcomes[0] if outcomes else None

        return await self.store.run(work)

    async def _withdraw_in(
        self, conn: _Conn, query: sql.Composed, target: int | str
    ) -> list[RowOutcome]:
        found = await _all(conn, query, {"x": target})
        outcomes = [RowOutcome(int(r), st, mid, same) for r, st, mid, same in found]
        await self._notify_in(
            conn,
            [notify.outcome(o.row, o.state, o.message_id, o.same_prompt) for o in outcomes],
        )
        return outcomes

    async def fail(self, row: int) -> bool:
        """Give up a queued prompt the owner could not store (its waiters get -32603)."""
        return bool(await self._finish_rows(self._sql.fail, (row,), "failed"))

    async def cancel_session(self, session_id: str) -> list[RowOutcome]:
        """Withdraw every queued prompt of the session (as `withdraw` does each) and tell its
        owner to cancel its turn."""

        async def work(conn: _Conn) -> list[RowOutcome]:
            await _all(conn, self._sql.lock_lease_for_withdraw, (session_id,))
            outcomes = await self._withdraw_in(conn, self._sql.withdraw_session, session_id)
            await self._notify_in(conn, [notify.cancel(session_id, self.instance)])
            return outcomes

        return await self.store.run(work)

    async def detach(self, row: int) -> None:
        """One node fewer waits on `row`; the last one leaving drops it (never inserted)."""

        async def work(conn: _Conn) -> None:
            found = await _one(conn, self._sql.detach, (row,))
            if found is not None and found[0] == "dropped":
                await self._notify_in(conn, [notify.outcome(row, "dropped", None, None)])

        await self.store.run(work)

    async def outcomes(self, rows: Sequence[int]) -> list[RowOutcome]:
        """The current state of queued prompts (the poll behind the notifications)."""
        found = await self.store.run(
            lambda conn: _all(conn, self._sql.outcomes, (list(rows),)), begin=False
        )
        return [RowOutcome(int(r), st, mid, same, bool(free)) for r, st, mid, same, free in found]

    async def queued_sessions(self, sessions: Sequence[str]) -> list[str]:
        """Those of `sessions` that have prompts queued (the poll behind the wake-ups)."""
        found = await self.store.run(
            lambda conn: _all(conn, self._sql.queued_sessions, (list(sessions),)), begin=False
        )
        return [str(row[0]) for row in found]

    # -- notifications ------------------------------------------------------------------

    async def publish(self, items: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Notify session updates `(session, update)`, in order, in one transaction."""

        small = [notify.update(sid, self.instance, update) for sid, update in items]
        if all(len(p.encode()) <= NOTIFY_LIMIT for p in small):  # one statement, autocommit
            await self.store.run(lambda conn: self._notify_in(conn, small), begin=False)
            return

        async def work(conn: _Conn) -> None:
            payloads: list[str] = []
            for session_id, update in items:
                payload = notify.update(session_id, self.instance, update)
                if len(payload.encode()) > NOTIFY_LIMIT:
                    row = await _one(
                        conn, self._sql.insert_event, (session_id, orjson.dumps(update))
                    )
                    assert row is not None
                    payload = notify.update(session_id, self.instance, None, int(row[0]))
                payloads.append(payload)
            await self._notify_in(conn, payloads)

        await self.store.run(work)

    async def read_event(self, event: int) -> dict[str, Any] | None:
        """The update of a large event, or None if it was cleaned up already."""
        row = await self.store.run(
            lambda conn: _one(conn, self._sql.read_event, (event,)), begin=False
        )
        if row is None:
            return None
        value: dict[str, Any] = orjson.loads(bytes(row[0]))
        return value

    @contextlib.asynccontextmanager
    async def listen(self, conninfo: str) -> AsyncIterator[Callable[[float], AsyncIterator[str]]]:
        """A dedicated connection LISTENing on the channel; yields `notifies(timeout)`, an
        iterator of the payloads that arrive within `timeout` seconds.

        Raises:
            StorageError: the connection could not be made or failed.
        """
        conn = await _connect(conninfo, self.store.where, 30.0)
        try:
            try:
                await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            except psycopg.Error as exc:
                error = _storage_error(exc, self.store.where)
                raise error from None

            async def notifies(timeout: float) -> AsyncIterator[str]:
                try:
                    async for note in conn.notifies(timeout=timeout):
                        yield note.payload
                except psycopg.Error as exc:
                    error = _storage_error(exc, self.store.where)
                    raise error from None

            yield notifies
        finally:
            with anyio.CancelScope(shield=True):
                await conn.close()

    # -- operations ---------------------------------------------------------------------

    async def status(self) -> list[dict[str, Any]]:
        """Per node instance: alive, sessions owned (live leases), prompts held (queued from
        it), and the figures it reported in its last heartbeat."""
        rows = await self.store.run(
            lambda conn: _all(conn, self._sql.status, {"ttl": self.lease_ttl}), begin=False
        )
        return [
            {
                "node": node,
                "instance": instance,
                "started_at": started.isoformat(),
                "seen_at": seen.isoformat(),
                "alive": bool(alive),
                "sessions_owned": int(owned),
                "prompts_queued": int(queued),
                **(stats if isinstance(stats, dict) else {}),
            }
            for node, instance, started, seen, alive, stats, owned, queued in rows
        ]


def fence(cluster: PgCluster, epoch: int) -> Fence:
    """The fencing token of `cluster`'s instance at `epoch`."""
    return Fence(cluster.instance, epoch)
