"""The client's durable outbox: every prompt submission, with its key, until it is settled.

A submission is written to the outbox *before* its first attempt and removed only when the
agent answers it with a `messageId` or a definite error (RFD "Shiny future", R10, R11, R15).
A client that restarts finds its pending submissions in `pending()` and, after resuming their
sessions, resends them with the same key in their original order per session; see
`acp_once.client.recovery` for the policy (backoff, the age after which a submission is handed
to the application instead, R16).

One small interface, `Outbox`, at the level of our record `Submission`, and two backends:
`MemoryOutbox` (the reference, for a client that only needs to survive dropped connections)
and `SqliteOutbox` (`acp_once.client.outbox_sqlite`, survives a restart or a crash of the
client process). `open_outbox("memory:" | "sqlite:PATH")` opens either. The contract every
backend must pass is `acp_once.client.outbox_contract`.

    async with open_outbox("sqlite:outbox.db") as outbox:
        submission = await outbox.add(session_id, prompt_json)   # durable from here on
        await outbox.record_attempt(submission.submission_id)
        ...send session/prompt with submission.idempotency_key...
        await outbox.complete(submission.submission_id)          # messageId or definite error

The key is a secret of the client (R29, R30): it never appears in a `repr` of a record or in
an exception message, and this package never logs it.

Errors::

    OutboxError
     ├── SubmissionNotFound   record_attempt on a submission that is not pending (any more)
     └── KeyConflict          also a ValueError: add() with a key already pending in the
                              session for a different prompt (R13)
"""

from __future__ import annotations

import math
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

import anyio.lowlevel

from acp_once.protocol.keys import check_key, new_key

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from types import TracebackType

__all__ = [
    "KeyConflict",
    "MemoryOutbox",
    "Outbox",
    "OutboxError",
    "Submission",
    "SubmissionNotFound",
    "new_submission_id",
    "open_outbox",
    "validate_add",
]


# --------------------------------------------------------------------------------------------
# Errors


class OutboxError(Exception):
    """Base class of every error an outbox raises (driver errors are wrapped in it)."""


class SubmissionNotFound(OutboxError):
    """The submission is not pending: it was never added, or it was completed."""

    def __init__(self, submission_id: str) -> None:
        super().__init__(f"submission {submission_id!r} is not pending")
        self.submission_id = submission_id


class KeyConflict(OutboxError, ValueError):
    """`add` named a key that is already pending in this session with a different prompt.

    Sending one key with two prompts is forbidden (R13). The message names the pending
    submission, never the key.
    """

    def __init__(self, session_id: str, pending_submission_id: str) -> None:
        super().__init__(
            f"session {session_id!r}: the idempotency key is already pending for another"
            f" prompt (submission {pending_submission_id!r})"
        )
        self.session_id = session_id
        self.pending_submission_id = pending_submission_id


# --------------------------------------------------------------------------------------------
# The record


@dataclass(frozen=True, slots=True)
class Submission:
    """One prompt the user submitted that has not been settled yet.

    The key and the prompt are left out of the `repr`, so that logging a submission cannot
    leak the key (or the user's text).
    """

    submission_id: str
    """Client-local id (uuid4 hex); the handle for `record_attempt`, `complete` and `get`."""
    session_id: str
    idempotency_key: str = field(repr=False)
    """Sent unchanged on every attempt (R11). Made when the user submits, never derived from
    the content (R8, R9, R10)."""
    prompt: bytes = field(repr=False)
    """The JSON of the prompt's content-block array, exactly as given to `add`."""
    created_at: float
    """Seconds since the epoch when the user submitted it; decides staleness (R16)."""
    seq: int
    """Assigned by the outbox, strictly increasing across sessions: the original order."""
    attempts: int
    """How many attempts `record_attempt` has counted."""


# --------------------------------------------------------------------------------------------
# The protocol


@runtime_checkable
class Outbox(Protocol):
    """Where a client keeps its unsettled prompt submissions.

    Every method is a coroutine and safe to call concurrently from many tasks. After `aclose`
    every call raises `OutboxError`. A call cancelled before it starts does nothing; a write
    cancelled while the backend is already writing finishes first (see the backend).
    """

    async def add(
        self,
        session_id: str,
        prompt: bytes,
        *,
        idempotency_key: str | None = None,
        now: float | None = None,
    ) -> Submission:
        """Store a new submission durably and return it; send the first attempt after this.

        `idempotency_key=None` makes a fresh random key (a UUIDv4 string, R8, R12); an
        application that persists its own pending input passes its own key (R17). Adding the
        same (session, key) again with the same prompt returns the pending submission
        unchanged, so a replayed `add` does not make a second one. `now` (seconds since the
        epoch) defaults to the outbox's clock.

        Raises:
            ValueError: an invalid key (the message never contains it), an empty session id,
                or a non-finite `now`.
            KeyConflict: the key is already pending in this session for another prompt.
            TypeError: `prompt` is not bytes.
        """
        ...

    async def record_attempt(self, submission_id: str) -> None:
        """Count one more attempt (`attempts += 1`); call it before sending each attempt.

        Raises:
            SubmissionNotFound: the submission is not pending (completed meanwhile): do not
                send it.
        """
        ...

    async def complete(self, submission_id: str) -> None:
        """Remove the submission: a `messageId` or a definite error came back. Idempotent."""
        ...

    async def pending(self, session_id: str | None = None) -> list[Submission]:
        """Return the pending submissions (of one session, or all), in `seq` order."""
        ...

    async def get(self, submission_id: str) -> Submission | None:
        """Return the pending submission, or None if it is not pending."""
        ...

    async def aclose(self) -> None:
        """Release the outbox's resources. Idempotent; later calls raise OutboxError."""
        ...


