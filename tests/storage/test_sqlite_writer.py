"""The SQLite store's writer process (`acp_once.storage.sqlite.writer`): what happens when it
dies, hangs, or outlives its store's process, and when a caller is cancelled or the store
closes while a batch is out. The contract suite runs on it too (`sqlite-writer` in
`tests/storage/conftest.py`)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import orjson
import pytest

from acp_once.storage import InsertOutcome, SessionRecord, SqliteStore
from acp_once.storage.base import StorageError
from acp_once.storage.sqlite import writer as writer_module
from acp_once.storage.sqlite.writer import WriterProcess
from acp_once.support.busypoll import BusyPoll
from tests.helpers import assert_stops_polling, loop_rounds, wait_gone

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio

TIMEOUT = 20.0  # seconds: bounds every wait, sized for a loaded machine


def _update(message_id: str) -> bytes:
    return orjson.dumps({"sessionUpdate": "user_message", "messageId": message_id})


async def _insert(store: SqliteStore, key: str, message_id: str) -> InsertOutcome:
    return await store.insert_user_message(
        "s",
        message_id=message_id,
        update=_update(message_id),
        idempotency_key=key,
        prompt_digest=None,
    )


def _writer(store: SqliteStore) -> WriterProcess:
    writer = store._writer  # pyright: ignore[reportPrivateUsage]
    assert writer is not None
    return writer


async def _session_and_stopped_writer(store: SqliteStore) -> int:
    """Create session "s", then stop the writer (SIGSTOP): the next batch waits for its answer.
    Returns the writer's pid."""
    await store.create_session(SessionRecord("s", "/w", (), None, 1.0, 1.0))
    pid = _writer(store).pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    return pid


async def _sent() -> None:
    """Return once the writes the other tasks submitted have gone out to the writer: they
    wait for their answers, and the round's flush (`loop.call_soon`) has run."""
    await anyio.wait_all_tasks_blocked()
    await anyio.lowlevel.checkpoint()


def _wait_gone(pid: int) -> bool:
    return wait_gone(pid, TIMEOUT)


async def test_a_writer_killed_while_idle_is_started_again_by_the_next_write(
    tmp_path: Path,
) -> None:
    async with SqliteStore.open(tmp_path / "w.db", writer_process=True) as store:
        await store.create_session(SessionRecord("s", "/w", (), None, 1.0, 1.0))
        assert (await _insert(store, "k1", "m1")).inserted
        writer = _writer(store)
        first = writer.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert _wait_gone(first)
        outcome = await _insert(store, "k2", "m2")
        assert outcome.inserted
        assert writer.starts == 2
        assert writer.pid not in (None, first)
        assert await store.count_user_messages("s") == 2


async def test_a_writer_killed_with_a_batch_out_answers_unknown_and_the_retry_is_exact(
    tmp_path: Path,
) -> None:
    async with SqliteStore.open(tmp_path / "w.db", writer_process=True) as store:
        await store.create_session(SessionRecord("s", "/w", (), None, 1.0, 1.0))
        writer = _writer(store)
        pid = writer.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # the batch is sent, and waits for its answer
        failure: list[BaseException] = []

        async def doomed() -> None:
            try:
                await _insert(store, "key-never-shown", "m1")
            except StorageError as exc:
                failure.append(exc)

        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(doomed)
                await _sent()
                os.kill(pid, signal.SIGKILL)
        assert len(failure) == 1
        assert "may or may not have been stored" in str(failure[0])
        assert "key-never-shown" not in str(failure[0])
        # the client's retry with the same key: inserted now (the batch never ran), and once
        retried = await _insert(store, "key-never-shown", "m2")
        assert retried.inserted
        assert retried.message_id == "m2"
        again = await _insert(store, "key-never-shown", "m3")
        assert (again.inserted, again.message_id) == (False, "m2")
        assert await store.count_user_messages("s") == 1


