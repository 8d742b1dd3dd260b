"""Group commit for the durable stores: one writer at a time, and the writes that queue while
a transaction is being written go together into the next one.

A store hands each write (a user message with its key, a retained update) to
`GroupCommit.submit`. When no batch is being written, the caller becomes the writer at once:
it takes everything queued (its own write, and whatever else is waiting) and hands that batch
to the store's `write` callback, which writes it in one transaction. Callers that arrive while
a batch is being written queue; when the batch is done, the first of them becomes the writer
of the next batch, and is woken before the callers of the batch just done. So a lone write
never waits for company (there is no timer), and under load the batch is whatever queued while
the previous batch was being written, or, with `gather`, what the other ready tasks queued
when the writer let them run once.

Each caller is answered only after the transaction holding its own write has committed, with
its own outcome: the store's `write` callback settles every item of the batch (`Write.settle`
or `Write.fail`), so a conflict or an error of one item is that item's answer only.

Cancellation: a caller cancelled while its write is still queued withdraws it (nothing is
written). Once the write is taken into a batch, the caller waits for the batch to end and gets
its outcome; the cancellation is delivered at its next checkpoint (as anyio's worker threads
do), so a committed write is never left unknown to its caller. The writer shields a batch of
several: its own cancellation must not abandon the writes of others. A batch of one is the
store's lone write, with the store's own rules (a SQLite call that has started runs to its
end; a PostgreSQL insert is shielded). Every backend bounds a batch (the SQLite busy timeout,
the PostgreSQL store's insert timeout), so these waits are bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import anyio.lowlevel

from acp_once.storage.base import StorageError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["GroupCommit", "GroupStats", "Write", "settle_each"]

_W = TypeVar("_W")


class Write(Generic[_W]):
    """One queued write: the session it writes to, the store's own description of the work
    (`work`), and, once written, its outcome."""

    __slots__ = (
        "_error",
        "_result",
        "_woken",
        "done",
        "lead",
        "rung",
        "session_id",
        "taken",
        "work",
    )

    def __init__(self, session_id: str, work: _W) -> None:
        self.session_id = session_id
        self.work = work
        self.taken = False  # in a batch being written: no longer withdrawable
        self.lead = False  # asked to write the next batch
        self.done = False
        self.rung = False  # woken: its batch is written, or it is to write the next one
        self._result: Any = None
        self._error: BaseException | None = None
        # what its caller waits on: a bare future of the loop on asyncio (`_follow`)
        self._woken: asyncio.Future[None] | anyio.Event | None = None

    def settle(self, result: object) -> None:
        """Record the result of a write that is committed (or that rightly wrote nothing)."""
        self._result = result
        self.done = True

    def fail(self, error: BaseException) -> None:
        """Record the error the write's caller gets (nothing of this write is committed)."""
        self._error = error
        self.done = True

    def outcome(self) -> Any:
        """The result, or raise the recorded error."""
        if self._error is not None:
            raise self._error
        return self._result


def settle_each(batch: list[Write[_W]], outcomes: list[tuple[bool, object]]) -> None:
    """Give each write of a committed batch its own outcome: `(True, result)` or
    `(False, exception)`, in the batch's order."""
    for write, (ok, value) in zip(batch, outcomes, strict=True):
        if ok:  # `Write.settle`, inline: once per write of every batch
            write._result = value
            write.done = True
        else:
            assert isinstance(value, BaseException)
            write.fail(value)


class GroupStats:
    """What a `GroupCommit` has written: batches (one transaction each), writes, and the
    largest batch. Figures for tests and benchmarks."""

    __slots__ = ("batches", "largest", "writes")

    def __init__(self) -> None:
        self.batches = 0
        self.writes = 0
        self.largest = 0