# --------------------------------------------------------------------------------------------
# Helpers shared by the backends


def new_submission_id() -> str:
    """Return a fresh client-local submission id (uuid4 hex)."""
    return uuid.uuid4().hex


def validate_add(
    session_id: object,
    prompt: object,
    idempotency_key: object,
    now: float | None,
    clock: Callable[[], float],
) -> tuple[bytes, str, float]:
    """Check the arguments of `add`; return (prompt, key, created_at), making the key if None.

    Runs before the outbox does anything, so an invalid call writes nothing.
    """
    if not isinstance(session_id, str) or not session_id:
        raise ValueError("session_id must be a non-empty string")
    if not isinstance(prompt, bytes):
        raise TypeError(f"prompt must be bytes (the JSON of the prompt), not {type(prompt)}")
    if idempotency_key is None:
        idempotency_key = new_key()
    elif not isinstance(idempotency_key, str):
        raise ValueError("idempotency_key must be a string")
    else:
        check_key(idempotency_key)  # its ValueError never contains the key
    created_at = clock() if now is None else now
    if not math.isfinite(created_at):
        raise ValueError("now must be a finite number of seconds since the epoch")
    return prompt, idempotency_key, float(created_at)


# --------------------------------------------------------------------------------------------
# The memory backend


class MemoryOutbox:
    """An `Outbox` in this process's memory: survives dropped connections, not a restart.

    Usable right after construction; also an async context manager that closes it. Every
    method checks for cancellation first and then does all of its work synchronously, so a
    call either happened completely or not at all.

    Args:
        clock: "now" in seconds since the epoch, for `created_at`.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # Insertion order is seq order; record_attempt replaces values in place.
        self._by_id: dict[str, Submission] = {}
        self._by_key: dict[tuple[str, str], str] = {}
        self._last_seq = 0
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._by_id)} pending"
        return f"<MemoryOutbox {state}>"

    async def _enter(self) -> None:
        await anyio.lowlevel.checkpoint()
        if self._closed:
            raise OutboxError("the outbox is closed")

    async def add(
        self,
        session_id: str,
        prompt: bytes,
        *,
        idempotency_key: str | None = None,
        now: float | None = None,
    ) -> Submission:
        prompt, key, created_at = validate_add(
            session_id, prompt, idempotency_key, now, self._clock
        )
        await self._enter()
        existing_id = self._by_key.get((session_id, key))
        if existing_id is not None:
            existing = self._by_id[existing_id]
            if existing.prompt != prompt:
                raise KeyConflict(session_id, existing_id)
            return existing
        self._last_seq += 1
        submission = Submission(
            submission_id=new_submission_id(),
            session_id=session_id,
            idempotency_key=key,
            prompt=prompt,
            created_at=created_at,
            seq=self._last_seq,
            attempts=0,
        )
        self._by_id[submission.submission_id] = submission
        self._by_key[(session_id, key)] = submission.submission_id
        return submission

    async def record_attempt(self, submission_id: str) -> None:
        await self._enter()
        submission = self._by_id.get(submission_id)
        if submission is None:
            raise SubmissionNotFound(submission_id)
        self._by_id[submission_id] = replace(submission, attempts=submission.attempts + 1)

    async def complete(self, submission_id: str) -> None:
        await self._enter()
        submission = self._by_id.pop(submission_id, None)
        if submission is not None:
            del self._by_key[(submission.session_id, submission.idempotency_key)]

    async def pending(self, session_id: str | None = None) -> list[Submission]:
        await self._enter()
        return [s for s in self._by_id.values() if session_id is None or s.session_id == session_id]

    async def get(self, submission_id: str) -> Submission | None:
        await self._enter()
        return self._by_id.get(submission_id)

    async def aclose(self) -> None:
        self._closed = True


# --------------------------------------------------------------------------------------------
# Opening by URL


@asynccontextmanager
async def open_outbox(url: str) -> AsyncIterator[Outbox]:
    """Open the outbox named by `url` for the duration of the `async with` block.

    * `memory:` a new, empty `MemoryOutbox`;
    * `sqlite:PATH` a `SqliteOutbox` on the file PATH (created if missing; pending
      submissions of an earlier run are there).

    Raises:
        ValueError: an unsupported scheme or a missing path.
        OutboxError: the SQLite file cannot be opened, or its schema is newer than supported.
    """
    scheme, sep, rest = url.partition(":")
    if not sep:
        raise ValueError(f"outbox URL {url!r} has no scheme; use 'memory:' or 'sqlite:PATH'")
    if scheme == "memory":
        if rest:
            raise ValueError("the 'memory:' outbox URL takes nothing after the colon")
        async with MemoryOutbox() as memory:
            yield memory
    elif scheme == "sqlite":
        if not rest:
            raise ValueError("the 'sqlite:' outbox URL needs a path, as in 'sqlite:outbox.db'")
        from acp_once.client.outbox_sqlite import SqliteOutbox  # late: it imports this module

        async with SqliteOutbox.open(rest) as sqlite:
            yield sqlite
    else:
        raise ValueError(
            f"unsupported outbox URL scheme {scheme!r}; supported: 'memory:', 'sqlite:PATH'"
        )
