"""Starting many short tasks cheaply: finished tasks wait for the next call instead of ending.

Starting an anyio task costs ~30 us on CPython (a task, a handle with its own cancel scope and
event, a wrapper coroutine), more than a whole small JSON-RPC request. `TaskPool.start_soon`
hands the call to a parked task of the same task group when one is waiting, and starts a new
task only when none is. A call still runs in a task of its own while it runs, under the task
group's cancel scope, and an exception it raises ends its task and reaches the task group
exactly as with `TaskGroup.start_soon`.

Each call runs in a copy of the `contextvars` context it was started from, as a task started
with `TaskGroup.start_soon` does: a call sees the values its starter had set, and a value it
sets is seen by nobody else, not by the next call that its task runs either (a task whose
call set one is not parked again).

Parked tasks are bounded per event loop: at most `TaskPool.max_parked_per_loop` across all
pools of a loop. When that many are parked, a task that parks retires the one parked longest
ago; and a task parked longer than `TaskPool.max_parked_seconds` retires, whether or not
other tasks park meanwhile (one timer per loop, armed while tasks are parked). So a server's
many idle connections hold no parked task each while its busy ones keep theirs, also once the
whole server has gone quiet.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import types
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, ClassVar

import anyio
from anyio.abc import TaskGroup

__all__ = ["TaskPool", "cancel_scope_factory"]

_Call = tuple[Callable[..., Coroutine[Any, Any, Any]], tuple[Any, ...], contextvars.Context]


def cancel_scope_factory() -> Callable[[], anyio.CancelScope]:
    """The running backend's cancel scope class, to make many scopes cheaply; call it in the
    event loop.

    `anyio.CancelScope()` looks the backend up at every call (~2.5 us on CPython 3.11, twice
    per prompt turn); the class it returns makes the same scope in ~0.5 us.
    """
    return type(anyio.CancelScope())


@types.coroutine
def _in_context(
    context: contextvars.Context, coro: Coroutine[Any, Any, Any]
) -> Generator[Any, Any, Any]:
    """Await `coro` with each of its steps run in `context`.

    A task's own context cannot be swapped, so a parked task runs its next call this way: the
    coroutine is stepped by hand (send or throw, under `context.run`), and what it yields to the
    event loop (a future, a trap) is passed through unchanged, as `yield from` would. A plain
    generator, not an object with `__await__`: ~0.2 us less per call, ~0.1 us per suspension.
    """
    run = context.run
    step: Callable[[Any], Any] = coro.send
    value: Any = None
    while True:
        try:
            yielded = run(step, value)
        except StopIteration as stop:
            return stop.value
        try:
            value = yield yielded
            step = coro.send
        except GeneratorExit:
            run(coro.close)
            raise
        except BaseException as exc:  # a cancellation, delivered to the coroutine
            value = exc
            step = coro.throw


class _Parked:
    """A finished task waiting for its next call.

    On asyncio it waits on a bare future of the loop: handing it a call then costs one
    `set_result`, where an `anyio.Event` would first look up the backend and build an
    `asyncio.Event` around its own future, twice per prompt turn. Elsewhere (trio) it waits on
    an `anyio.Event`.
    """

    __slots__ = ("call", "future", "ready", "since")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.call: _Call | None = None
        self.since = 0.0  # when it parked (the loop's clock), on asyncio
        self.future: asyncio.Future[None] | None = None
        self.ready: anyio.Event | None = None
        if loop is not None:
            self.future = loop.create_future()
        else:  # not asyncio
            self.ready = anyio.Event()

    def hand(self, call: _Call | None) -> bool:
        """Give the task its next call (None: it ends instead); False if it was cancelled
        meanwhile (it takes none)."""
        if self.future is not None and self.future.done():
            return False  # cancelled, not resumed yet: it will leave on its own
        self.call = call
        if self.future is not None:
            self.future.set_result(None)
        else:
            assert self.ready is not None
            self.ready.set()
        return True


class _Budget(collections.OrderedDict[_Parked, list[_Parked]]):
    """An event loop's parked tasks, oldest first, each with the idle list of its pool.

    Ordered by a linked list: the oldest is found at once, where a plain dict's first live
    entry is found by skipping the slots of the ones taken out before it.
    """

    timed = False
    """Whether the loop's retirement timer (`_sweep`) is armed."""

    def retire_aged(self, now: float) -> None:
        """Retire the tasks parked longer than `TaskPool.max_parked_seconds` before `now`."""
        limit = TaskPool.max_parked_seconds
        while self and now - next(iter(self)).since > limit:
            TaskPool._retire_oldest(self)

    def arm(self, loop: asyncio.AbstractEventLoop, now: float) -> None:
        """Run `_sweep` on this budget when its oldest task passes the age limit (the budget
        is not empty)."""
        due = next(iter(self)).since + max(TaskPool.max_parked_seconds, 0.0) - now
        self.timed = True
        # due when the oldest passes the limit (a late timer does not delay the next); at
        # least a millisecond ahead, as one parked exactly the limit ago is not yet too old
        loop.call_later(max(due, 0.001), _sweep, weakref.ref(loop), self)


def _sweep(loop_ref: weakref.ref[asyncio.AbstractEventLoop], lru: _Budget) -> None:
    """Retire the tasks parked longer than `TaskPool.max_parked_seconds` (a timer callback);
    armed again for the oldest left, until none is parked. Given a weak reference to its loop:
    a loop closed or gone meanwhile leaves nothing to do."""
    lru.timed = False
    loop = loop_ref()
    if loop is None or loop.is_closed():
        return
    now = loop.time()
    lru.retire_aged(now)
    if lru:
        lru.arm(loop, now)


