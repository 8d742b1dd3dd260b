"""The values the session runtime passes around: pending prompts, turns, turn markers.

`PendingPrompt` is a prompt accepted but not inserted yet with every request waiting for its
outcome (written only by its session's `SessionInbox`, `acp_once.agent.inbox`); `Turn` is one
inserted user message for `run_turn`; `SessionLock` is a session's lock.

How each inserted message's turn ended is part of the session's history: the runtime stores
its end record (`turn_end`: an idle `state_update` naming the message), replayed like any other
update. The end records and the private markers (`marker`) let a restarted process, or a node
that took over a session, find the turns that never ended (`unfinished_turns`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import anyio
import orjson

from acp_once.protocol import schema as s

if TYPE_CHECKING:
    from acp_once.protocol.errors import AcpError
    from acp_once.rpc.connection import RequestContext
    from acp_once.storage.base import InsertOutcome

__all__ = [
    "KeyJoin",
    "Outcome",
    "RECOVERY_WINDOW",
    "RECOVER_TIMEOUT",
    "QUEUED",
    "RERUN",
    "STARTED",
    "TURN_MARKER",
    "PendingPrompt",
    "SessionLock",
    "Ticket",
    "Turn",
    "Write",
    "ended_message",
    "last_end",
    "marker",
    "new_id",
    "prompt_digest",
    "turn_end",
    "unfinished_turns",
    "wire_digest",
]

K = TypeVar("K")
P = TypeVar("P", bound="Outcome")

TURN_MARKER = "_acp_once_turn"
"""The `sessionUpdate` of a private retained marker, never replayed (`marker`)."""
QUEUED = "queued"
"""The marker state stored when a message is inserted behind a turn that runs or waits: until
its `STARTED` marker, a restart knows its turn never started and simply runs it (A3)."""
STARTED = "started"
"""The marker state stored before the turn of a `QUEUED` message starts."""
RERUN = "rerun"
"""The marker state stored before an unfinished turn runs again (`resume_interrupted`): such a
turn runs again at most once; interrupted again, it is reported (A3)."""
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

    The semaphore is made the first time a task waits (held then, so of value 0) and is
    the lock from then on; until then a flag is (~0.8 KiB less for every session that never
    waited, which is most idle ones).
    """

    __slots__ = ("_held", "_sem")

    def __init__(self) -> None:
        self._held = False
        self._sem: anyio.Semaphore | None = None

    def locked(self) -> bool:
        sem = self._sem
        return self._held if sem is None else sem.value == 0

    def waiting(self) -> int:
        """How many tasks wait for the lock."""
        sem = self._sem
        return 0 if sem is None else sem.statistics().tasks_waiting

    async def __aenter__(self) -> None:
        sem = self._sem
        if sem is None:
            if not self._held:
                self._held = True
                return
            sem = self._sem = anyio.Semaphore(0, fast_acquire=True)  # held: wait for it
            await sem.acquire()
            return
        try:
            sem.acquire_nowait()
        except anyio.WouldBlock:
            await sem.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        sem = self._sem
        if sem is None:
            self._held = False
        else:
            sem.release()


class Outcome:
    """The outcome of one pending step that several requests wait on: a message id, or an
    error (`finish`; the first one wins). `PendingPrompt` is one; so are the pending steps of
    `PromptKeys` and `AdapterKeys`."""

    def __init__(self) -> None:
        self.state: str = "held"
        self.message_id: str | None = None
        self.error: BaseException | None = None
        self._done: anyio.Event | None = None

    @property
    def done(self) -> anyio.Event:
        """Set once the outcome is known. Made on first use: a prompt inserted at once is
        answered without ever waiting on it."""
        if self._done is None:
            self._done = anyio.Event()
            if self.state == "done":
                self._done.set()
        return self._done

    def finish(self, *, message_id: str | None = None, error: Any = None) -> None:
        """Record the outcome (the first one wins) and wake every waiter."""
        if self.state == "done":
            return
        self.state = "done"
        self.message_id = message_id
        self.error = error
        if self._done is not None:
            self._done.set()

    async def result(self) -> str:
        """Wait for the outcome: the message id, or its error raised."""
        if self.state != "done":
            await self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.message_id is not None
        return self.message_id


