"""Busy polling (`acp_once.support.busypoll`): the loop is kept polling while something is
pending, for at most the limit after the last `arm()`, and never with a limit of 0. Rounds
are stepped with `asyncio.sleep(0)` (one turn of the loop each) and time with a fake clock."""

from __future__ import annotations

import asyncio
import math

import pytest

from acp_once.support.busypoll import BusyPoll
from tests.helpers import assert_stops_polling, loop_rounds

pytestmark = pytest.mark.anyio


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _armed(clock: _Clock) -> BusyPoll:
    """A poll armed for 10 ms, of something always pending."""
    poll = BusyPoll(asyncio.get_running_loop(), lambda: True, 0.010, clock)
    poll.arm()
    return poll


async def test_the_loop_is_polled_while_something_is_pending_and_no_longer() -> None:
    pending = True
    poll = BusyPoll(asyncio.get_running_loop(), lambda: pending, 1.0, _Clock())
    poll.arm()
    assert poll.polling()
    await loop_rounds(5)
    assert poll.polling()
    polled = poll.rounds
    assert polled >= 4
    await loop_rounds(5)
    assert poll.rounds >= polled + 5
    pending = False
    await assert_stops_polling(poll)


async def test_polling_stops_at_the_limit_even_while_something_is_pending() -> None:
    clock = _Clock()
    poll = _armed(clock)
    clock.now += 0.009
    await loop_rounds(3)
    assert poll.polling()
    clock.now += 0.002
    await assert_stops_polling(poll)


async def test_arming_again_counts_the_limit_from_then() -> None:
    clock = _Clock()
    poll = _armed(clock)
    clock.now += 0.008
    poll.arm()
    clock.now += 0.008  # 16 ms after the first arm, 8 ms after the second
    await loop_rounds(3)
    assert poll.polling()
    clock.now += 0.003
    await assert_stops_polling(poll)
    poll.arm()  # armed again after it stopped: polls again
    await loop_rounds(2)
    assert poll.polling()


async def test_a_limit_of_zero_never_polls() -> None:
    poll = BusyPoll(asyncio.get_running_loop(), lambda: True, 0.0, _Clock())
    poll.arm()
    await loop_rounds(3)
    assert not poll.polling()
    assert poll.rounds == 0


@pytest.mark.parametrize("limit", [-0.001, math.inf, math.nan])
async def test_a_limit_that_is_negative_or_not_finite_is_refused(limit: float) -> None:
    with pytest.raises(ValueError, match="busy-poll time"):
        BusyPoll(asyncio.get_running_loop(), lambda: True, limit)
