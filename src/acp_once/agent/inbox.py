"""`SessionInbox`: one session's keyed prompts, from their arrival to the store's commit.

Everything the key rules promise (R18-R41, docs/rules.md) happens here, between "a
`session/prompt` arrives" and "the store committed it":

- the key tables: prompts pending by key (concurrent requests with one new key become one
  pending prompt, R20, R24), prompts held behind a turn, keys of live-only messages (R36);
- the prompt-digest rule: a recorded (or pending) key sent with another prompt is refused
  -32602 when `compare_prompts` is on (R23);
- `submit`: the lookup, joining, holding or placing of one request, and its answer;
- withdrawal (`$/cancel_request` on any request of a prompt, R25-R27), `session/cancel`'s
  cancel-all (R28), and a connection's last request gone (D11);
- the insert pipeline: one transaction for the message and its key, the lookup after a failed
  or refused insert (a commit whose answer was lost, another node's insert), and the
  cancellation rules (a cancellation in the insert or the admission ends the prompt -32800
  with its key unused).

The inbox is the only writer of a pending prompt and of the held queue. It calls its
`Placement` (`acp_once.agent.placement`) to learn where a prompt waits, and reports outward
only through what it is given: the `after_insert` hook and its session's `InboxListener` (the
`TurnRunner`: the session broadcast, "inserted"). It never calls the runtime.

Concurrency: state changes happen without awaiting in between, or under the session's lock
around the store write; "inserted" (the store commit) is the point after which a prompt can no
longer be withdrawn.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import orjson

from acp_once.agent.placement import HELD, INSERTED, Attached, Placement, Recorded, Refused
from acp_once.agent.state import (
    QUEUED,
    KeyJoin,
    PendingPrompt,
    SessionLock,
    Turn,
    marker,
    new_id,
)
from acp_once.protocol.errors import (
    AcpError,
    InternalError,
    RequestCancelled,
    key_reused,
)
from acp_once.storage.base import FencingError, InsertOutcome, KeyRecord

if TYPE_CHECKING:
    from acp_once.rpc.connection import RequestContext

__all__ = ["InboxListener", "InboxRules", "SessionInbox"]

logger = logging.getLogger("acp_once.agent")

_LANDED_TIMEOUT = 10.0  # seconds: looking up whether a failed insert was stored, shielded
_LANDED_WINDOW = 100  # timeline entries searched for an unkeyed message after a failed insert


class InboxListener(Protocol):
    """What an inbox reports to (its session's `TurnRunner`)."""

    running: bool
    """A worker runs the session's turns (a prompt arriving now would be held)."""

    publish: Callable[[dict[str, Any]], Awaitable[None]]
    """The session broadcast: sends a new user message's update."""

    def inserted(self, turn: Turn) -> None:
        """A user message was committed: queue its turn and make sure the worker runs."""
        ...

    def busy(self) -> bool:
        """A turn runs or waits to run (a message inserted now is queued behind it)."""
        ...

    def start(self) -> None:
        """Make sure the worker runs (it asks `SessionInbox.next` for work when idle)."""
        ...


@dataclass(slots=True)
class InboxRules:
    """What every inbox of one agent shares: its placement and its key settings."""

    placement: Placement
    hold: bool
    """The hold policy: a prompt that arrives during a turn waits for it ("steer": inserted)."""
    compare_prompts: bool
    live_only: Callable[[list[Any]], bool]
    """Whether a prompt is a locally handled command: echoed live, not stored."""
    after_insert: Callable[[str, str], Awaitable[None]]
    """Called right after a user message is committed, before anyone is answered."""


class SessionInbox:
    """One session's key tables and insert pipeline (see the module docstring)."""

    __slots__ = (
        "_listener",
        "_placement",
        "_rules",
        "cancel_marks",
        "held",
        "live_keys",
        "lock",
        "pending_by_key",
        "session_id",
    )

    def __init__(self, session_id: str, rules: InboxRules, listener: InboxListener) -> None:
        self.session_id = session_id
        self.lock = SessionLock()
        self.pending_by_key: KeyJoin[str, PendingPrompt] = KeyJoin()
        # a list, not a deque: few prompts are held at once, and a session's empty deque
        # would be ~0.8 KiB of every idle session
        self.held: list[PendingPrompt] = []
        self.live_keys: dict[str, str] = {}
        self.cancel_marks: dict[str, int] = {}
        """Per connection: arrival seq of its latest session/cancel or session/close (D33)."""
        self._rules = rules
        self._placement = rules.placement
        self._listener = listener

    def empty(self) -> bool:
        """Nothing waits here: no pending or held prompt, live key, cancel mark or lock holder."""
        return not (
            self.held
            or self.pending_by_key
            or self.live_keys
            or self.cancel_marks
            or self.lock.locked()
        )

    # -- submit ----------------------------------------------------------------------------

    def covered(self, conn_id: str, request: RequestContext | None) -> bool:
        """A session/cancel or session/close that arrived after `request` covers it."""
        if request is None:
            return False
        return self.cancel_marks.get(conn_id, -1) > request.seq

    def would_hold(self) -> bool:
        """A prompt arriving now is held: a turn runs (hold policy), or others wait already."""
        return (self._listener.running and self._rules.hold) or bool(self.held)

    async def submit(
        self,
        prompt: list[Any],
        wire: list[dict[str, Any]],
        key: str | None,
        digest: bytes | None,
        conn_id: str,
        request: RequestContext | None,
    ) -> str:
        """Submit one `session/prompt` request; return the message id it is answered with.

        `digest` is the prompt's `wire_digest` (keyed prompts only). No timeout: a held prompt
        may wait as long as the turn before it runs. The wait ends with insertion, a
        withdrawal ($/cancel_request, session/cancel, session/close), or the end of the
        connection, which cancels the caller.

        Raises:
            AcpError: the request's outcome: -32800 (withdrawn or cancelled, the key unused),
                -32602 (the key is recorded with another prompt), -32603 (not stored).
        """
        pending: PendingPrompt | None = None
        async with self.lock:
            hold = self.would_hold()
            if key is not None:
                recorded = self.live_keys.get(key)
                if recorded is not None:
                    return recorded
                pending = self.pending_by_key.get(key)
                if pending is None and (
                    hold or self._rules.live_only(prompt) or self.covered(conn_id, request)
                ):
                    # It would be held (or not stored): look for an inserted message first, so
                    # a retry of it is answered now instead of queued. A prompt inserted at
                    # once needs no lookup: the store's insert answers for a recorded key.
                    # Covered by a session/cancel that arrived after it, a retry of a key in
                    # use gets its id too: -32800 would say the key is unused (R19).
                    found = await self._placement.store.find_key(self.session_id, key)
                    if found is not None:
                        self._check_digest(found.prompt_digest, digest)
                        return found.message_id
                    pending = self.pending_by_key.get(key)  # the lookup awaited
                    hold = self.would_hold()
            if pending is None and self.covered(conn_id, request):
                # no await from this check to the queueing below: a session/cancel or close
                # that ran while this waited for the lock or the lookup is seen here (D33). A
                # request joining a pending prompt gets that prompt's outcome, which a cancel
                # decides for every request of the key alike (R26, R27).
                raise RequestCancelled("The prompt was cancelled before insertion")
            if pending is not None:
                self._check_digest(pending.digest, digest)
                pending.waiters.append((conn_id, request))
            else:
                pending = PendingPrompt(self.session_id, prompt, key, wire, _digest=digest)
                pending.waiters.append((conn_id, request))
                if key is not None:
                    self.pending_by_key[key] = pending
                try:
                    await self._place(pending, hold)
                except BaseException:
                    self._abandon(pending)
                    raise
        # Inserted at once (the common case): answer now, without a trip through the event
        # loop, and with no cancel callback (a cancel of an answered prompt changes nothing,
        # R27).
        if pending.state != "done":
            if request is not None:
                request.on_cancel(lambda: self.withdraw(pending))
            await pending.done.wait()
        if pending.error is not None:
            raise pending.error
        assert pending.message_id is not None
        return pending.message_id

    async def _place(self, pending: PendingPrompt, hold: bool) -> None:
        """Ask the placement where `pending` waits, and record its verdict. Under the lock."""
        placement = self._placement
        try:
            placed = await placement.place(
                pending,
                self._insert,
                hold=hold,
                busy=self._listener.running and self._rules.hold,
            )
        finally:
            # also when this request is cancelled in its insert: a claim (lease) held with no
            # worker would be kept for ever, and prompts queued elsewhere would wait on a
            # wake-up alone (no await here: safe in a finally)
            if placement.holds(self.session_id):
                self._listener.start()
        if placed is INSERTED:
            return
        if placed is HELD:
            self.held.append(pending)
        elif isinstance(placed, Attached):
            self._attach(pending, placed)
        elif isinstance(placed, Recorded):
            self._answer_recorded(pending, placed.message_id, placed.digest)
        elif isinstance(placed, Refused):
            self.settle(pending, error=placed.error)

    def _attach(self, pending: PendingPrompt, placed: Attached) -> None:
        ticket = placed.ticket
        if placed.digest is not None and self._reuses_key(placed.digest, pending.digest):
            # its key is queued elsewhere with another prompt
            if ticket is not None:
                ticket.release()
            self.settle(pending, error=key_reused())
        elif placed.joined is not None:
            # this process already waits on that prompt: its requests wait there too, and
            # the outcome comes for both (`PlacementEvents.settle`)
            placed.joined.waiters.extend(pending.waiters)
            pending.waiters.clear()
        else:
            pending.ticket = ticket
            self.held.append(pending)

    def _answer_recorded(
        self, pending: PendingPrompt, message_id: str, digest: bytes | None
    ) -> None:
        if self._reuses_key(digest, pending.digest):
            self.settle(pending, error=key_reused())
        else:
            self.settle(pending, message_id=message_id)

    def forget(self, pending: PendingPrompt) -> None:
        """Nobody inserted the prompt `pending` waited on elsewhere (its queuing node died):
        it waits nowhere until `resubmit` places it again."""
        with contextlib.suppress(ValueError):
            self.held.remove(pending)
        self._unregister(pending)
        pending.ticket = None

    async def resubmit(self, pending: PendingPrompt) -> None:
        """Place again a prompt `forget` let go of: it is the client's retry, which inserts
        it once."""
        if not pending.waiters or pending.state == "done":
            self.settle(pending, error=RequestCancelled("The connection closed"))
            return
        async with self.lock:
            if pending.key is not None:
                self.pending_by_key[pending.key] = pending
            try:
                await self._place(pending, hold=False)
            except Exception:
                logger.exception("session %s: submitting a prompt again failed", self.session_id)
                self.settle(pending, error=InternalError("The message could not be stored"))

    def _reuses_key(self, recorded: bytes | None, digest: bytes | None) -> bool:
        """Whether a prompt whose digest is `digest` must be refused because its key is
        recorded (or queued) with the digest `recorded` of another prompt (R23, when
        `compare_prompts` is on; None: no digest to compare)."""
        return (
            self._rules.compare_prompts
            and recorded is not None
            and digest is not None
            and recorded != digest
        )

    def _check_digest(self, recorded: bytes | None, digest: bytes | None) -> None:
        if self._reuses_key(recorded, digest):
            raise key_reused()

    # -- withdrawal ------------------------------------------------------------------------

    def settle(
        self,
        pending: PendingPrompt,
        *,
        message_id: str | None = None,
        error: AcpError | None = None,
    ) -> None:
        """Forget `pending` and answer every request waiting for it."""
        with contextlib.suppress(ValueError):
            self.held.remove(pending)
        self._unregister(pending)
        pending.finish(message_id=message_id, error=error)

    def answer(
        self, pending: PendingPrompt, message_id: str | None, same_prompt: bool | None
    ) -> None:
        """A prompt that waited elsewhere was inserted or found recorded there (`same_prompt`
        False: with another prompt, refused when `compare_prompts` is on)."""
        if same_prompt is False and self._rules.compare_prompts:
            self.settle(pending, error=key_reused())
        elif message_id is not None:
            self.settle(pending, message_id=message_id)
        else:
            self.settle(pending, error=key_reused())

    def withdraw(self, pending: PendingPrompt, error: AcpError | None = None) -> None:
        """Withdraw a prompt not inserted yet; -32800 (or `error`) for every request waiting
        for it (R25, R26). Once inserting, insertion wins (R27)."""
        if pending.state != "held":
            return
        if pending.ticket is not None and pending.ticket.withdraw(error):
            return  # kept elsewhere: withdrawn there, answered with its outcome
        self.settle(
            pending, error=error or RequestCancelled("The prompt was withdrawn before insertion")
        )

    def _abandon(self, pending: PendingPrompt) -> None:
        """Its admission was cancelled (the connection closed) or raised: a prompt registered
        by its key must still end. One neither queued nor being inserted is settled -32800
        with its key unused; nobody else waits on it (joining takes the session lock, which
        its admission holds). A queued or inserting one is left to its own outcome."""
        if pending.state == "held" and pending not in self.held:
            self.settle(
                pending, error=RequestCancelled("The prompt was cancelled before insertion")
            )

    def connection_gone(self, conn_id: str) -> None:
        """The connection `conn_id` closed: its requests no longer wait. A held prompt stays
        held while a request for it waits on a live connection; otherwise nobody can hear its
        answer, so it is withdrawn and its key stays unused (D11)."""
        self.cancel_marks.pop(conn_id, None)  # no request of it arrives any more
        for pending in list(self.held):
            pending.waiters = [w for w in pending.waiters if w[0] != conn_id]
            if pending.waiters:
                continue
            if pending.ticket is not None:
                pending.ticket.release()  # other processes may still wait on it
                self.settle(pending, error=RequestCancelled("The connection closed"))
            else:
                self.withdraw(pending)

    async def cancel_all(self) -> None:
        """`session/cancel` or `session/close`: every prompt received before it and not
        inserted is withdrawn, -32800 (R28), here and wherever it waits."""
        await self._placement.cancel(self.session_id)
        for pending in list(self.held):
            self.withdraw(pending)
        for key, pending in list(self.pending_by_key.items()):
            if pending.state == "held":
                self.withdraw(pending)
            else:
                self.pending_by_key.pop(key, None)

    # -- the worker's next prompt, recovery --------------------------------------------------

    def may_stop(self) -> bool:
        """The worker ran out of turns: True when it may stop without taking the lock
        (nothing can be waiting for insertion)."""
        return not (self.held or self.lock.locked() or self._placement.holds(self.session_id))

    def waiting(self) -> bool:
        """Prompts wait to be inserted (held here or elsewhere)."""
        return bool(self.held)

    async def next(self, has_turns: Callable[[], bool]) -> bool:
        """The worker ran out of turns: insert the next waiting prompt (True), or let the
        worker stop (False)."""
        async with self.lock:
            # whoever held the lock may have inserted a prompt meanwhile: its turn is the
            # worker's to run (starting a worker did nothing, this one runs)
            if has_turns():
                return True
            oldest = self.held[0] if self.held and self.held[0].ticket is None else None
            return await self._placement.next(self.session_id, oldest, self._insert)

    async def steer(self) -> None:
        """Steer policy: insert at once, even mid-turn, what waits elsewhere for the session."""
        async with self.lock:
            while await self._placement.next(self.session_id, None, self._insert, release=False):
                pass

    async def claim(self) -> bool:
        """Whether this process may deal with the session's unfinished turns now."""
        return await self._placement.claim(self.session_id)

    # -- the insert pipeline ---------------------------------------------------------------

    async def _insert(self, pending: PendingPrompt) -> None:
        """Insert under the session lock: the store commit is the point of no return."""
        if self.held and self.held[0] is pending:
            del self.held[0]
        pending.state = "inserting"
        message_id = new_id("msg_user")
        live_only = self._rules.live_only(pending.prompt)
        update = {
            "sessionUpdate": "user_message",
            "messageId": message_id,
            "content": pending.wire,
        }
        try:
            if live_only:
                if pending.key is not None:
                    self.live_keys[pending.key] = message_id
                inserted = True
            else:
                write = pending.write
                if write is None:
                    key = pending.key
                    outcome = await self._placement.store.insert_user_message(
                        self.session_id,
                        message_id=message_id,
                        update=orjson.dumps(update),
                        idempotency_key=key,
                        prompt_digest=pending.digest if key is not None else None,
                    )
                else:
                    outcome = await write(message_id, orjson.dumps(update))
                inserted = outcome.inserted
                message_id = outcome.message_id
        except anyio.get_cancelled_exc_class():
            # The connection that sent it closed, which cancels its handler here (a
            # `$/cancel_request` does not: `withdraw` leaves an inserting prompt alone, R27).
            # A store lets a cancellation out of its insert only before anything was
            # committed (`SessionStore.insert_user_message`; group commit withdraws a write
            # still queued), so the prompt was not inserted. It must still end, or a resend
            # of its key would join it and wait forever (D11): withdrawn, key unused.
            self._unregister(pending)
            pending.finish(error=RequestCancelled("The prompt was withdrawn before insertion"))
            raise
        except Exception as exc:
            if isinstance(exc, FencingError):  # a cluster race (lease moved, row withdrawn)
                logger.debug("session %s: insert refused (%s)", self.session_id, exc)
            else:
                logger.exception("session %s: storing a user message failed", self.session_id)
            # Refused or failed, the key may be recorded all the same: by this insert (its
            # commit landed, its answer was lost), or by the node that took the session over
            # while this one stalled (a fencing refusal). An error would tell the client the
            # key is unused (R19); a read needs no lease, so look.
            found = await self._find_after_failure(pending, message_id)
            if found is None:
                self._unregister(pending)
                pending.finish(error=InternalError("The message could not be stored"))
                return
            # The store failed but the message is there: the commit landed and only its answer
            # was lost (a connection cut at COMMIT), or another process inserted this key.
            inserted = found.message_id == message_id
            outcome = InsertOutcome(found.message_id, inserted, found.prompt_digest)
            message_id = found.message_id
        self._unregister(pending)
        if not inserted:
            # The key was recorded already (by an earlier attempt, or another process): answer
            # as a retry, or refuse a different prompt; nothing new was inserted (R19, R23).
            if self._reuses_key(outcome.prompt_digest, pending.digest):
                pending.finish(error=key_reused())
            else:
                pending.finish(message_id=message_id)
            return
        # Stored: from here on its turn must run and it must be answered, even if this handler
        # is cancelled (its connection closed) in one of the two awaits below. Otherwise the
        # message would stay stored with no work started, and a keyed retry would be answered
        # with its id as if all was well (R19). Once inserting, insertion wins (R27).
        # Queued behind a turn (the steer policy): its marker says so, so that a restart
        # before its turn starts runs it instead of reporting it interrupted (A3). Decided
        # once: the worker stores its STARTED marker before running a turn marked queued.
        queued = not live_only and self._listener.busy()
        announced = False
        try:
            try:
                await self._rules.after_insert(self.session_id, message_id)
            except Exception:  # a hook's failure is not the prompt's: it was inserted
                logger.exception("session %s: after_insert failed", self.session_id)
            if queued:
                await self._mark_queued(message_id)
            pending.finish(message_id=message_id)
            await self._listener.publish(update)
            if not self._listener.running:
                # No worker: this turn starts next. Its `running` goes out now, in the same
                # write as the answer, instead of in a write of its own when the worker
                # starts (a turn whose first update waits for a commit: a store other than
                # memory). `running` may precede the answer; it never precedes insertion.
                # Marked once sent: a publish cut short leaves it to the worker (twice is
                # harmless, never is not).
                await self._listener.publish({"sessionUpdate": "state_update", "state": "running"})
                announced = True
        finally:
            pending.finish(message_id=message_id)
            turn = Turn(
                self.session_id,
                message_id,
                pending.prompt,
                live_only,
                queued=queued,
                announced=announced,
            )
            self._listener.inserted(turn)

    async def _mark_queued(self, message_id: str) -> None:
        """Store the `QUEUED` marker of a message; without it (a failed write) a restart
        takes its turn for started, the side that never runs it twice."""
        try:
            await self._placement.store.append_update(self.session_id, marker(QUEUED, message_id))
        except Exception as exc:
            logger.warning(
                "session %s: the queued marker of %s was not stored (%s)",
                self.session_id,
                message_id,
                type(exc).__name__,
            )

    def _unregister(self, pending: PendingPrompt) -> None:
        """A later request with its key no longer joins `pending` (it has its outcome)."""
        if pending.key is not None:
            self.pending_by_key.drop(pending.key, pending)

    async def _find_after_failure(
        self, pending: PendingPrompt, message_id: str
    ) -> KeyRecord | None:
        """After an insert that raised or was refused: where the store has the message after
        all, its key's record (or, unkeyed, `message_id` itself); None if it is not stored or
        the lookup failed too.

        A failed insert may have committed (PostgreSQL's connection lost at COMMIT, an insert
        past its bound). Answering it with an error would leave a stored message whose turn
        runs only at the session's next recovery, while a keyed retry is answered with its id
        as if all was well. A keyed message is looked up by its key; an unkeyed one among the
        last entries of the timeline (this node holds the session lock: it is near the end).
        Shielded and bounded, as the insert itself: a cut connection must not stop it.
        """
        store = self._placement.store
        with anyio.move_on_after(_LANDED_TIMEOUT, shield=True):
            try:
                if pending.key is not None:
                    return await store.find_key(self.session_id, pending.key)
                tail = await store.read_timeline_tail(self.session_id, limit=_LANDED_WINDOW)
            except Exception as exc:  # its text could quote the key: only its type is logged
                logger.warning(
                    "session %s: after a failed insert, looking it up failed too (%s)",
                    self.session_id,
                    type(exc).__name__,
                )
                return None
            if any(entry.message_id == message_id for entry in tail):
                return KeyRecord(message_id, None)
        return None
