"""`MemoryOutbox`: the reference `Outbox`, in this process's memory."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import anyio.lowlevel

from acp_once.client.outbox.base import (
    OutboxError,
    Submission,
    SubmissionNotFound,
    new_submission,
    replayed,
)
from acp_once.support.opening import AsyncClosing

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["MemoryOutbox"]


class MemoryOutbox(AsyncClosing):
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
        new = new_submission(session_id, prompt, idempotency_key, now, self._clock)
        await self._enter()
        key = (session_id, new.idempotency_key)
        if (pending_id := self._by_key.get(key)) is not None:
            return replayed(self._by_id[pending_id], new.prompt)
        self._last_seq += 1
        submission = replace(new, seq=self._last_seq)
        self._by_id[submission.submission_id] = submission
        self._by_key[key] = submission.submission_id
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