class GroupCommit(Generic[_W]):
    """The queue and the one writer of a store's grouped writes (see the module docstring).

    `write_one(work)` writes a lone write as the store does without group commit and returns
    its result (or raises its error). `write(batch)` writes a batch of `batch_from` writes or
    more in one transaction (or each alone, when one of them fails the transaction) and
    settles each item; an exception it raises fails every item it left unsettled. With
    `gather`, a writer whose session differs from the previous batch's
    last one first lets the other ready tasks run once (a zero-length yield, not a delay):
    writes of other sessions then join its batch. One session written sequentially (a stdio
    agent) never yields.
    """

    def __init__(
        self,
        write_one: Callable[[_W], Awaitable[Any]],
        write: Callable[[list[Write[_W]]], Awaitable[None]],
        *,
        gather: bool = False,
    ) -> None:
        self._write_one = write_one
        self._write = write
        self._gather = gather
        self.batch_from = 2
        """The smallest batch written by `write`; the tests lower it to 1, so that every
        write takes the path of a batch."""
        self._queue: list[Write[_W]] = []
        self._writing = False
        self._loop: asyncio.AbstractEventLoop | None = None  # `_event_loop`
        self._loop_known = False
        self._last_session: str | None = None
        self.stats = GroupStats()

    async def submit(self, session_id: str, work: _W) -> Any:
        """Write `work` (on session `session_id`) in the next batch; return its result once
        the batch is committed.

        Raises:
            whatever the store's `write` recorded for this item (a `StorageError`).
        """
        if (
            not self._writing
            and self.batch_from > 1
            and (not self._gather or session_id == self._last_session)
        ):
            # Alone, with nothing to gather: the lone write itself, without the queue's
            # bookkeeping (the path of every write of a stdio agent).
            self._writing = True
            try:
                return await self._write_one(work)
            finally:
                self._count(1, session_id)
                self._hand_over()
        item = Write(session_id, work)
        self._queue.append(item)
        if self._writing:
            await self._follow(item)
        else:
            self._writing = True
            await self._lead(item)
        if item._error is not None:  # `Write.outcome`, inline
            raise item._error
        return item._result

    def _count(self, size: int, last_session: str) -> None:
        stats = self.stats
        stats.batches += 1
        stats.writes += size
        if size > stats.largest:
            stats.largest = size
        self._last_session = last_session

    def _event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The running asyncio loop (looked up once: each lookup is a getpid() system call on
        3.11), None elsewhere (trio)."""
        if not self._loop_known:
            with contextlib.suppress(RuntimeError):
                self._loop = asyncio.get_running_loop()
            self._loop_known = True
        return self._loop

    async def _wait(self, item: Write[_W]) -> None:
        """Wait until `item` is rung (`_ring`). On asyncio on a bare future of the loop: an
        `anyio.Event` would first look up the backend and build an `asyncio.Event` around a
        future of its own, for every follower of every batch."""
        loop = self._loop if self._loop_known else self._event_loop()
        if loop is None:
            event = item._woken = anyio.Event()
            await event.wait()
        else:
            future = item._woken = loop.create_future()
            await future

    async def _follow(self, item: Write[_W]) -> None:
        try:
            await self._wait(item)
        except BaseException:
            if item.taken:
                # Its batch is being written: learn the outcome first (bounded by the batch).
                with anyio.CancelScope(shield=True):
                    while not item.rung:
                        await self._wait(item)
                return
            self._queue.remove(item)  # withdrawn: nothing of it was written
            if item.lead:
                self._hand_over()
            raise
        if not item.taken:  # woken to write the next batch, which holds this item
            await self._lead(item)

    async def _lead(self, item: Write[_W]) -> None:
        if self._gather and item.session_id != self._last_session:
            with anyio.CancelScope(shield=True):  # its item is not withdrawn: others follow it
                await anyio.lowlevel.checkpoint()
        batch, self._queue = self._queue, []
        for write in batch:
            write.taken = True
        if len(batch) < self.batch_from:
            # A lone write: cancelled as the store cancels a write without group commit
            # (shielding costs a few microseconds that a lone write need not pay).
            await self._run(batch)
        else:
            with anyio.CancelScope(shield=True):
                await self._run(batch)

    async def _run(self, batch: list[Write[_W]]) -> None:
        try:
            if len(batch) < self.batch_from:
                only = batch[0]
                try:
                    only.settle(await self._write_one(only.work))
                except Exception as exc:
                    only.fail(exc)
            else:
                await self._write(batch)
        except Exception as exc:
            _fail_unsettled(batch, exc)
        except BaseException:
            _fail_unsettled(batch, StorageError("the write was interrupted"))
            raise
        finally:
            _fail_unsettled(batch, StorageError("the store left a write unsettled"))
            self._count(len(batch), batch[-1].session_id)
            # The next writer first: it sends the writes that queued meanwhile before this
            # batch's callers go on with what their commits allowed (answers, the turn's next
            # steps), so a database across a connection (PostgreSQL) works while the event
            # loop serves them; rung after them, it would wait for all of that, the database
            # idle meanwhile. A writer with `gather` still lets them run once before it takes
            # the queue.
            self._hand_over()
            for write in batch:
                _ring(write)

    def _hand_over(self) -> None:
        if self._queue:
            first = self._queue[0]
            first.lead = True
            assert first._woken is not None  # every queued item but a writer's own follows
            _ring(first)
        else:
            self._writing = False


def _ring(write: Write[_W]) -> None:
    """Wake the caller of `write` if it waits (`GroupCommit._wait`)."""
    write.rung = True
    woken = write._woken
    if woken is None:
        return
    if isinstance(woken, asyncio.Future):
        if not woken.done():  # not cancelled meanwhile (its caller then sees `rung`)
            woken.set_result(None)
    else:
        woken.set()


def _fail_unsettled(batch: list[Write[_W]], error: BaseException) -> None:
    for write in batch:
        if not write.done:
            # One error object per caller: an exception raised in several tasks would
            # collect all their tracebacks.
            write.fail(StorageError(str(error)) if write is not batch[0] else error)
