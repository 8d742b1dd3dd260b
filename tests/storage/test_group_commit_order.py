"""The order in which `GroupCommit` wakes its callers once a batch is done: the writer of the
next batch first, so that batch is on its way before the callers of the batch just done go on
with their work (the database is not left idle while the event loop serves them)."""

from __future__ import annotations

import anyio
import pytest

from acp_once.storage.grouping import GroupCommit, Write, settle_each

pytestmark = pytest.mark.anyio

TIMEOUT = 10.0


async def test_the_next_writer_is_woken_before_the_other_callers_of_the_done_batch() -> None:
    """Batch 1 holds "a" (its writer) and "x"; "b" and "c" queue while it is written. Once it is
    done, "a" goes on at once (it wrote the batch), and "b" writes the next batch before "x"
    goes on."""
    log: list[str] = []
    started = {"z": anyio.Event(), "a": anyio.Event()}
    release = {"z": anyio.Event(), "a": anyio.Event()}

    async def write_one(work: str) -> str:
        raise AssertionError("every write takes the batch path here")

    async def write(batch: list[Write[str]]) -> None:
        log.append("write " + " ".join(w.work for w in batch))
        first = batch[0].work
        if first in started:
            started[first].set()
            await release[first].wait()
        settle_each(batch, [(True, w.work.upper()) for w in batch])

    group: GroupCommit[str] = GroupCommit(write_one, write)
    group.batch_from = 1  # a batch of one is a batch

    async def submit(work: str) -> None:
        result = await group.submit(f"s-{work}", work)
        log.append(f"{work} resumed with {result}")

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(submit, "z")
            await started["z"].wait()  # batch 0, "z", is being written
            tg.start_soon(submit, "a")
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(submit, "x")
            await anyio.wait_all_tasks_blocked()  # "a" and "x" queued, in that order
            release["z"].set()
            await started["a"].wait()  # batch 1, "a x", is being written
            tg.start_soon(submit, "b")
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(submit, "c")
            await anyio.wait_all_tasks_blocked()  # "b" and "c" queued behind it
            release["a"].set()

    assert log[:4] == ["write z", "z resumed with Z", "write a x", "a resumed with A"]
    assert log[4] == "write b c"  # the next batch went out before "x" went on
    assert sorted(log[5:]) == ["b resumed with B", "c resumed with C", "x resumed with X"]
    assert (group.stats.batches, group.stats.writes, group.stats.largest) == (3, 5, 2)
