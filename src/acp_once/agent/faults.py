"""Fault injection for tests and demos: die right after a commit, before anyone is answered.

With `ACP_ONCE_CRASH=after-insert` in the environment an agent that calls `CrashAfterInsert`
from its `after_insert` hook kills itself with SIGKILL right after committing a user message.
With `ACP_ONCE_CRASH_MARKER=PATH` as well it does so once: only while PATH does not exist (it
creates PATH first), so the restarted agent runs normally. `ACP_ONCE_CRASH_RATE=P` makes each
insertion crash with probability P instead (seeded by `ACP_ONCE_CRASH_SEED`): the answer is
"cut". `ACP_ONCE_CRASH_LOG=FILE` appends the message id to FILE before each such exit.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable
from typing import Self

__all__ = [
    "CRASH_ENV",
    "CRASH_LOG_ENV",
    "CRASH_MARKER_ENV",
    "CRASH_RATE_ENV",
    "CrashAfterInsert",
]

CRASH_ENV = "ACP_ONCE_CRASH"
CRASH_MARKER_ENV = "ACP_ONCE_CRASH_MARKER"
CRASH_RATE_ENV = "ACP_ONCE_CRASH_RATE"
CRASH_LOG_ENV = "ACP_ONCE_CRASH_LOG"


class CrashAfterInsert:
    """The crash the environment asks for (see the module docstring)."""

    def __init__(self, marker: str | None, rate: float, seed: str | None, log: str | None) -> None:
        self.marker = marker
        self.rate = rate
        self.log = log
        # a new draw per process: with one seed for every launch, a restarted agent would cut
        # the same insertions again and again
        self._random = random.Random(f"{seed}-{os.getpid()}")

    @classmethod
    def from_env(cls) -> Self | None:
        """The crash configured by this process's environment; None when none is."""
        if os.environ.get(CRASH_ENV, "") != "after-insert":
            return None
        return cls(
            os.environ.get(CRASH_MARKER_ENV),
            float(os.environ.get(CRASH_RATE_ENV, "1")),
            os.environ.get("ACP_ONCE_CRASH_SEED"),
            os.environ.get(CRASH_LOG_ENV),
        )

    def maybe_crash(self, message_id: str, before: Callable[[], object] | None = None) -> None:
        """Draw; on a hit log `message_id`, call `before` (what else must die with this
        process) and SIGKILL this process: no cleanup, no flush, as a real SIGKILL."""
        if self._random.random() >= self.rate:
            return
        if self.marker is not None and not _claim(self.marker):
            return  # crashed once already
        if self.log:
            _append_line(self.log, message_id)
        if before is not None:
            before()
        os.kill(os.getpid(), signal.SIGKILL)
        os._exit(9)  # not reached


def _claim(path: str) -> bool:
    """Create `path`; False if it already existed (an atomic test-and-set on the file system)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _append_line(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as out:
        out.write(line + "\n")
        out.flush()
        os.fsync(out.fileno())
