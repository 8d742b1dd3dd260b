"""What `AcpClient` keeps per session and per submission (shared with its faces,
`acp_once.client.faces`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
from anyio.streams.memory import MemoryObjectSendStream

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

    def __post_init__(self) -> None:
        self.added.set()
