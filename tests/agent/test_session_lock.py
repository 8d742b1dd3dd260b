"""`SessionLock` (`acp_once.agent.state`): taken without a checkpoint when free, one holder
at a time, waiters in FIFO order, a cancelled waiter leaves the queue; the same before and
after the first wait makes its semaphore."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from acp_once.agent.state import SessionLock

pytestmark = pytest.mark.anyio

TIMEOUT = 10.0


async def test_a_free_lock_is_taken_without_a_checkpoint() -> None:
    lock = SessionLock()
    with anyio.CancelScope() as scope:
        scope.cancel()  # a checkpoint here would raise
        async with lock:
            assert lock.locked()
    assert not lock.locked()
    assert not scope.cancelled_caught


async def test_one_holder_at_a_time_waiters_in_order_and_a_cancelled_one_leaves() -> None:
    lock = SessionLock()
    order: list[str] = []
    inside = 0

    async def worker(name: str) -> None:
        nonlocal inside
        async with lock:
            inside += 1
            assert inside == 1
            order.append(name)
            await anyio.lowlevel.checkpoint()
            inside -= 1

    with anyio.fail_after(TIMEOUT):
        for round_ in range(2):  # before and after the semaphore exists
            order.clear()
            async with anyio.create_task_group() as tg, lock:  # held: everyone below waits
                inside += 1
                for name in "abc":
                    tg.start_soon(worker, f"{name}{round_}")
                    await anyio.wait_all_tasks_blocked()
                leaving = anyio.CancelScope()
                tg.start_soon(_cancelled_waiter, lock, leaving)
                await anyio.wait_all_tasks_blocked()
                leaving.cancel()
                await anyio.wait_all_tasks_blocked()
                assert lock.locked() and order == [] and lock.waiting() == 3
                inside -= 1
            assert order == [f"a{round_}", f"b{round_}", f"c{round_}"]
            assert not lock.locked()


async def _cancelled_waiter(lock: SessionLock, scope: anyio.CancelScope) -> None:
    with scope:
        async with lock:
            raise AssertionError("a cancelled waiter never holds the lock")
