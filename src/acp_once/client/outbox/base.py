"""The outbox's record (`Submission`), its interface (`Outbox`), its errors, and the checks
of `add` that every backend runs first. The package docstring (`acp_once.client.outbox`)
says what the outbox is for."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from acp_once.protocol.keys import check_key, new_key

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "KeyConflict",
    "Outbox",
    "OutboxError",
    "Submission",
    "SubmissionNotFound",
    "new_submission",
    "new_submission_id",
    "replayed",
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


def new_submission(
    session_id: object,
    prompt: object,
    idempotency_key: object,
    now: float | None,
    clock: Callable[[], float],
) -> Submission:
    """Check the arguments of `add` and return the submission it stores: a fresh id, the key
    (a new one when None), `created_at` (`clock()` when `now` is None), no attempts, and
    `seq` 0 until the backend assigns it.

    Runs before the outbox does anything, so an invalid call writes nothing.

    Raises:
        ValueError: an empty session id, an invalid key (the message never contains it), or
            a non-finite `now`.
        TypeError: `prompt` is not bytes.
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
    return Submission(
        new_submission_id(), session_id, idempotency_key, prompt, float(created_at), 0, 0
    )


def replayed(pending: Submission, prompt: bytes) -> Submission:
    """What `add(prompt)` answers when its key is already pending in the session as
    `pending`: that submission, when it holds the same prompt.

    Raises:
        KeyConflict: `pending` holds another prompt (one key never names two, R13).
    """
    if pending.prompt != prompt:
        raise KeyConflict(pending.session_id, pending.submission_id)
    return pending
