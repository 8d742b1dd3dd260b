"""How a `SessionAgent` shares its sessions: the `Coordinator` strategy and the local one.

The runtime (`acp_once.agent.runtime`) decides *what* happens to a prompt (the key lookup,
whether it would be held, the answer); a coordinator decides *where* it waits and *who*
inserts it:

* `LocalCoordinator` (the default): one process owns its sessions. A prompt that arrives
  during a turn (hold policy) waits in the session's in-memory queue and the session's worker
  inserts it after the turn; everything else is inserted at once.
* `acp_once.cluster.PostgresCoordinator`: several nodes on one PostgreSQL store, with session
  leases, fencing tokens, prompts queued in the database and updates shared by NOTIFY.

A coordinator reaches the runtime only through `SessionHost`, the small set of operations the
runtime offers it; it changes a `Session` or a `PendingPrompt` only through their methods.
Every coordinator passes the shared contract suite in `tests/agent/test_coordinator_contract.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from acp_once.storage.base import InsertOutcome, SessionStore

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from acp_once.agent.state import PendingPrompt, Session, Turn
    from acp_once.protocol.errors import AcpError

__all__ = ["Coordinator", "LocalCoordinator", "SessionHost"]


class SessionHost(Protocol):
    """What the runtime offers a coordinator (implemented inside `SessionAgent`)."""

    @property
    def store(self) -> SessionStore:
        """The store the agent uses (the coordinator's `wrap_store` view)."""
        ...

    @property
    def policy(self) -> str:
        """ "hold" or "steer" (see `SessionAgent`)."""
        ...

    @property
    def compare_prompts(self) -> bool:
        """Whether a recorded key sent with another prompt is refused (see `SessionAgent`)."""
        ...

    @property
    def name(self) -> str:
        """The agent's name, for status reports."""
        ...

    def session(self, session_id: str) -> Session | None:
        """The session if this process has it loaded."""
        ...

    def sessions(self) -> list[Session]:
        """Every session this process has loaded."""
        ...

    async def insert(self, session: Session, pending: PendingPrompt) -> None:
        """Store `pending` as a user message (under the session's lock) and settle it; its
        turn is queued on success. Never raises for a store failure: `pending` is answered
        with the error instead."""
        ...

    def start_worker(self, session: Session) -> None:
        """Make sure the session's worker runs (it runs turns, then asks the coordinator for
        the next prompt)."""
        ...

    async def handle_unfinished(self, session: Session, unfinished: list[Turn]) -> None:
        """Run again or report as interrupted the turns an earlier owner left unfinished."""
        ...

    async def find_unfinished(self, session: Session) -> list[Turn]:
        """The session's inserted messages whose turn never finished (from the store)."""
        ...

    async def cancel_work(self, session: Session) -> None:
        """What `session/cancel` does, for a cancel that came from elsewhere."""
        ...

    def reuses_key(self, recorded: bytes | None, pending: PendingPrompt) -> bool:
        """Whether `pending` must be refused because its key is recorded (or queued) with the
        digest `recorded` of another prompt (D4; None: nothing to compare)."""
        ...

    def is_live_only(self, prompt: list[Any]) -> bool:
        """Whether the prompt is a locally handled command (not stored)."""
        ...


class Coordinator(Protocol):
    """A strategy for where prompts wait and who inserts them (see the module docstring).

    Every method that takes a `Session` is called by the runtime; those marked "under the
    session's lock" are called with `session.lock` held.
    """

    def wrap_store(self, store: SessionStore) -> SessionStore:
        """The store the agent uses from now on (a coordinator may fence its writes)."""
        ...

    async def start(self, host: SessionHost, tg: TaskGroup) -> None:
        """Start background work in the agent's task group `tg` (the agent is entered)."""
        ...

    async def stop(self) -> None:
        """The agent is leaving: release what this process holds. Bounded; never raises."""
        ...

    async def status(self) -> dict[str, Any]:
        """What `/ops/status` shows."""
        ...

    async def admit(self, session: Session, pending: PendingPrompt, *, hold: bool) -> None:
        """A new prompt (registered under its key): insert it now, or make it wait (`hold`
        says the runtime would hold it on one node). Under the session's lock. Failures
        answer `pending` with an error; never raises for them."""
        ...

    async def insert_message(
        self,
        store: SessionStore,
        session_id: str,
        pending: PendingPrompt,
        *,
        message_id: str,
        update: bytes,
    ) -> InsertOutcome:
        """Write `pending` as the user message `message_id` with its key, in one transaction
        (the runtime's insert calls this; errors are the store's)."""
        ...

    def may_stop(self, session: Session) -> bool:
        """The worker ran out of turns: True when it may stop without taking the lock
        (nothing can be waiting for insertion)."""
        ...

    async def insert_next(self, session: Session) -> bool:
        """The worker ran out of turns: insert the next waiting prompt (True), or release what
        the session holds and let the worker stop (False). Under the session's lock."""
        ...

    def withdraw(self, session: Session, pending: PendingPrompt, error: AcpError | None) -> bool:
        """Withdraw a held prompt the coordinator keeps elsewhere (True), or leave it to the
        runtime (False). Insertion wins a race (R27)."""
        ...

    def detach(self, session: Session, pending: PendingPrompt) -> bool:
        """The last local request for a held prompt went away with its connection (D11):
        True when the coordinator dealt with it, False to let the runtime withdraw it."""
        ...

    async def cancel_session(self, session: Session) -> None:
        """`session/cancel` or `session/close`: withdraw what waits elsewhere."""
        ...

    async def recover(self, session: Session, unfinished: list[Turn]) -> None:
        """A session loaded from the store has `unfinished` turns from an earlier process:
        deal with them where this process may (`host.handle_unfinished`)."""
        ...

    def running_elsewhere(self, session_id: str) -> bool:
        """Another process reported the session running (the resume snapshot)."""
        ...

    def publish(self, session_id: str, update: dict[str, Any]) -> None:
        """An update for the session's connections in other processes. Never blocks."""
        ...


class LocalCoordinator:
    """One process alone: held prompts wait in memory, nothing is shared."""

    def __init__(self) -> None:
        self._host: SessionHost | None = None

    def wrap_store(self, store: SessionStore) -> SessionStore:
        return store

    async def start(self, host: SessionHost, tg: TaskGroup) -> None:
        self._host = host

    async def stop(self) -> None:
        return None

    async def status(self) -> dict[str, Any]:
        host = self._host
        sessions = [] if host is None else host.sessions()
        return {
            "node": host.name if host is not None else "local",
            "nodes": [
                {
                    "node": "local",
                    "alive": True,
                    "sessions_owned": sum(1 for x in sessions if x.worker),
                    "prompts_held": sum(len(x.held) for x in sessions),
                    "dedup_hits": None,  # counted by the cluster only (it is on the hot path)
                }
            ],
        }

    async def admit(self, session: Session, pending: PendingPrompt, *, hold: bool) -> None:
        if hold:
            session.held.append(pending)
        else:
            assert self._host is not None, "use SessionAgent as an async context manager"
            await self._host.insert(session, pending)

    async def insert_message(
        self,
        store: SessionStore,
        session_id: str,
        pending: PendingPrompt,
        *,
        message_id: str,
        update: bytes,
    ) -> InsertOutcome:
        return await store.insert_user_message(
            session_id,
            message_id=message_id,
            update=update,
            idempotency_key=pending.key,
            prompt_digest=pending.digest if pending.key is not None else None,
        )

    def may_stop(self, session: Session) -> bool:
        return not session.held and not session.lock.locked()

    async def insert_next(self, session: Session) -> bool:
        if not session.held:
            return False
        assert self._host is not None
        await self._host.insert(session, session.held.popleft())
        return True

    def withdraw(self, session: Session, pending: PendingPrompt, error: AcpError | None) -> bool:
        return False

    def detach(self, session: Session, pending: PendingPrompt) -> bool:
        return False

    async def cancel_session(self, session: Session) -> None:
        return None

    async def recover(self, session: Session, unfinished: list[Turn]) -> None:
        assert self._host is not None
        await self._host.handle_unfinished(session, unfinished)

    def running_elsewhere(self, session_id: str) -> bool:
        return False

    def publish(self, session_id: str, update: dict[str, Any]) -> None:
        return None