class KeyJoin(dict[K, P]):
    """Pending outcomes by key, the one join-by-key core of the key rules (R20, R22, R24):
    the first request for a key registers its outcome and does the work; a request for a key
    whose outcome is registered joins it and gets the same outcome, success or error; an error
    leaves the key unused (nothing recorded, the key unregistered). Used by `SessionInbox`
    (`pending_by_key`), `PromptKeys` and `AdapterKeys`; a table per scope of keys (a session,
    or `(session, key)` slots for every session)."""

    def drop(self, slot: K, outcome: P) -> None:
        """Unregister `outcome` from `slot` (a later request no longer joins it); a newer
        outcome registered there stays."""
        if self.get(slot) is outcome:
            del self[slot]

    async def run(self, slot: K, outcome: P, work: Callable[[], Awaitable[str]]) -> str:
        """Register `outcome` under `slot`, do `work`, and give its message id (or what it
        raised) to every request that joined; unregistered once it is known.

        Raises:
            BaseException: whatever `work` raised, to this request and to the joined ones.
        """
        self[slot] = outcome
        try:
            message_id = await work()
        except BaseException as exc:
            outcome.finish(error=exc)
            raise
        else:
            outcome.finish(message_id=message_id)
            return message_id
        finally:
            self.drop(slot, outcome)


class Ticket(Protocol):
    """A prompt that waits elsewhere (another node's queue): how its inbox lets go of it."""

    def withdraw(self, error: AcpError | None) -> bool:
        """Withdraw it everywhere (`$/cancel_request`, `session/cancel`): True when it still
        waited there (its outcome comes back through `PlacementEvents.settle`), False when it
        no longer does (the inbox answers it). Insertion wins a race (R27)."""
        ...

    def release(self) -> None:
        """Stop waiting on it here (its last local request is gone, or the inbox refused it);
        it is dropped when no node waits any more."""
        ...


Write = Callable[[str, bytes], Awaitable["InsertOutcome"]]
"""`(message_id, update) -> InsertOutcome`: how a prompt is written when not by the store
view's `insert_user_message` (a prompt from a shared queue settles its row in the same
transaction)."""


@dataclass(eq=False)
class PendingPrompt(Outcome):
    """A prompt accepted but not inserted yet, with every request waiting for its outcome.

    `ticket` is set on a prompt that waits elsewhere (a cluster's shared queue); `write` on one
    taken from such a queue (`Write`).
    """

    session_id: str
    prompt: list[Any]
    key: str | None
    wire: list[dict[str, Any]]  # the content blocks as sent on the wire (dumped once)
    waiters: list[tuple[str, RequestContext | None]] = field(default_factory=list)
    state: Literal["held", "inserting", "done"] = "held"
    message_id: str | None = None
    error: AcpError | None = None
    ticket: Ticket | None = None
    write: Write | None = None
    _digest: bytes | None = field(default=None, repr=False)
    _done: anyio.Event | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_wire(
        cls,
        session_id: str,
        wire: list[dict[str, Any]],
        key: str | None,
        digest: bytes,
        write: Write | None = None,
    ) -> PendingPrompt:
        """A prompt rebuilt from its stored wire content blocks (validated again)."""
        prompt = s.PromptRequest.model_validate({"sessionId": session_id, "prompt": wire}).prompt
        return cls(session_id, list(prompt), key, wire, write=write, _digest=digest)

    @property
    def digest(self) -> bytes:
        """`wire_digest` of the prompt, computed on first use: an unkeyed prompt on one node
        never needs it."""
        if self._digest is None:
            self._digest = wire_digest(self.wire)
        return self._digest