async def test_a_hung_writer_is_killed_after_the_busy_timeout_and_its_margin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_module, "_REPLY_MARGIN_S", 0.2)
    async with SqliteStore.open(
        tmp_path / "w.db", writer_process=True, busy_timeout_ms=100
    ) as store:
        await store.create_session(SessionRecord("s", "/w", (), None, 1.0, 1.0))
        writer = _writer(store)
        pid = writer.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        with anyio.fail_after(TIMEOUT), pytest.raises(StorageError, match="may or may not"):
            await _insert(store, "k", "m1")
        assert _wait_gone(pid)  # killed, not left stopped
        assert (await _insert(store, "k", "m2")).inserted
        assert writer.starts == 2


async def test_a_cancelled_caller_does_not_abandon_its_batch(tmp_path: Path) -> None:
    async with SqliteStore.open(tmp_path / "w.db", writer_process=True) as store:
        pid = await _session_and_stopped_writer(store)
        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_insert, store, "k", "m1")
                await _sent()
                tg.cancel_scope.cancel()  # the caller waits for its batch regardless
                os.kill(pid, signal.SIGCONT)
        # the batch was written, and the socket is in step for the next one
        assert await store.count_user_messages("s") == 1
        recorded = await _insert(store, "k", "m2")
        assert (recorded.inserted, recorded.message_id) == (False, "m1")
        assert _writer(store).starts == 1


def _poll(store: SqliteStore) -> BusyPoll:
    poll = _writer(store)._poll  # pyright: ignore[reportPrivateUsage]
    assert poll is not None
    return poll


async def test_the_event_loop_polls_while_a_batch_is_out_and_sleeps_once_it_is_answered(
    tmp_path: Path,
) -> None:
    # a limit longer than the test: polling here stops only because the answer came
    async with SqliteStore.open(
        tmp_path / "w.db", writer_process=True, busy_poll_s=TIMEOUT
    ) as store:
        pid = await _session_and_stopped_writer(store)
        poll = _poll(store)
        assert not poll.polling()
        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_insert, store, "k", "m1")
                try:
                    await _sent()
                    assert poll.polling()
                    polled = poll.rounds
                    await loop_rounds(3)
                    assert poll.rounds >= polled + 3
                finally:
                    os.kill(pid, signal.SIGCONT)
        await assert_stops_polling(poll)
        assert await store.count_user_messages("s") == 1


async def test_with_no_busy_poll_time_the_event_loop_never_polls(tmp_path: Path) -> None:
    async with SqliteStore.open(tmp_path / "w.db", writer_process=True, busy_poll_s=0) as store:
        pid = await _session_and_stopped_writer(store)
        poll = _poll(store)
        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_insert, store, "k", "m1")
                try:
                    await _sent()
                    await loop_rounds(3)
                    assert not poll.polling()
                finally:
                    os.kill(pid, signal.SIGCONT)
        assert poll.rounds == 0
        assert await store.count_user_messages("s") == 1


async def test_a_negative_busy_poll_time_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="busy-poll time"):
        await SqliteStore.open(tmp_path / "w.db", writer_process=True, busy_poll_s=-1.0)


async def test_closing_the_store_waits_for_the_batch_out_then_the_writer_exits(
    tmp_path: Path,
) -> None:
    path = tmp_path / "w.db"
    results: list[InsertOutcome] = []
    async with SqliteStore.open(path, writer_process=True) as store:
        pid = await _session_and_stopped_writer(store)
        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:

                async def insert() -> None:
                    results.append(await _insert(store, "k", "m1"))

                tg.start_soon(insert)
                await _sent()
                tg.start_soon(store.aclose)
                await anyio.wait_all_tasks_blocked()
                os.kill(pid, signal.SIGCONT)
    assert [r.inserted for r in results] == [True]
    assert _wait_gone(pid)
    async with SqliteStore.open(path) as reopened:
        assert await reopened.count_user_messages("s") == 1


