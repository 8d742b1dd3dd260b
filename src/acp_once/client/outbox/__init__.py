"""The client's durable outbox: every prompt submission, with its key, until it is settled.

A submission is written to the outbox *before* its first attempt and removed only when the
agent answers it with a `messageId` or a definite error (RFD "Shiny future", R10, R11, R15).
A client that restarts finds its pending submissions in `pending()` and, after resuming their
sessions, resends them with the same key in their original order per session; see
`acp_once.client.recovery` for the policy (backoff, the age after which a submission is handed
to the application instead, R16).

One small interface, `Outbox`, at the level of our record `Submission`, and two backends:
`MemoryOutbox` (the reference, for a client that only needs to survive dropped connections)
and `SqliteOutbox` (`sqlite.py`, survives a restart or a crash of the client process).
`open_outbox("memory:" | "sqlite:PATH")` opens either. The contract every backend must pass
is `acp_once.client.outbox.contract`; the record, the interface and the errors are in
`base.py`.

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

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from acp_once.client.outbox.base import (
    KeyConflict,
    Outbox,
    OutboxError,
    Submission,
    SubmissionNotFound,
    new_submission,
    new_submission_id,
    replayed,
)
from acp_once.client.outbox.memory import MemoryOutbox
from acp_once.client.outbox.sqlite import SqliteOutbox

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

__all__ = [
    "KeyConflict",
    "MemoryOutbox",
    "Outbox",
    "OutboxError",
    "SqliteOutbox",
    "Submission",
    "SubmissionNotFound",
    "new_submission",
    "new_submission_id",
    "open_outbox",
    "replayed",
]


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
        async with SqliteOutbox.open(rest) as sqlite:
            yield sqlite
    else:
        raise ValueError(
            f"unsupported outbox URL scheme {scheme!r}; supported: 'memory:', 'sqlite:PATH'"
        )
