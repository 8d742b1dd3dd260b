"""TaskPool runs each call in a copy of its starter's contextvars context, parked task or not."""

from __future__ import annotations

import asyncio
import contextvars

import anyio
import pytest

from acp_once.rpc.tasks import TaskPool, _Budget

pytestmark = pytest.mark.anyio

TIMEOUT = 20

_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("_VAR", default="unset")


async def test_each_call_sees_its_starters_context_and_leaks_nothing_to_the_next() -> None:
    seen: list[tuple[int, str]] = []
    done = anyio.Event()

    async def call(i: int) -> None:
        seen.append((i, _VAR.get()))
        _VAR.set(f"set by call {i}")
        await anyio.lowlevel.checkpoint()  # a step after a suspension runs in the same context
        seen.append((i, _VAR.get()))
        if i == 5:
            done.set()

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            pool = TaskPool(tg, max_idle=1)
            for i in range(6):
                _VAR.set(f"starter {i}")
                pool.start_soon(call, i)
                # let the call finish and park its task: the next call reuses it
                while len(seen) < 2 * (i + 1):
                    await anyio.lowlevel.checkpoint()
                await anyio.lowlevel.checkpoint()
                assert not pool._idle  # a task whose call set a value is not reused
            await done.wait()
            assert _VAR.get() == "starter 5"  # a call's value never reaches its starter
            tg.cancel_scope.cancel()
    for i in range(6):
        assert seen[2 * i : 2 * i + 2] == [(i, f"starter {i}"), (i, f"set by call {i}")]


async def test_a_reused_task_runs_each_call_in_its_starters_context() -> None:
    """Calls that only read: one task runs them all, each in its own starter's values."""
    seen: list[str] = []

    async def call() -> None:
        await anyio.lowlevel.checkpoint()
        seen.append(_VAR.get())

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            pool = TaskPool(tg, max_idle=1)
            for i in range(4):
                _VAR.set(f"starter {i % 2}")  # alternately the task's own values and others
                pool.start_soon(call)
                while len(seen) < i + 1:
                    await anyio.lowlevel.checkpoint()
                await anyio.lowlevel.checkpoint()
                assert len(pool._idle) == 1  # parked again: the next call reuses it
            tg.cancel_scope.cancel()
    assert seen == ["starter 0", "starter 1", "starter 0", "starter 1"]


async def test_a_call_in_a_parked_task_is_cancelled_and_fails_as_in_a_task_of_its_own() -> None:
    stages: list[str] = []

    async def quick() -> None:
        stages.append("quick")

    async def waits(scope: anyio.CancelScope) -> None:
        with scope:
            await anyio.sleep_forever()
        stages.append("cancelled")
        raise ValueError("after cancel")

    scope = anyio.CancelScope()
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(ExceptionGroup) as failed:
            async with anyio.create_task_group() as tg:
                pool = TaskPool(tg)
                pool.start_soon(quick)
                while not pool._idle:
                    await anyio.lowlevel.checkpoint()
                pool.start_soon(waits, scope)  # handed to the parked task
                assert not pool._idle
                await anyio.lowlevel.checkpoint()
                scope.cancel()
                await anyio.sleep_forever()
    assert stages == ["quick", "cancelled"]
    assert [str(e) for e in failed.value.exceptions] == ["after cancel"]


async def test_parked_tasks_beyond_the_loops_budget_retire_the_oldest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Idle connections hold no parked task each: past `max_parked_per_loop`, parking a task
    ends the one parked longest ago, and its pool starts a new task for its next call."""
    monkeypatch.setattr(TaskPool, "max_parked_per_loop", 2)
    ran: list[str] = []

    async def call(name: str) -> None:
        ran.append(name)

    async def run_and_park(pool: TaskPool, name: str) -> None:
        pool.start_soon(call, name)
        while name not in ran or not pool._idle:
            await anyio.lowlevel.checkpoint()

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            first, second, third = (TaskPool(tg) for _ in range(3))
            await run_and_park(first, "a")
            await run_and_park(second, "b")
            tasks = len(asyncio.all_tasks())
            await run_and_park(third, "c")  # its task parks: the first pool's retires
            assert not first._idle and len(second._idle) == len(third._idle) == 1
            while len(asyncio.all_tasks()) > tasks:  # the retired task ended
                await anyio.lowlevel.checkpoint()
            await run_and_park(first, "d")  # a new task; now the second pool's retires
            assert not second._idle and len(first._idle) == len(third._idle) == 1
            parked = TaskPool._parked[asyncio.get_running_loop()]
            assert len(parked) == 2
            third.start_soon(call, "e")  # handed to the parked task: it leaves the budget
            assert len(parked) == 1
            while "e" not in ran or not third._idle:
                await anyio.lowlevel.checkpoint()
            assert len(parked) == 2
            tg.cancel_scope.cancel()
    assert ran == ["a", "b", "c", "d", "e"]
    assert not parked  # cancelled parked tasks leave the budget too


async def test_tasks_parked_longer_than_the_age_limit_retire_when_another_parks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection that went idle keeps no parked task once busier ones park theirs: a task
    parked longer than `max_parked_seconds` retires when another task parks."""
    monkeypatch.setattr(TaskPool, "max_parked_seconds", -1.0)  # every earlier one is too old
    ran: list[str] = []

    async def call(name: str) -> None:
        ran.append(name)

    async def run_and_park(pool: TaskPool, name: str) -> None:
        pool.start_soon(call, name)
        while name not in ran or not pool._idle:
            await anyio.lowlevel.checkpoint()

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            idle, busy = TaskPool(tg), TaskPool(tg)
            await run_and_park(idle, "a")
            assert len(idle._idle) == 1
            await run_and_park(busy, "b")  # parks: the idle pool's task is too old
            assert not idle._idle and len(busy._idle) == 1
            parked = TaskPool._parked[asyncio.get_running_loop()]
            assert list(parked) == busy._idle
            tg.cancel_scope.cancel()
    assert ran == ["a", "b"]


async def test_a_parked_task_retires_past_the_age_limit_on_a_quiet_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server gone quiet keeps no parked task: with no other task parking, the loop's timer
    retires a task parked longer than `max_parked_seconds`, and then stops."""
    monkeypatch.setattr(TaskPool, "max_parked_seconds", 0.05)
    ran: list[str] = []

    async def call(name: str) -> None:
        ran.append(name)

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            pool = TaskPool(tg)
            before = asyncio.all_tasks()
            pool.start_soon(call, "a")
            (task,) = asyncio.all_tasks() - before
            while "a" not in ran or not pool._idle:
                await anyio.lowlevel.checkpoint()
            parked_at = asyncio.get_running_loop().time()
            budget = TaskPool._parked[asyncio.get_running_loop()]
            assert _timed(budget) and len(budget) == 1
            ended = asyncio.Event()
            task.add_done_callback(lambda _: ended.set())
            await ended.wait()  # nothing else runs: only the timer can end it
            assert asyncio.get_running_loop().time() - parked_at >= 0.05
            assert not pool._idle and not budget and not _timed(budget)
            pool.start_soon(call, "b")  # the pool starts a new task for its next call
            while "b" not in ran or not pool._idle:
                await anyio.lowlevel.checkpoint()
            assert _timed(budget) and len(budget) == 1
            tg.cancel_scope.cancel()
    assert ran == ["a", "b"]


def _timed(budget: _Budget) -> bool:
    """Whether the loop's retirement timer is armed (read through a call: mypy would take the
    first assertion on the attribute as true for the rest of the test)."""
    return budget.timed
