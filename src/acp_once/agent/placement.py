"""Where a session's prompts wait and who inserts them: the `Placement` strategy.

A session's `SessionInbox` (`acp_once.agent.inbox`) decides *what* happens to a prompt (the key
lookup, whether it would be held, the answer); a placement decides *where* it waits and *when*
it is inserted. Calls go one way: the inbox calls its placement, never the other way round; a
placement never changes a `PendingPrompt` or an inbox.

* `LocalPlacement` (the default): one process owns its sessions. A prompt that arrives during a
  turn (hold policy) is held in the inbox and inserted after the turn; everything else is
  inserted at once.
* `acp_once.cluster.PostgresCoordinator`: several nodes on one PostgreSQL store, with session
  leases, fencing tokens, prompts queued in the database and updates shared by NOTIFY. What
  it learns asynchronously (a queued prompt's outcome, a wake-up, a cancel or an update from
  another node) comes in through `PlacementEvents`, the one sink the runtime wires.

Every placement passes the shared contract suite in `tests/agent/test_placement_contract.py`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

if TYPE_CHECKING:
    from acp_once.agent.state import PendingPrompt, Ticket
    from acp_once.protocol.errors import AcpError
    from acp_once.storage.base import SessionStore

__all__ = [
    "HELD",
    "INSERTED",
    "Attached",
    "Insert",
    "LocalPlacement",
    "Placed",
    "Placement",
    "PlacementEvents",
    "Recorded",
    "Refused",
]

Insert = Callable[["PendingPrompt"], Awaitable[None]]
"""The inbox's insert pipeline, handed to the placement for the prompt it places (never
raises for a store failure: the prompt is answered with the error)."""

INSERTED: Final = "inserted"
"""`place`: inserted now, through the inbox's insert (answered, its turn queued)."""
HELD: Final = "held"
"""`place`: held in the inbox, in arrival order; `next` inserts it when the turn ends."""


@dataclass(frozen=True, slots=True)
class Attached:
    """`place`: the prompt waits elsewhere (`ticket`, `acp_once.agent.state.Ticket`); its
    outcome comes through the events.

    `digest` is the digest the key is queued with when the prompt joined a queued prompt of
    the same key (the inbox applies the prompt-digest rule to it), else None. `joined` is a
    prompt this node already waits on for that key: the requests move to it."""

    ticket: Ticket | None
    digest: bytes | None = None
    joined: PendingPrompt | None = None


@dataclass(frozen=True, slots=True)
class Recorded:
    """`place`: the key is recorded already (the message `message_id`, stored with `digest`)."""

    message_id: str
    digest: bytes | None


@dataclass(frozen=True, slots=True)
class Refused:
    """`place`: neither inserted nor queued (the store failed): answered with `error`, the key
    unused."""

    error: AcpError


Placed = Literal["inserted", "held"] | Attached | Recorded | Refused


class Placement(Protocol):
    """Where prompts wait and who inserts them (see the module docstring). Called only by the
    session's inbox; the members marked "under the session's lock" are called with it held."""

    @property
    def store(self) -> SessionStore:
        """The store view every write of the agent goes through (a cluster fences them)."""
        ...

    async def place(
        self, pending: PendingPrompt, insert: Insert, *, hold: bool, busy: bool
    ) -> Placed:
        """A new prompt (registered under its key): insert it now through `insert`, hold it,
        let it wait elsewhere, or answer it from its recorded key. `hold`: one process would
        hold it (a turn runs under the hold policy, or prompts are held already); `busy`: a
        turn runs under the hold policy. Under the session's lock."""
        ...

    async def next(
        self,
        session_id: str,
        oldest: PendingPrompt | None,
        insert: Insert,
        *,
        release: bool = True,
    ) -> bool:
        """The session's turns ran out: insert the next waiting prompt through `insert` (True),
        or let the worker stop (False; a cluster releases the session's lease). `oldest` is
        the prompt the inbox holds longest, if any. Not `release` (the steer policy, during a
        turn): only what waits elsewhere, and nothing is let go. Under the session's lock."""
        ...

    async def cancel(self, session_id: str) -> None:
        """`session/cancel` or `session/close`: withdraw what waits elsewhere for the session
        (outcomes come through the events). Never raises for a store failure."""
        ...

    async def claim(self, session_id: str) -> bool:
        """A session loaded with unfinished turns: whether this process may deal with them
        now (a cluster takes the session's lease first)."""
        ...

    def holds(self, session_id: str) -> bool:
        """Whether this process holds a claim on the session beyond its memory (a lease): its
        worker must ask `next` before stopping, and the session stays loaded."""
        ...


class PlacementEvents(Protocol):
    """What a shared placement learns asynchronously, delivered to the runtime (which routes
    each event to the session's inbox, runner or broadcast). Never blocks."""

    def settle(
        self,
        pending: PendingPrompt,
        *,
        message_id: str | None = None,
        error: AcpError | None = None,
        same_prompt: bool | None = None,
    ) -> None:
        """The outcome of a prompt that waited elsewhere: answer every request waiting for it
        (`same_prompt` False: its key was recorded with another prompt, which the inbox's
        prompt-digest rule may refuse)."""
        ...

    def resubmit(self, pending: PendingPrompt) -> None:
        """Nobody inserted the prompt it waited on (its queuing node died): submit it again."""
        ...

    def wake(self, session_id: str) -> None:
        """This process holds the session and prompts wait for it: work on them."""
        ...

    def cancelled(self, session_id: str) -> None:
        """`session/cancel` on another process: cancel the session's work here."""
        ...

    def update(self, session_id: str, update: dict[str, Any]) -> None:
        """An update another process sent: deliver it to this process's connections."""
        ...

    def lost(self, session_id: str) -> None:
        """The session's claim (lease) is gone: its turns can no longer write; stop them."""
        ...

    async def recover(self, session_id: str, *, locked: bool) -> int:
        """This process took the session over from a dead owner: run again or report its
        unfinished turns (how many it found), then work on what waits (`locked`: under the
        session's lock already)."""
        ...


class LocalPlacement:
    """One process alone: held prompts wait in the inbox, nothing is shared."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store

    async def place(
        self, pending: PendingPrompt, insert: Insert, *, hold: bool, busy: bool
    ) -> Placed:
        if hold:
            return HELD
        await insert(pending)
        return INSERTED

    async def next(
        self,
        session_id: str,
        oldest: PendingPrompt | None,
        insert: Insert,
        *,
        release: bool = True,
    ) -> bool:
        if oldest is None:
            return False
        await insert(oldest)
        return True

    async def cancel(self, session_id: str) -> None:
        return None  # nothing waits outside the inbox

    async def claim(self, session_id: str) -> bool:
        return True

    def holds(self, session_id: str) -> bool:
        return False
