"""Busy polling: an asyncio event loop that keeps polling for I/O, instead of sleeping in its
selector, while an answer it waits for is due within a millisecond or two (a batch of writes
out to the SQLite writer process).

Why: a loop that sleeps in its selector gives its core up; when the answer comes it is woken
and waits to be scheduled again, beside the writer and the clients on a machine whose cores
are all busy. A prompt waits for two writer round trips, one after the other. A loop that
keeps a callback ready never sleeps: its selector is polled with a zero timeout between
rounds, and the answer is read in the round after it arrives. On 2 cores, keyed echo prompts
over WebSocket (`docs/guide/serving.md`): 4-12% more prompts a second at 20 connections, and
at 1 connection a p50 of 0.54-0.66 ms instead of 0.76-0.79 ms.

The cost is CPU spent polling, bounded twice: only while something is in flight, and for at
most `limit_s` after the last `arm()`, after which the loop sleeps as usual (a batch that
slow waits on the disk, and polling would only burn the core). Where the loop had time to
spare, the polling shows as loop CPU: +50 to +150 µs a prompt at 1 connection, +6 to +17 µs
at 20 (of ~125).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

__all__ = ["DEFAULT_LIMIT_S", "BusyPoll", "check_busy_poll"]

DEFAULT_LIMIT_S: Final = 0.002
"""How long after the last `arm()` the loop keeps polling at most."""


def check_busy_poll(limit_s: float) -> None:
    """Raises:
    ValueError: `limit_s` is negative or not finite.
    """
    if not 0 <= limit_s < float("inf"):
        raise ValueError(f"the busy-poll time must be a finite number >= 0, got {limit_s!r}")


class BusyPoll:
    """Keeps `loop` polling while `pending()` is true, for at most `limit_s` after the last
    `arm()`: one callback a round, which schedules itself again.

    Not thread-safe: `arm` is called on the loop's thread.
    """

    __slots__ = ("_armed", "_clock", "_limit", "_pending", "_until", "loop", "rounds")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pending: Callable[[], bool],
        limit_s: float = DEFAULT_LIMIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Raises:
        ValueError: `limit_s` is negative or not finite.
        """
        check_busy_poll(limit_s)
        self.loop = loop
        """The loop kept polling."""
        self._pending = pending
        self._limit = limit_s
        self._clock = clock
        self._until = 0.0
        self._armed = False
        self.rounds = 0
        """Rounds polled so far (for the tests and the benchmarks)."""

    def polling(self) -> bool:
        """Whether the loop is kept polling now."""
        return self._armed

    def arm(self) -> None:
        """Keep the loop polling while `pending()` holds, until `limit_s` from now."""
        if self._limit == 0:
            return
        self._until = self._clock() + self._limit
        if not self._armed:
            self._armed = True
            self.loop.call_soon(self._round)

    def _round(self) -> None:
        if self._pending() and self._clock() < self._until:
            self.rounds += 1
            self.loop.call_soon(self._round)
        else:
            self._armed = False
