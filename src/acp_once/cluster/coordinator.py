"""Several `SessionAgent` nodes on one PostgreSQL store: leases, cross-node prompts, updates.

`SessionAgent(store, coordinator=...)` takes a `Coordinator` (`acp_once.agent.coordinator`):
a `Placement` the sessions' inboxes call, plus a lifecycle; what it learns from other nodes goes
to the agent through `PlacementEvents`. `PostgresCoordinator` lets any number of nodes serve the
same sessions behind any load balancer:

* **Kept leases with fencing.** A session's foreground work (inserting user messages,
  running turns) happens on the node holding its lease (`session_leases`, see
  `acp_once.cluster.sql`). A node takes the lease when it needs to insert for a session whose
  lease is free or expired, and keeps it while the session is active and for `lease_grace`
  seconds after its worker last stopped with nothing queued (`idle_since`): a prompt on the
  owning node for a session whose lease it holds costs no lease statement, only the fenced
  insert (key lookup and insert in one statement, through the store's group commit).
  `_maintain` renews every lease held, active or kept, in one statement every
  `lease_ttl / 3`, drops a lease the renewal finds lost, and releases a kept lease whose grace
  has passed (the release is refused while prompts are queued; the owner then inserts them).
  Every write under the lease (`insert_user_message`, `append_update`) carries the fencing
  token `(instance, epoch)` and the store refuses it in the same statement when the lease
  moved on (`FencingError`): a node that lost its lease cannot write, and a refused write
  drops the lease here at once (`fenced_out`); a prompt placed under a kept lease that turns
  out lost this way is placed again (queued for the new owner). When the owner dies or
  stalls, its lease expires after `lease_ttl` and the next node that needs the session takes
  it over.
* **Cross-node prompts.** A keyed retry of an inserted prompt gets the recorded `messageId` on
  any node (the store's lookup). A prompt that cannot be inserted at once, because a turn runs
  (on this node or another) or prompts wait already, goes into the shared `prompt_queue` in
  arrival order; the lease owner, busy or idle within its grace, inserts the queued prompts
  one by one after its turn, each in the transaction that marks the row inserted. The owner
  reads the queue only when prompts may wait there (`backlog`: a wake-up NOTIFY from the
  queueing node, its own poll of the kept sessions' queues, a prompt of its own queued behind
  its turn), so a prompt that ends with nothing queued costs no read; a prompt arriving on
  the owner while the backlog is known goes behind it. A request on any node carrying the key of a
  queued prompt waits on that row instead of queueing a second one, and every waiter learns the
  outcome by NOTIFY (polled as well, every `poll_interval`, so a lost notification or a dead
  listener never leaves a request waiting): the `messageId`, or -32800 when it was withdrawn
  (`$/cancel_request` on any node, `session/cancel`, `session/close`). We chose forwarding
  through the queue over "wait for the lease": it keeps one arrival order for all nodes and
  makes held prompts visible to retries everywhere.
* **A dead node.** Its leases expire; prompts it had queued (its clients' connections died
  with it) are marked abandoned by the next owner: never answered, so the clients' retries
  insert them once. Prompts other nodes queued behind it stay queued and are inserted by the
  next owner, which a waiting node becomes by taking the expired lease itself.
* **Updates** emitted on one node are published by NOTIFY (large ones through a table) and
  delivered to the connections on which the session is active on every other node, while
  another instance is alive: a node alone sends none. Each heartbeat answers with the other
  instances seen within twice the lease TTL; a starting node LISTENs, registers, NOTIFYs its
  join and then reads the instances of other nodes alive (an instance of its own node id is
  an earlier process of it), and waits (at most `lease_ttl`) until each of them acknowledged
  the join or sent its own: from then on every one of them publishes, so a client that
  attaches to a session here afterwards reads in the timeline what was sent before and
  receives what comes after. A node whose listener reconnects, or whose heartbeat was late by
  more than the TTL, announces itself again (and publishes until its next heartbeat, having
  perhaps missed a join).

With the steer policy, a prompt another node queued is inserted as soon as the owner is
woken (NOTIFY), during its turn; the owner's own prompts are inserted at once as on one node.

Cost: a keyed prompt on the node that keeps the session's lease is the fenced insert and the
turn's fenced appends, all through group commit, plus the NOTIFY of its updates to the other
nodes; no lease statement. Each step of a busy owner is one statement (queueing a prompt
behind its turn; the insert, which checks the fence, locks and settles the queued row and
notifies its outcome together). `benchmarks/bench_cluster.py --in-process` and
`benchmarks/bench_load.py` (cluster section) count statements, transactions and round trips.

Interrupted work: a node that takes over a lease that expired (a dead owner, or one that
stopped with work in progress) looks for the session's turns that did not finish and runs them
again (`resume_interrupted`) or reports them interrupted, as one node does after a restart.

Limits: a kept session is woken through the runtime, which keeps sessions loaded while their
lease is held; a session deleted on this node after a wake-up and before its worker ran keeps
its lease until the node stops or the lease expires unrenewed elsewhere (its renewal goes on).
Keys of live-only messages (locally handled commands, never stored) are known only on
the node that ran them. A node that dies while it has requests waiting on another node's queued
prompt keeps that prompt held (it is inserted rather than dropped when its last other waiter
leaves). Streamable HTTP connections live on the node that created them: a load balancer must
route by `Acp-Connection-Id` (WebSocket connections are single TCP connections anyway).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import math
import socket
import uuid
from typing import TYPE_CHECKING, Any, Self

import anyio
import orjson

from acp_once.agent.placement import INSERTED, Insert, Placed, Recorded, Refused
from acp_once.agent.placement import Attached as Waits
from acp_once.agent.state import RECOVER_TIMEOUT, PendingPrompt
from acp_once.cluster import notify
from acp_once.cluster.fence import Fence, QueueRowGone
from acp_once.cluster.fenced import FencedStore
from acp_once.cluster.sql import Attached, Owned, PgCluster, Queued, QueuedPrompt, RowOutcome
from acp_once.protocol.errors import (
    AcpError,
    InternalError,
    InvalidParams,
    RequestCancelled,
)
from acp_once.storage.base import (
    FencingError,
    InsertOutcome,
    SessionStore,
    StorageError,
)
from acp_once.storage.postgres import PostgresStore

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from anyio.abc import TaskGroup, TaskStatus

    from acp_once.agent.placement import PlacementEvents

__all__ = ["PostgresCoordinator", "default_node_id"]

logger = logging.getLogger("acp_once.cluster")

_STOP_TIMEOUT = 5.0


def default_node_id() -> str:
    """The host name: a sensible `--node-id` when one node runs per machine."""
    return socket.gethostname() or "node"


class PostgresCoordinator:
    """Coordinates the nodes that share one `PostgresStore` (see the module docstring).

    Args:
        store: the node's open store (its own pool).
        node_id: the operator's name for this node (`acp-once serve --node-id`); logs and
            `/ops/status` show it. A process is an *instance* `NODE-<random>`, so a restarted
            node never mistakes its predecessor's leases for its own.
        lease_ttl: seconds a lease lasts without renewal (renewed every third of it); how long
            a dead node's sessions wait before another node takes over.
        lease_grace: seconds a lease is kept after the session's last activity (its worker
            stopped with nothing queued), so that the session's next prompt on this node
            costs no lease statement; None: three times `lease_ttl`. 0 releases a lease as
            soon as the session is idle.
        poll_interval: seconds between polls of the queued prompts this node waits on, and
            of the queue of the sessions whose lease it keeps idle (a safety net behind
            NOTIFY).

    Raises:
        ValueError: `lease_ttl` or `poll_interval` is not positive, or `lease_grace` is
            negative.
    """

    def __init__(
        self,
        store: PostgresStore,
        *,
        node_id: str | None = None,
        lease_ttl: float = 10.0,
        lease_grace: float | None = None,
        poll_interval: float = 1.0,
    ) -> None:
        if not math.isfinite(lease_ttl) or lease_ttl <= 0:
            raise ValueError("lease_ttl must be a positive number of seconds")
        if lease_grace is None:
            lease_grace = 3 * lease_ttl
        if not math.isfinite(lease_grace) or lease_grace < 0:
            raise ValueError("lease_grace must be 0 or a positive number of seconds")
        if poll_interval <= 0:
            raise ValueError("poll_interval must be positive")
        self.node_id = node_id or default_node_id()
        self.instance = f"{self.node_id}-{uuid.uuid4().hex[:12]}"
        self.base_store = store
        self.pg = PgCluster(
            store, node_id=self.node_id, instance=self.instance, lease_ttl=lease_ttl
        )
        self.lease_ttl = lease_ttl
        self.lease_grace = lease_grace
        self.poll_interval = poll_interval
        self.leases: dict[str, int] = {}
        """The sessions whose lease this node holds, with its epoch (the fencing token)."""
        self.idle_since: dict[str, float] = {}
        """The held sessions whose worker stopped with nothing queued (kept in grace), with
        the time (`anyio.current_time`) it stopped; a session being worked on is not here."""
        self.backlog: set[str] = set()
        """Held sessions for which prompts may be queued (a wake-up, the poll, a prompt of
        this node queued behind its turn): the worker reads the queue before it stops."""
        self._waiting: dict[int, PendingPrompt] = {}
        """The queued rows prompts of this node wait on."""
        self._rows: dict[PendingPrompt, int] = {}
        self.gone: set[int] = set()
        """Queued rows found withdrawn by this node's insert (`QueueRowGone`), until seen."""
        self._remote_state: dict[str, str] = {}
        self._publish: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()
        self._publish_ready = anyio.Event()
        self._others = True
        """Whether another instance may be alive (its updates are published): the last
        heartbeat's answer, set again by a join and by a reconnection of the listener."""
        self._joins = 0
        """Joins seen and listener reconnections: a heartbeat answer "no other instance"
        that began before one of them does not turn publishing off."""
        self._answers: set[str] | None = None
        """While `start` waits: the instances that acknowledged this one's join or joined."""
        self._answer = anyio.Event()
        self._last_beat = -math.inf
        self._events: PlacementEvents | None = None
        self._tg: TaskGroup | None = None
        self.listening = anyio.Event()
        """Set once this node LISTENs (updates and outcomes from other nodes reach it)."""
        self.counters: collections.Counter[str] = collections.Counter()
        """dedup_hits (answered without inserting: a recorded key, or a queued prompt's key),
        inserted, queued, forwarded (queued behind another node's work), leases_taken_over
        (from an owner whose lease expired), leases_lost, fenced (writes refused here)."""
        self.store = FencedStore(self)
        """The agent's view of the store: writes under a lease carry its fencing token."""

    # -- lifecycle ----------------------------------------------------------------------

    def placement(self, store: SessionStore) -> Self:
        """The agent's placement: this coordinator, whose `store` is the fenced view of this
        coordinator's `PostgresStore` (`store` is ignored)."""
        return self

    async def start(self, events: PlacementEvents, tg: TaskGroup) -> None:
        """Register this node and start its background tasks in the agent's task group; what
        it learns from other nodes goes to `events`."""
        self._events = events
        self._tg = tg
        self._answers = set()
        try:
            await tg.start(self._listen)
            await self._beat()
            if self.listening.is_set():
                await self._await_answers(await self.pg.announce())
        finally:
            self._answers = None
        tg.start_soon(self._maintain, name=f"cluster-maintain-{self.node_id}")
        tg.start_soon(self._publisher, name=f"cluster-publish-{self.node_id}")
        logger.info("cluster.start node=%s instance=%s", self.node_id, self.instance)

    async def stop(self) -> None:
        """Expire the leases this node still holds (sessions with work in progress: the next
        owner looks for their unfinished turns) and deregister it (its queued prompts count
        as abandoned). Bounded and shielded; the agent calls it after its turns ended."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(_STOP_TIMEOUT):
            with contextlib.suppress(StorageError):
                await self._flush()
            with contextlib.suppress(StorageError):
                await self.pg.release_all()
            with contextlib.suppress(StorageError):
                await self.pg.deregister()
        self.leases.clear()
        self.idle_since.clear()
        self.backlog.clear()
        logger.info("cluster.stop node=%s instance=%s", self.node_id, self.instance)

    def stats(self) -> dict[str, Any]:
        """This node's figures, as its heartbeat reports them to `/ops/status`."""
        return {
            "prompts_held": len(self._waiting),
            "leases": len(self.leases),
            "leases_kept_idle": len(self.idle_since),
            **{name: self.counters[name] for name in sorted(self.counters)},
            "dedup_hits": self.counters["dedup_hits"],
        }

    async def status(self, local: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every node sharing the database, from this node's point of view (`local` is not
        used: each node's heartbeat reports its own figures)."""
        return {"node": self.node_id, "instance": self.instance, "nodes": await self.pg.status()}

    def fence(self, session_id: str) -> Fence:
        """The fencing token for a write on `session_id`; `FencingError` without the lease."""
        epoch = self.leases.get(session_id)
        if epoch is None:
            self.counters["fenced"] += 1
            raise FencingError(session_id)
        return Fence(self.instance, epoch)

    def running_elsewhere(self, session_id: str) -> bool:
        """Another node reported the session running (for the `session/resume` snapshot)."""
        return session_id not in self.leases and self._remote_state.get(session_id) == "running"

    def publish(self, session_id: str, update: dict[str, Any]) -> None:
        """Send a session update to the other nodes (in order, batched, never blocking); none
        while no other instance is alive."""
        if not self._others:
            return
        self._publish.append((session_id, update))
        self._publish_ready.set()

    async def _beat(self) -> None:
        """Heartbeat; publish while the answer names another instance, or a join (or a
        reconnection of the listener) came while it ran."""
        joins = self._joins
        others = await self.pg.heartbeat(self.stats())
        late = anyio.current_time() - self._last_beat > self.lease_ttl
        self._last_beat = anyio.current_time()
        if others or joins != self._joins:
            self._others = True
        else:
            self._others = False
        if late and self._answers is None:
            # the others may have counted this instance dead meanwhile
            await self.pg.announce()

    async def _await_answers(self, waiting: set[str]) -> None:
        """Wait until every instance in `waiting` acknowledged this one's join or joined
        itself (it publishes from then on), at most `lease_ttl` seconds (one that does not
        answer died, or stalls)."""
        with anyio.move_on_after(self.lease_ttl):
            while True:
                answered = self._answer = anyio.Event()
                assert self._answers is not None
                if waiting <= self._answers:
                    return
                await answered.wait()
        logger.warning(
            "cluster.start node=%s: %d instance(s) did not answer the join",
            self.node_id,
            len(waiting - (self._answers or set())),
        )

    def _answered(self, instance: str) -> None:
        if self._answers is not None:
            self._answers.add(instance)
            self._answer.set()

    @property
    def _ev(self) -> PlacementEvents:
        events = self._events
        assert events is not None, "the coordinator is used before its agent was entered"
        return events

    # -- the placement (called by the sessions' inboxes) --------------------------------

    async def place(
        self, pending: PendingPrompt, insert: Insert, *, hold: bool, busy: bool
    ) -> Placed:
        """Insert a new prompt now, or queue it, or wait on the queued prompt with its key.

        Called under the session's lock with `pending` registered under its key. Whether it
        waits is decided across nodes (the lease, the shared queue), not by `hold`; `busy`
        (a turn runs here under the hold policy) queues it behind this node's turn. A
        database failure refuses it -32603 (nothing was queued or inserted: the key stays
        unused).
        """
        try:
            return await self._place(pending, insert, busy)
        except StorageError:
            logger.exception("session %s: admitting a prompt failed", pending.session_id)
            row = self._rows.get(pending)
            if row is not None:
                return Waits(_Row(self, row, pending))
            if pending.state != "held":
                return INSERTED
            return Refused(InternalError("The message could not be stored"))

    async def _place(self, pending: PendingPrompt, insert: Insert, busy: bool) -> Placed:
        sid = pending.session_id
        backlog = False
        for _ in range(3):  # a lease lost between two steps: decide again
            epoch = self.leases.get(sid)
            # In the same step as the read of the lease: from here on the session is worked
            # on, and `_maintain` no longer lets its kept lease go.
            self.idle_since.pop(sid, None)
            if epoch is not None:
                if backlog or busy or sid in self.backlog:
                    # behind this node's turn, or behind prompts other nodes queued (one
                    # arrival order): through the queue, which the worker reads
                    try:
                        admission = await self.pg.admit(
                            sid, pending.key, pending.digest, _content(pending), epoch=epoch
                        )
                    except FencingError:
                        self._lost(sid)
                        continue
                    assert not isinstance(admission, Owned)  # we own it already
                    self.backlog.add(sid)
                    return self._await_row(pending, admission)
                # The kept lease: no lease statement, the fenced insert alone. Should the
                # lease turn out lost (taken over while this node stalled), the insert is
                # refused, nothing written, and the prompt is placed again from the top.
                pending.write = functools.partial(self._write_owned, pending)
                try:
                    await insert(pending)
                except _LeaseGone:
                    pending.state = "held"
                    continue
                finally:
                    pending.write = None
                return INSERTED
            if pending.key is not None:
                found = await self.store.find_key(sid, pending.key)
                if found is not None:
                    return Recorded(found.message_id, found.prompt_digest)
            admission = await self.pg.admit(
                sid, pending.key, pending.digest, _content(pending), epoch=None
            )
            if isinstance(admission, Owned):
                self._took(sid, admission.epoch)
                self.idle_since.pop(sid, None)
                # this request may be cancelled (its connection closed) or fail from here on:
                # the lease we took is worked all the same (the inbox starts the worker, which
                # inserts what is queued and then releases it)
                if admission.took_over:
                    await self._recover(sid, locked=True)
                if admission.backlog:
                    backlog = True
                    continue  # queue behind the prompts that wait already (we own it now)
                await insert(pending)
                return INSERTED
            return self._await_row(pending, admission)
        return Refused(InternalError("The message could not be stored"))

    async def next(
        self,
        session_id: str,
        oldest: PendingPrompt | None,
        insert: Insert,
        *,
        release: bool = True,
    ) -> bool:
        """The worker's next step once its turns are done: insert the oldest queued prompt
        (True), or stop (False) keeping the lease for `lease_grace` seconds (`_maintain`
        lets it go after that; with no grace, it is released now unless prompts are queued).
        Not `release` (steer, while a turn runs): False when nothing is queued. `oldest` is
        not used: prompts held on this node wait on queued rows, inserted by their order
        there. The queue is read only when prompts may wait in it (`backlog`): a prompt that
        ends with nothing queued costs no statement here."""
        sid = session_id
        self.idle_since.pop(sid, None)
        try:
            while True:
                epoch = self.leases.get(sid)
                if epoch is None:
                    return False
                if sid not in self.backlog:
                    if release and self.lease_grace <= 0:
                        # Releases only when nothing is queued (it looks under the lease row's
                        # lock); refused, the queue is read.
                        if await self.pg.release(sid, epoch):
                            self._released(sid)
                            return False
                        self.backlog.add(sid)
                        continue
                    if release:
                        self.idle_since[sid] = anyio.current_time()
                    return False
                # a wake-up that comes during the read sets it again: read once more then
                self.backlog.discard(sid)
                queued = await self.pg.next_prompt(sid)
                if queued is None:
                    continue
                self.backlog.add(sid)  # there may be more behind it
                await self._insert_queued(sid, queued, insert)
                return True
        except StorageError:
            if not release:
                raise
            # Stop working on the session and stop renewing its lease: it expires, and the
            # next node that needs the session (this one included) takes the queue over.
            logger.exception("session %s: the prompt queue failed", sid)
            self._lost(sid)
            return False

    async def cancel(self, session_id: str) -> None:
        """session/cancel or close on this node: withdraw the session's queued prompts on every
        node (the owner's turn is cancelled by the cancel's NOTIFY)."""
        try:
            rows = await self.pg.cancel_session(session_id)
        except StorageError:
            logger.exception("session %s: withdrawing queued prompts failed", session_id)
            return
        for outcome in rows:
            self._outcome(outcome)

    async def claim(self, session_id: str) -> bool:
        """A session loaded with unfinished turns: deal with them only under its lease (another
        node may be running them right now); the worker then drains the queue and releases
        the lease. False when another node is working on the session."""
        if session_id in self.leases:
            return True
        owned = await self.pg.take(session_id)
        if owned is None:
            return False
        self._took(session_id, owned.epoch)
        return True

    def holds(self, session_id: str) -> bool:
        """Whether this node holds the session's lease."""
        return session_id in self.leases

    def fenced_out(self, session_id: str, fence: Fence) -> None:
        """A write under `fence` was refused: the lease moved on (taken over after a stall).
        A kept lease is dropped at once, not at the next renewal: the session's next prompt
        here then goes through the database instead of a write that would be refused."""
        self.counters["fenced"] += 1
        if self.leases.get(session_id) == fence.epoch:
            self._lost(session_id)

    async def insert_fenced(
        self,
        sid: str,
        mid: str,
        update: bytes,
        key: str | None,
        digest: bytes | None,
        row: int | None,
    ) -> InsertOutcome:
        """`PostgresStore.insert_user_message` of message `mid` with `key` and its `digest`,
        under this node's fence for session `sid` (`FencingError` without the lease); with
        `row`, it also settles that queued row."""
        fence = self.fence(sid)
        if row is not None:  # it must still be queued; the insert settles it (one statement)
            fence = dataclasses.replace(fence, row=row, channel=self.pg.channel)
        try:
            outcome = await self.base_store.insert_user_message(
                sid,
                message_id=mid,
                update=update,
                idempotency_key=key,
                prompt_digest=digest,
                guard=fence,
            )
        except QueueRowGone as exc:
            self.gone.add(exc.row)  # withdrawn meanwhile: its waiters have their answer
            raise
        except FencingError:
            self.fenced_out(sid, fence)
            raise
        if outcome.inserted:
            self.counters["inserted"] += 1
            logger.info("message.inserted session=%s message=%s", sid, mid)
        else:
            self.counters["dedup_hits"] += 1
            logger.info("message.recorded session=%s message=%s", sid, outcome.message_id)
        return outcome

    async def _write_owned(
        self, pending: PendingPrompt, message_id: str, update: bytes
    ) -> InsertOutcome:
        """The fenced insert of a prompt this node places under the lease it holds;
        `_LeaseGone` when the fence refuses it (nothing was written)."""
        sid, key = pending.session_id, pending.key
        digest = pending.digest if key is not None else None
        try:
            return await self.insert_fenced(sid, message_id, update, key, digest, row=None)
        except FencingError:
            raise _LeaseGone from None

    # -- internals ----------------------------------------------------------------------

    def _took(self, sid: str, epoch: int) -> None:
        self.leases[sid] = epoch
        logger.info("lease.taken session=%s node=%s epoch=%d", sid, self.node_id, epoch)

    def _released(self, sid: str) -> None:
        self.leases.pop(sid, None)
        self.idle_since.pop(sid, None)
        self.backlog.discard(sid)
        self.counters["leases_released"] += 1
        logger.info("lease.released session=%s node=%s", sid, self.node_id)

    def _lost(self, sid: str) -> None:
        self.idle_since.pop(sid, None)
        self.backlog.discard(sid)
        if self.leases.pop(sid, None) is None:
            return
        self.counters["leases_lost"] += 1
        logger.warning("lease.lost session=%s node=%s", sid, self.node_id)
        if self._events is not None:
            # its turns can no longer write; the next owner reports them interrupted
            self._events.lost(sid)

    async def _recover(self, sid: str, *, locked: bool) -> None:
        """After taking over a dead owner's lease: its unfinished turns are run again
        (`resume_interrupted`) or reported interrupted, as after a restart of one node.

        Shielded, bounded by `RECOVER_TIMEOUT` (the bound of recovering a session loaded after
        a restart: the same work): a takeover can happen in a prompt's request, and a request
        cancelled half-way (its connection closed) would leave the dead owner's turns neither
        run nor reported while we hold the lease, which nobody else then takes.
        """
        self.counters["leases_taken_over"] += 1
        with anyio.move_on_after(RECOVER_TIMEOUT, shield=True) as scope:
            found = await self._ev.recover(sid, locked=locked)
            if found:
                logger.info(
                    "lease.recovered session=%s node=%s unfinished=%d", sid, self.node_id, found
                )
        if scope.cancelled_caught:
            logger.warning(
                "lease.recovery session=%s node=%s: over %.0f s, stopped",
                sid,
                self.node_id,
                RECOVER_TIMEOUT,
            )

    def _await_row(self, pending: PendingPrompt, admission: Attached | Queued) -> Placed:
        digest: bytes | None = None
        if isinstance(admission, Attached):
            self.counters["dedup_hits"] += 1
            digest = admission.digest
            other = self._waiting.get(admission.row)
            if other is not None and other is not pending:
                # this node already waits on the row: one pending, more waiters
                self._spawn(self.pg.detach, admission.row)
                self._spawn(self._follow, pending, other)
                return Waits(None, digest=digest, joined=other)
        else:
            self.counters["queued"] += 1
            if admission.owner is not None and admission.owner != self.instance:
                self.counters["forwarded"] += 1
        self._waiting[admission.row] = pending
        self._rows[pending] = admission.row
        logger.debug("prompt.queued session=%s row=%d", pending.session_id, admission.row)
        return Waits(_Row(self, admission.row, pending), digest=digest)

    async def _follow(self, pending: PendingPrompt, other: PendingPrompt) -> None:
        await other.done.wait()
        self._ev.settle(pending, message_id=other.message_id, error=other.error)

    async def _insert_queued(self, sid: str, queued: QueuedPrompt, insert: Insert) -> None:
        # a stand-in without waiters: the requests (on any node) learn the outcome from the row
        written: list[bool] = []

        async def write(message_id: str, update: bytes) -> InsertOutcome:
            written.append(True)
            digest = queued.digest if queued.key is not None else None
            return await self.insert_fenced(
                sid, message_id, update, queued.key, digest, row=queued.row
            )

        stand_in = PendingPrompt.from_wire(
            sid, orjson.loads(queued.content), queued.key, queued.digest, write
        )
        await insert(stand_in)
        if queued.row in self.gone:
            # withdrawn (or dropped) before we locked it: nothing was written, and whoever
            # withdrew it answered its waiters; a race, not a failure
            self.gone.discard(queued.row)
            logger.debug("prompt.gone session=%s row=%d", sid, queued.row)
            return
        if stand_in.message_id is not None:
            if not written:  # live-only, not stored: no transaction marked it
                await self.pg.mark_inserted(queued.row, stand_in.message_id)
            self._outcome(RowOutcome(queued.row, "inserted", stand_in.message_id, True))
            return
        if isinstance(stand_in.error, InvalidParams):  # recorded with a different prompt
            self._outcome(RowOutcome(queued.row, "recorded", None, False))
            return
        # Not stored: our lease is gone (the next owner inserts it) or the database failed
        # (its waiters get -32603, as on one node).
        epoch = self.leases.get(sid)
        owner, _, current, _ = await self.pg.lease_of(sid)
        if epoch is None or owner != self.instance or current != epoch:
            self._lost(sid)
            return
        if await self.pg.fail(queued.row):
            self._outcome(RowOutcome(queued.row, "failed", None, None))

    async def _withdraw_row(self, row: int, error: AcpError | None) -> None:
        try:
            outcome = await self.pg.withdraw(row)
        except StorageError:
            logger.exception("withdrawing queued prompt %d failed", row)
            return
        if outcome is not None:
            self._outcome(outcome, error=error)

    def _outcome(self, outcome: RowOutcome, *, error: AcpError | None = None) -> None:
        pending = self._waiting.get(outcome.row)
        if pending is None or outcome.state == "queued":
            return
        self._waiting.pop(outcome.row, None)
        self._rows.pop(pending, None)
        events = self._ev
        if outcome.state in ("dropped", "abandoned"):
            # nobody inserted it: a request still waiting here submits it again (it is the
            # client's retry), which inserts it once
            events.resubmit(pending)
        elif outcome.state == "inserted" or outcome.state == "recorded":
            events.settle(pending, message_id=outcome.message_id, same_prompt=outcome.same_prompt)
        elif outcome.state == "withdrawn":
            events.settle(
                pending,
                error=error or RequestCancelled("The prompt was withdrawn before insertion"),
            )
        else:
            events.settle(pending, error=InternalError("The message could not be stored"))

    def _spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        if self._tg is not None:
            self._tg.start_soon(self._guarded, fn, *args)

    async def _guarded(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        # a background step that fails must never take the agent's task group down
        try:
            await fn(*args)
        except Exception:
            logger.exception("cluster node %s: a background step failed", self.node_id)

    # -- background tasks ---------------------------------------------------------------

    async def _listen(self, *, task_status: TaskStatus[None]) -> None:
        conninfo = self._conninfo()
        started = False
        while True:
            try:
                async with self.pg.listen(conninfo) as notifies:
                    self.listening.set()
                    if started:
                        # joins may have been missed while the listener was down
                        self._joins += 1
                        self._others = True
                        await self.pg.announce()
                    if not started:
                        started = True
                        task_status.started()
                    while True:
                        async for payload in notifies(self.poll_interval):
                            await self._on_notify(payload)
            except StorageError:
                logger.warning("cluster.listen node=%s: reconnecting", self.node_id)
                if not started:
                    started = True
                    task_status.started()
                await anyio.sleep(self.poll_interval)  # a pause between attempts, not a sync

    def _conninfo(self) -> str:
        return self.base_store.conninfo

    async def _on_notify(self, payload: str) -> None:
        note = notify.read(payload)
        if isinstance(note, notify.Outcome):
            self._outcome(RowOutcome(note.row, note.state, note.message_id, note.same_prompt))
        elif isinstance(note, notify.Update) and note.instance != self.instance:
            if note.event is not None:
                self._spawn(self._deliver_event, note.session_id, note.event)
            elif note.update is not None:
                self._deliver(note.session_id, note.update)
        elif isinstance(note, notify.Wake) and note.owner == self.instance:
            self._wake(note.session_id)
        elif isinstance(note, notify.Cancel) and note.instance != self.instance:
            self._remote_cancel(note.session_id)
        elif isinstance(note, notify.Join) and note.instance != self.instance:
            self._joins += 1
            self._others = True
            self._answered(note.instance)
            self._spawn(self.pg.ack, note.instance)
        elif isinstance(note, notify.Ack) and note.joined == self.instance:
            self._answered(note.instance)

    async def _deliver_event(self, session_id: str, event: int) -> None:
        update = await self.pg.read_event(event)
        if update is not None:
            self._deliver(session_id, update)

    def _deliver(self, session_id: str, update: dict[str, Any]) -> None:
        if update.get("sessionUpdate") == "state_update":
            self._remote_state[session_id] = str(update.get("state"))
        if self._events is not None:
            self._events.update(session_id, update)

    def _wake(self, session_id: str) -> None:
        if self._events is not None and session_id in self.leases:
            # busy or idle in its grace: the worker reads the queue before it stops
            self.backlog.add(session_id)
            self.idle_since.pop(session_id, None)
            self._events.wake(session_id)

    def _remote_cancel(self, session_id: str) -> None:
        if self._events is not None and session_id in self.leases:
            self._events.cancelled(session_id)

    async def _maintain(self) -> None:
        """Renew every lease held (one statement) and heartbeat every third of the TTL; let
        kept leases go after their grace; poll the rows we wait on and the queues of the
        sessions whose lease we keep idle."""
        beat = self.lease_ttl / 3
        tick = min(beat, self.poll_interval)
        if self.lease_grace > 0:
            tick = min(tick, self.lease_grace)
        since_beat = math.inf
        rounds = 0
        while True:
            try:
                if since_beat >= beat:
                    since_beat = 0.0
                    rounds += 1
                    await self._renew()
                    await self._beat()
                    if rounds % 100 == 1:
                        await self.pg.cleanup()
                await self._release_idle()
                await self._poll()
                await self._poll_kept()
            except StorageError:
                logger.warning("cluster.maintain node=%s: the database failed", self.node_id)
            await anyio.sleep(tick)  # the period of a background loop, not a synchronisation
            since_beat += tick

    async def _renew(self) -> None:
        """Extend every lease this node holds, active or kept in grace, in one statement; a
        lease found lost (taken over after a stall) is dropped here at once."""
        held = dict(self.leases)
        for sid in await self.pg.renew(held):
            if self.leases.get(sid) == held[sid]:
                self._lost(sid)

    async def _release_idle(self) -> None:
        """Let go the kept leases whose grace has passed (the session idle, nothing queued).

        The lease is dropped locally in the same step as the check that the session is still
        idle, before the statement: a prompt arriving meanwhile no longer counts on it and
        takes the lease again through the database, where it waits for this release. A
        release refused because prompts are queued keeps the lease, and the worker is woken
        to insert them."""
        now = anyio.current_time()
        due = [sid for sid, since in self.idle_since.items() if now - since >= self.lease_grace]
        for sid in due:
            if sid not in self.idle_since or sid not in self.leases:
                continue  # worked on again meanwhile (this loop awaits)
            del self.idle_since[sid]
            epoch = self.leases.pop(sid)
            try:
                released = await self.pg.release(sid, epoch)
            except StorageError:
                released = False
            if released:
                self.backlog.discard(sid)
                self.counters["leases_released"] += 1
                logger.info("lease.released session=%s node=%s", sid, self.node_id)
            elif sid not in self.leases:
                # prompts are queued (or the database failed): still ours, work on them
                self.leases[sid] = epoch
                self._wake(sid)

    async def _poll_kept(self) -> None:
        """Wake the held sessions kept idle whose queue has prompts (a wake-up NOTIFY lost)."""
        idle = [sid for sid in self.idle_since if sid not in self.backlog]
        if not idle:
            return
        for sid in await self.pg.queued_sessions(idle):
            if sid in self.idle_since:
                self._wake(sid)

    async def _poll(self) -> None:
        rows = list(self._waiting)
        if not rows:
            return
        for outcome in await self.pg.outcomes(rows):
            if outcome.state != "queued":
                self._outcome(outcome)
            elif outcome.lease_free:
                pending = self._waiting.get(outcome.row)
                if pending is not None:
                    await self._take_over(pending.session_id)

    async def _take_over(self, sid: str) -> None:
        """The owner of a session we wait on died: take its lease and insert the queue."""
        if self._events is None or sid in self.leases:
            return
        owned = await self.pg.take(sid)
        if owned is None:
            return
        self._took(sid, owned.epoch)
        if owned.took_over:
            await self._recover(sid, locked=False)
        self._events.wake(sid)

    async def _publisher(self) -> None:
        while True:
            await self._publish_ready.wait()
            self._publish_ready = anyio.Event()
            try:
                await self._flush()
            except StorageError:
                logger.warning("cluster.publish node=%s: updates not sent", self.node_id)

    async def _flush(self) -> None:
        while self._publish:
            batch = [self._publish.popleft() for _ in range(min(len(self._publish), 200))]
            await self.pg.publish(batch)


class _LeaseGone(BaseException):
    """Raised through the inbox's insert pipeline (which answers every `Exception` as a
    failure) when the fence refused the insert of a prompt placed under a kept lease that
    was lost: nothing was written, and `place` decides again where the prompt goes."""


class _Row:
    """The `Ticket` of a prompt of this node that waits on a queued row."""

    __slots__ = ("_c", "pending", "row")

    def __init__(self, coordinator: PostgresCoordinator, row: int, pending: PendingPrompt) -> None:
        self._c = coordinator
        self.row = row
        self.pending = pending

    def withdraw(self, error: AcpError | None) -> bool:
        """Withdraw the row on every node ($/cancel_request, session/cancel): False when the
        prompt no longer waits on it. Insertion wins a race (R27)."""
        if self._c._rows.get(self.pending) != self.row:
            return False
        self._c._spawn(self._c._withdraw_row, self.row, error)
        return True

    def release(self) -> None:
        """The last local request waiting on the row went away with its connection (D11), or
        the inbox refused the prompt: this node stops waiting; the row is dropped when no node
        waits any more."""
        if self._c._rows.pop(self.pending, None) is None:
            return
        self._c._waiting.pop(self.row, None)
        self._c._spawn(self._c.pg.detach, self.row)


def _content(pending: PendingPrompt) -> bytes:
    return orjson.dumps(pending.wire)