class TaskPool:
    """Runs calls in tasks of `tg`, keeping up to `max_idle` finished tasks for the next calls.

    A parked task waits for its next call until the task group is cancelled (it holds nothing
    but its stack) or, on asyncio, until it retires: when `max_parked_per_loop` are parked in
    its event loop and a newer one parks, or once it has been parked longer than
    `max_parked_seconds` (looked at whenever a task parks, and by a timer of the loop); at most
    `max_idle` of them exist at once.
    """

    _shared: ClassVar[weakref.WeakKeyDictionary[TaskGroup, TaskPool]] = weakref.WeakKeyDictionary()
    # each loop's parked tasks, oldest first, with the idle list of the pool each is in
    _parked: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Budget]] = (
        weakref.WeakKeyDictionary()
    )
    # Parked tasks per event loop, all pools together. A parked task holds ~4 KiB (its task,
    # cancel scope, event and frames); busy connections need a few each. The count bounds the
    # memory; the age keeps them for the connections that are busy now: a server whose
    # 10,000 connections all prompt reuses its tasks (a task started per request instead cost
    # ~30% more CPU per prompt there), one whose connections went idle lets theirs go.
    max_parked_per_loop: ClassVar[int] = 16384
    max_parked_seconds: ClassVar[float] = 10.0

    def __init__(self, tg: TaskGroup, *, max_idle: int = 8, name: str = "pooled") -> None:
        # weak: `of` keeps pools in a WeakKeyDictionary keyed by the group, whose values must
        # not keep their keys alive
        self._tg = weakref.ref(tg)
        self._max_idle = max_idle
        self._name = name
        self._idle: list[_Parked] = []
        # the running loop, looked up once: each lookup is a getpid() system call on 3.11
        self._loop: asyncio.AbstractEventLoop | None = None
        # the loop's parked tasks (None when not on asyncio: no budget there)
        self._lru: _Budget | None = None
        with contextlib.suppress(RuntimeError):  # not asyncio (or no loop): anyio.Event
            self._loop = asyncio.get_running_loop()
            self._lru = TaskPool._parked.get(self._loop)
            if self._lru is None:
                self._lru = TaskPool._parked[self._loop] = _Budget()

    @classmethod
    def of(cls, tg: TaskGroup) -> TaskPool:
        """The pool shared by everyone who starts calls in `tg` (created on first use)."""
        pool = cls._shared.get(tg)
        if pool is None:
            pool = cls._shared[tg] = cls(tg)
        return pool

    def start_soon(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run `fn(*args)` soon, in a parked task or a new one, in a copy of the current
        `contextvars` context.

        Raises:
            RuntimeError: the task group is no longer active (as `TaskGroup.start_soon`).
        """
        if self._idle:
            call = (fn, args, contextvars.copy_context())
            lru = self._lru
            while self._idle:
                parked = self._idle.pop()
                if lru is not None:
                    lru.pop(parked, None)
                if parked.hand(call):
                    return
        tg = self._tg()
        if tg is None:
            raise RuntimeError("This task group is gone; no new tasks can be started.")
        # a new task's context is already a copy of this one, taken here
        tg.start_soon(self._run, fn, args, name=self._name)

    async def _run(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        # The values this task's context holds: a call whose starter holds the same values
        # (the common case: nobody sets context variables) runs directly in this task's
        # context; a call that changes them retires the task, so nothing leaks to a later call.
        base = contextvars.copy_context()
        await fn(*args)
        # A parked task keeps nothing of its last call: its arguments (a request, its
        # context, its connection) would otherwise live as long as the task is parked.
        del fn, args
        while True:
            if len(self._idle) >= self._max_idle or contextvars.copy_context() != base:
                return
            parked = _Parked(self._loop)
            self._idle.append(parked)
            lru = self._lru
            if lru is not None:
                assert self._loop is not None
                parked.since = now = self._loop.time()
                if len(lru) >= self.max_parked_per_loop:
                    self._retire_oldest(lru)
                lru.retire_aged(now)
                lru[parked] = self._idle
                if not lru.timed:
                    lru.arm(self._loop, now)
            try:
                # awaited here, not in a method of _Parked: a coroutine less per hand-off
                if parked.future is not None:
                    await parked.future
                else:
                    assert parked.ready is not None
                    await parked.ready.wait()
            except BaseException:
                # cancelled while parked (the task group is closing); a call handed over in
                # the same instant is dropped with the rest of the group's work
                with contextlib.suppress(ValueError):
                    self._idle.remove(parked)
                if self._lru is not None:
                    self._lru.pop(parked, None)
                raise
            if parked.call is None:
                return  # retired to make room for a newer parked task
            fn, args, context = parked.call
            parked.call = None
            if context == base:
                await fn(*args)  # ~10,000 instructions a prompt turn less than stepping it
            else:
                await _in_context(context, fn(*args))
            del fn, args, context

    @staticmethod
    def _retire_oldest(lru: _Budget) -> None:
        """End the task parked longest ago in this loop (it leaves when it next runs)."""
        oldest = next(iter(lru))
        idle = lru.pop(oldest)
        with contextlib.suppress(ValueError):
            idle.remove(oldest)
        oldest.hand(None)
