"""What the session runtime keeps per session, shared by the runtime and its coordinators.

`Session` is one session's in-memory state (connections it is active on, the prompts waiting
to be inserted, the turns waiting to run, its worker); `PendingPrompt` is a prompt accepted but
not inserted yet with every request waiting for its outcome; `Turn` is one inserted user message
for `run_turn`. A coordinator (`acp_once.agent.coordinator`) changes these objects only through
their methods; the runtime owns the rest.

The retained turn markers (`marker`, `unfinished_turns`) let a restarted process, or a node that
took over a session, find the turns that never finished.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio
import orjson

from acp_once.protocol import schema as s

if TYPE_CHECKING:
    from acp_once.agent.connection import AgentSideConnection
    from acp_once.protocol.errors import AcpError
    from acp_once.rpc.connection import RequestContext
    from acp_once.storage.base import SessionRecord

__all__ = [
    "RECOVERY_WINDOW",
    "RECOVER_TIMEOUT",
    "TURN_MARKER",
    "PendingPrompt",
    "Session",
    "SessionLock",
    "Turn",
    "marker",
    "new_id",
    "prompt_digest",
    "unfinished_turns",
    "wire_digest",
]

TURN_MARKER = "_acp_once_turn"
"""The `sessionUpdate` of a retained marker, never replayed: did each message's turn finish?"""
RECOVERY_WINDOW = 500
"""Timeline entries read after a restart (or a takeover) to find unfinished turns."""
RECOVER_TIMEOUT = 60.0
"""Seconds allowed, shielded, for dealing with a session's interrupted turns."""


def new_id(prefix: str) -> str:
    """A fresh id for a session, message or tool call: `prefix`, "_", 32 hex digits.

    128 random bits, like a uuid4's hex, without building a `UUID` object on the hot path.
    """
    return f"{prefix}_{os.urandom(16).hex()}"


def prompt_digest(prompt: Sequence[Any]) -> bytes:
    """The 16-byte BLAKE2s digest of the canonical JSON of a prompt's content blocks (sorted
    keys, no spaces).

    Stored with the key so that a recorded key sent with a different prompt can be refused
    (D4); the request's `_meta` and the key itself are not part of it.
    """
    blocks = [
        b.model_dump(by_alias=True, exclude_unset=True) if hasattr(b, "model_dump") else b
        for b in prompt
    ]
    return wire_digest(blocks)


def wire_digest(blocks: list[dict[str, Any]]) -> bytes:
    """`prompt_digest` of content blocks already dumped to their wire form."""
    # BLAKE2s (CPython's own) costs ~3,200 instructions here, OpenSSL's SHA-256 ~7,900: most of
    # it is setting up the hash, not hashing a prompt of a few hundred bytes.
    return hashlib.blake2s(
        orjson.dumps(blocks, option=orjson.OPT_SORT_KEYS), digest_size=16
    ).digest()


class SessionLock:
    """A lock that is taken without a checkpoint when it is free (the common case).

    An anyio semaphore of one, not an `anyio.Lock`: a lock records its owner task, and on
    CPython 3.11 each `current_task()` it makes for that (one per acquire, one per release)
    is a Python call and a `getpid` system call. Waiters queue in FIFO order either way.
    """

    __slots__ = ("_sem",)

    def __init__(self) -> None:
        self._sem = anyio.Semaphore(1, fast_acquire=True)

    def locked(self) -> bool:
        return self._sem.value == 0

    async def __aenter__(self) -> None:
        try:
            self._sem.acquire_nowait()
        except anyio.WouldBlock:
            await self._sem.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self._sem.release()


@dataclass(eq=False)
class PendingPrompt:
    """A prompt accepted but not inserted yet, with every request waiting for its outcome.

    `queue_row` is set on a prompt taken from a coordinator's shared queue: the insert that
    stores it also settles that row (one transaction).
    """

    session_id: str
    prompt: list[Any]
    key: str | None
    wire: list[dict[str, Any]]  # the content blocks as sent on the wire (dumped once)
    waiters: list[tuple[str, RequestContext | None]] = field(default_factory=list)
    state: Literal["held", "inserting", "done"] = "held"
    message_id: str | None = None
    error: AcpError | None = None
    queue_row: int | None = None
    _digest: bytes | None = field(default=None, repr=False)
    _done: anyio.Event | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_wire(
        cls, session_id: str, wire: list[dict[str, Any]], key: str | None, digest: bytes
    ) -> PendingPrompt:
        """A prompt rebuilt from its stored wire content blocks (validated again)."""
        prompt = s.PromptRequest.model_validate({"sessionId": session_id, "prompt": wire}).prompt
        return cls(session_id, list(prompt), key, wire, _digest=digest)

    @property
    def digest(self) -> bytes:
        """`wire_digest` of the prompt, computed on first use: an unkeyed prompt on one node
        never needs it."""
        if self._digest is None:
            self._digest = wire_digest(self.wire)
        return self._digest

    @property
    def done(self) -> anyio.Event:
        """Set once the outcome is known. Made on first use: a prompt inserted at once is
        answered without ever waiting on it."""
        if self._done is None:
            self._done = anyio.Event()
            if self.state == "done":
                self._done.set()
        return self._done

    def finish(self, *, message_id: str | None = None, error: AcpError | None = None) -> None:
        """Record the outcome (the first one wins) and wake every waiter."""
        if self.state == "done":
            return
        self.state = "done"
        self.message_id = message_id
        self.error = error
        if self._done is not None:
            self._done.set()