_CHILD = textwrap.dedent(
    """
    import sys, anyio
    from acp_once.storage import SessionRecord, SqliteStore

    async def main():
        async with SqliteStore.open(sys.argv[1], writer_process=True) as store:
            await store.create_session(SessionRecord("s", "/w", (), None, 1.0, 1.0))
            print(store._writer.pid, flush=True)
            await anyio.sleep_forever()

    anyio.run(main)
    """
)


def test_the_writer_exits_when_its_stores_process_is_killed(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path / "w.db")], stdout=subprocess.PIPE
    ) as child:
        try:
            assert child.stdout is not None
            readable, _, _ = select.select([child.stdout], [], [], TIMEOUT)
            assert readable, "the child did not open its store"
            writer_pid = int(child.stdout.readline())
        finally:
            child.kill()
            child.wait(TIMEOUT)
    assert _wait_gone(writer_pid)


async def test_frames_go_out_without_waiting_for_answers_and_are_answered_in_order(
    tmp_path: Path,
) -> None:
    """Writes of three rounds of the event loop go out as three frames while the writer is
    stopped (none waits for an answer); once it runs, each caller gets its own outcome and
    the timeline holds them in the order they went out."""
    async with SqliteStore.open(tmp_path / "w.db", writer_process=True) as store:
        pid = await _session_and_stopped_writer(store)
        writer = _writer(store)
        frames = writer.stats.batches
        outcomes: dict[str, InsertOutcome] = {}

        async def insert(n: int) -> None:
            outcomes[f"m{n}"] = await _insert(store, f"k{n}", f"m{n}")

        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:
                for round_ in range(3):
                    tg.start_soon(insert, 2 * round_)
                    tg.start_soon(insert, 2 * round_ + 1)
                    await _sent()  # this round's frame is out
                    assert writer.stats.batches == frames + round_ + 1
                assert outcomes == {}
                os.kill(pid, signal.SIGCONT)
        assert outcomes == {f"m{n}": InsertOutcome(f"m{n}", True, None) for n in range(6)}
        timeline = await store.read_timeline("s")
        assert [entry.message_id for entry in timeline] == [f"m{n}" for n in range(6)]
        assert writer.starts == 1


async def test_frames_larger_than_the_socket_takes_at_once_are_sent_as_it_drains(
    tmp_path: Path,
) -> None:
    """While the writer is stopped, frames beyond what the socket buffers wait for it to
    drain; every write is then answered and stored whole."""
    big = 256 * 1024
    async with SqliteStore.open(tmp_path / "w.db", writer_process=True) as store:
        pid = await _session_and_stopped_writer(store)
        writer = _writer(store)
        seqs: list[int] = []

        async def append(n: int) -> None:
            seqs.append(await store.append_update("s", b"x" * big + str(n).encode()))

        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:
                for n in range(8):  # 2 MiB: more than a socket pair buffers
                    tg.start_soon(append, n)
                    await anyio.wait_all_tasks_blocked()
                assert writer._unsent  # pyright: ignore[reportPrivateUsage]
                os.kill(pid, signal.SIGCONT)
        assert sorted(seqs) == list(range(1, 9))
        timeline = await store.read_timeline("s")
        assert [entry.update for entry in timeline] == [
            b"x" * big + str(n).encode() for n in range(8)
        ]
        assert not writer._unsent  # pyright: ignore[reportPrivateUsage]


async def test_the_writer_ignores_the_signals_sent_to_its_process_group(tmp_path: Path) -> None:
    async with SqliteStore.open(tmp_path / "w.db", writer_process=True) as store:
        await store.create_session(SessionRecord("s", "/w", (), None, 1.0, 1.0))
        pid = _writer(store).pid
        assert pid is not None
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            os.kill(pid, signum)
        assert (await _insert(store, "k", "m1")).inserted  # answered by the same writer
        assert _writer(store).pid == pid
        assert _writer(store).starts == 1
