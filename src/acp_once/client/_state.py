"""What `AcpClient` keeps per session and per submission (shared with its faces,
`acp_once.client.faces`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from acp_once.client.history import TurnLedger
from acp_once.client.outbox import Submission
from acp_once.client.turns import PromptHandle, UpdateCallback
from acp_once.protocol import schema as s

__all__ = ["Job", "SessionState"]

_MAX_MISSED = 10_000
"""Missed updates a replay passes on at most (the oldest are dropped first)."""


@dataclass(eq=False)
class Job:
    """One submission on its way: sent by its session's sender until an answer is definite."""

    submission: Submission
    done: anyio.Event = field(default_factory=anyio.Event)
    message_id: str | None = None
    error: BaseException | None = None
    attempts: int = 0
    handle: PromptHandle | None = None  # the application's handle (none for a recovered one)
    local_id: str | None = None  # v1: the id the client gives the prompt (no agent id exists)


@dataclass(eq=False)
class SessionState:
    """One session of the client: its queue of submissions and who hears its updates."""

    session_id: str
    cwd: str
    queue: list[Job] = field(default_factory=list)
    jobs: dict[str, Job] = field(default_factory=dict)
    wake: anyio.Event = field(default_factory=anyio.Event)
    subscribers: list[MemoryObjectSendStream[s.UpdateSessionNotification]] = field(
        default_factory=list
    )
    callbacks: list[UpdateCallback] = field(default_factory=list)
    handles: list[PromptHandle] = field(default_factory=list)
    # set once the previous `prompt()` call's submission is in the outbox and queued: calls
    # are written and sent in the order they were made
    added: anyio.Event = field(default_factory=anyio.Event)
    # v1: a session/load runs; the history it replays was seen live and is not passed on
    replaying: bool = False
    # the turns this client knows of, and how they ended (`acp_once.client.history`)
    ledger: TurnLedger = field(default_factory=TurnLedger)
    # the last resume replayed the history into the ledger
    history_resumed: bool = False
    # during a replay: the replayed updates after the last one the application saw live
    missed: list[s.UpdateSessionNotification] | None = None
    sending: Job | None = None  # the submission the session's sender is sending

    def __post_init__(self) -> None:
        self.added.set()

    def needs_history(self) -> bool:
        """Whether a resume must replay the history: a prompt of this session may have been
        inserted on a connection that is gone, and its turn may have ended since."""
        jobs = [*self.queue, *([self.sending] if self.sending is not None else [])]
        return bool(self.handles) or any(job.attempts > 0 for job in jobs)

    def take_replayed(self, params: s.UpdateSessionNotification) -> None:
        """One update of a replay under way: to the ledger, and kept when the application
        has not seen it (it follows the last update the application saw live)."""
        if self.ledger.take(params.update):
            self.missed = []  # seen up to here: what follows was missed
        elif self.missed is not None:
            self.missed.append(params)
            if len(self.missed) > _MAX_MISSED:
                del self.missed[: _MAX_MISSED // 2]

    async def resume(
        self,
        request: Callable[[str, dict[str, Any]], Awaitable[Any]],
        *,
        replay: bool,
        deliver: Callable[[s.UpdateSessionNotification], Awaitable[None]] | None = None,
    ) -> None:
        """Send `session/resume` for this session through `request`.

        With `replay`, the agent replays the history from the start: it goes to the ledger,
        and every handle whose turn the ledger knows ended ends now. The application gets
        (through `deliver`) only what follows the last update it saw live, what it missed
        while away; a client that saw nothing of the session passes nothing on. Without
        `replay`, the handles take the state the agent reports next as the end of a turn they
        may have missed.

        Raises:
            AcpError: the agent's answer (e.g. `SessionNotFound`).
            TransportError: the connection was lost.
        """
        params: dict[str, Any] = {"sessionId": self.session_id, "cwd": self.cwd}
        if not replay:
            self.history_resumed = False
            for handle in list(self.handles):
                handle._reconnected()  # before the resume's state report, which may end a turn
            await request("session/resume", params)
            return
        params["replayFrom"] = {"type": "start"}
        self.ledger.begin_replay()
        self.missed = None
        try:
            await request("session/resume", params)
        finally:
            self.ledger.end_replay()
            missed: list[s.UpdateSessionNotification] = self.missed or []
            self.missed = None
        if missed and getattr(missed[-1].update, "session_update", None) == "state_update":
            missed.pop()  # the resume's snapshot: the ledger has taken it
        self.history_resumed = True
        for handle in list(self.handles):
            handle._history_learned()
        if deliver is not None:
            for update in missed:
                await deliver(update)
        for handle in list(self.handles):
            self.settle(handle)

    def settle(self, handle: PromptHandle) -> None:
        """End `handle` if the ledger knows its turn ended; begin it with the history the
        ledger holds if it saw its message inserted."""
        message_id = handle.message_id
        if message_id is None or handle.done:
            return
        end = self.ledger.ended(message_id)
        if end is not None:
            handle._end_known(end.stop_reason, end.error, self.ledger.replayed(message_id))
        elif self.ledger.known(message_id):
            handle._begin_known(self.ledger.replayed(message_id))