@dataclass(eq=False)
class Turn:
    """One inserted user message for `run_turn` to work on."""

    session_id: str
    message_id: str
    prompt: list[Any]
    live_only: bool

    @property
    def text(self) -> str:
        """The prompt's text blocks, joined by newlines."""
        return "\n".join(b.text for b in self.prompt if isinstance(b, s.ContentBlockText))


@dataclass(eq=False)
class Session:
    """One session's state in this process."""

    record: SessionRecord
    conns: dict[str, AgentSideConnection] = field(default_factory=dict)
    lock: SessionLock = field(default_factory=SessionLock)
    pending_by_key: dict[str, PendingPrompt] = field(default_factory=dict)
    held: collections.deque[PendingPrompt] = field(default_factory=collections.deque)
    turns: collections.deque[Turn] = field(default_factory=collections.deque)
    live_keys: dict[str, str] = field(default_factory=dict)
    running: bool = False
    turn_scope: anyio.CancelScope | None = None
    worker: bool = False
    interrupted: bool = False
    cancel_marks: dict[str, int] = field(default_factory=dict)
    """Per connection: arrival seq of its latest session/cancel or session/close (D33)."""
    stopped: anyio.Event | None = None
    """Set when the running worker ends; made only when someone waits for that."""
    users: int = 0
    """Requests using the session while it is active on no connection (a `session/resume`
    between loading it and attaching): it must not be dropped from memory meanwhile."""
    id: str = field(init=False)
    """The session id (an attribute: read ~10 times per prompt turn)."""

    def __post_init__(self) -> None:
        self.id = self.record.session_id

    def forget(self, pending: PendingPrompt) -> None:
        """Drop `pending` from the prompts held here and from the key table."""
        with contextlib.suppress(ValueError):
            self.held.remove(pending)
        if pending.key is not None and self.pending_by_key.get(pending.key) is pending:
            del self.pending_by_key[pending.key]

    def settle(
        self,
        pending: PendingPrompt,
        *,
        message_id: str | None = None,
        error: AcpError | None = None,
    ) -> None:
        """Forget `pending` and answer every request waiting for it."""
        self.forget(pending)
        pending.finish(message_id=message_id, error=error)

    def idle(self) -> bool:
        """Nothing holds this session in memory: no connection, request, worker, prompt,
        turn, lock holder or cancel mark, and no interruption left to report. Such a session
        can be dropped from memory; it reloads from the store when resumed."""
        return not (
            self.conns
            or self.users
            or self.worker
            or self.held
            or self.pending_by_key
            or self.turns
            or self.live_keys
            or self.cancel_marks
            or self.interrupted
            or self.turn_scope is not None
            or self.lock.locked()
        )

    def stop_turns(self) -> None:
        """Drop the turns waiting to run and cancel the running one (the session's lease was
        lost: its turns can no longer write)."""
        self.turns.clear()
        if self.turn_scope is not None:
            self.turn_scope.cancel()


def marker(state: str, message_id: str) -> bytes:
    """The retained marker that says the turn of `message_id` reached `state`."""
    return orjson.dumps({"sessionUpdate": TURN_MARKER, "state": state, "messageId": message_id})


def unfinished_turns(session_id: str, tail: Sequence[Any]) -> list[Turn]:
    """The retained user messages in `tail` (timeline entries) whose turn never got its
    closing marker."""
    finished: set[str] = set()
    messages: list[tuple[str, list[Any]]] = []
    for entry in tail:
        update = orjson.loads(entry.update)
        kind = update.get("sessionUpdate")
        if kind == TURN_MARKER and update.get("state") == "idle":
            finished.add(str(update.get("messageId")))
        elif kind == "user_message" and entry.message_id is not None:
            messages.append((entry.message_id, update.get("content") or []))
    turns: list[Turn] = []
    for message_id, content in messages:
        if message_id in finished:
            continue
        prompt = s.PromptRequest.model_validate({"sessionId": session_id, "prompt": content}).prompt
        turns.append(Turn(session_id, message_id, list(prompt), live_only=False))
    return turns