@dataclass(eq=False)
class Turn:
    """One inserted user message for `run_turn` to work on."""

    session_id: str
    message_id: str
    prompt: list[Any]
    live_only: bool
    reran: bool = False
    """An unfinished turn found after a restart that already ran again once (`RERUN`)."""
    queued: bool = False
    """Inserted behind another turn (its `QUEUED` marker stored): its `STARTED` marker is
    stored before it runs. An unfinished turn found with it never started."""
    announced: bool = False
    """Its `running` state was sent by the inbox, beside the prompt's answer (the worker was
    idle, so this turn is the next to start): the worker does not send it again."""

    @property
    def text(self) -> str:
        """The prompt's text blocks, joined by newlines."""
        return "\n".join(b.text for b in self.prompt if isinstance(b, s.ContentBlockText))


def marker(state: str, message_id: str) -> bytes:
    """The private retained marker that says the turn of `message_id` reached `state`
    (`RERUN`; "idle" in timelines written before turns had end records)."""
    return orjson.dumps({"sessionUpdate": TURN_MARKER, "state": state, "messageId": message_id})


def turn_end(
    message_id: str, stop_reason: str, error: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The end record of the turn of `message_id` (A10): the idle `state_update` with its stop
    reason (and `error` with `stopReason: "error"`), naming the message in
    `_meta.acpOnce.messageId`. Stored in the timeline, replayed, and sent live as it is."""
    end: dict[str, Any] = {
        "sessionUpdate": "state_update",
        "state": "idle",
        "stopReason": stop_reason,
    }
    if error is not None:
        end["error"] = error
    end["_meta"] = {"acpOnce": {"messageId": message_id}}
    return end


def ended_message(update: dict[str, Any]) -> str | None:
    """The message whose turn `update` ends: an end record's (`turn_end`), or an older
    timeline's private "idle" marker's; None for any other update."""
    kind = update.get("sessionUpdate")
    if kind == "state_update":
        if update.get("state") != "idle":
            return None
        meta = update.get("_meta")
        ours = meta.get("acpOnce") if isinstance(meta, dict) else None
        message_id = ours.get("messageId") if isinstance(ours, dict) else None
        return message_id if isinstance(message_id, str) else None
    if kind == TURN_MARKER and update.get("state") == "idle":
        return str(update.get("messageId"))
    return None


def last_end(tail: Sequence[Any]) -> dict[str, Any] | None:
    """The last end record (`turn_end`) among `tail` (timeline entries), decoded; None when
    there is none."""
    for entry in reversed(tail):
        if b'"state_update"' not in entry.update:
            continue  # most entries: no decoding
        update = orjson.loads(entry.update)
        if update.get("sessionUpdate") == "state_update" and ended_message(update) is not None:
            return dict(update)
    return None


def unfinished_turns(session_id: str, tail: Sequence[Any]) -> list[Turn]:
    """The retained user messages in `tail` (timeline entries) whose turn has no end record
    (`turn_end`, or an older timeline's closing marker). `Turn.reran`: a `RERUN` marker shows
    it ran again once already; `Turn.queued`: its `QUEUED` marker without a `STARTED` one
    shows it never started."""
    finished: set[str] = set()
    states: dict[str, set[str]] = {}
    messages: list[tuple[str, list[Any]]] = []
    for entry in tail:
        update = orjson.loads(entry.update)
        kind = update.get("sessionUpdate")
        if kind == "user_message" and entry.message_id is not None:
            messages.append((entry.message_id, update.get("content") or []))
        elif kind == TURN_MARKER and update.get("state") in (RERUN, QUEUED, STARTED):
            states.setdefault(str(update.get("messageId")), set()).add(update["state"])
        else:
            ended = ended_message(update)
            if ended is not None:
                finished.add(ended)
    turns: list[Turn] = []
    for message_id, content in messages:
        if message_id in finished:
            continue
        marks = states.get(message_id, set())
        prompt = s.PromptRequest.model_validate({"sessionId": session_id, "prompt": content}).prompt
        turns.append(
            Turn(
                session_id,
                message_id,
                list(prompt),
                live_only=False,
                reran=RERUN in marks,
                queued=QUEUED in marks and STARTED not in marks,
            )
        )
    return turns
