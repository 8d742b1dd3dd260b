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
    sending: Job | None = None  # the submission the session's sender is sending

    def __post_init__(self) -> None:
        self.added.set()

    def needs_history(self) -> bool:
        """Whether a resume must replay the history: a prompt of this session may have been
        inserted on a connection that is gone, and its turn may have ended since."""
        jobs = [*self.queue, *([self.sending] if self.sending is not None else [])]
        return bool(self.handles) or any(job.attempts > 0 for job in jobs)

    async def resume(
        self, request: Callable[[str, dict[str, Any]], Awaitable[Any]], *, replay: bool
    ) -> None:
        """Send `session/resume` for this session through `request`.

        With `replay`, the agent replays the history from the start: it goes to the ledger,
        not to the application (which saw it live), and every handle whose turn the ledger
        knows ended ends now. Without, the handles take the state the agent reports next as
        the end of a turn it may have missed.

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
        try:
            await request("session/resume", params)
        finally:
            self.ledger.end_replay()
        self.history_resumed = True
        for handle in list(self.handles):
            handle._history_learned()
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
