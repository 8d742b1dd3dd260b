"""The engine's write path over real pipes: queued frames, partial writes, a stalled reader.

Frames sent in one event loop turn are written together (the outbox), except to a peer that
sent one frame and waits, which gets each frame at once; a frame the pipe cannot take whole is
finished under the send lock before anything else. These tests check the promises that
matter: frames are never torn or reordered, frames sent before a close are written, and a peer
that stops reading ends the connection within `send_timeout`.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import orjson
import pytest

from acp_once.protocol.framing import LineFramer
from acp_once.protocol.jsonrpc import encode_notification
from acp_once.rpc.connection import Connection, RequestContext
from acp_once.rpc.errors import ConnectionClosed
from acp_once.rpc.tasks import TaskPool, cancel_scope_factory
from acp_once.transports.stdio import ByteStreamFrames, FdReceiveStream, FdSendStream

pytestmark = pytest.mark.anyio

TIMEOUT = 20


@contextmanager
def duplex() -> Iterator[tuple[ByteStreamFrames, int, int]]:
    """A frame stream over two real pipes; yields it with the write end of its input and the
    read end of its output."""
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    try:
        yield ByteStreamFrames(FdReceiveStream(in_r), FdSendStream(out_w)), in_w, out_r
    finally:
        for fd in (out_r, out_w, in_r, in_w):
            os.close(fd)


@contextmanager
def pipes() -> Iterator[tuple[ByteStreamFrames, int]]:
    """`duplex` for tests that write only: the stream (whose input nobody writes to) and the
    read end of its output."""
    with duplex() as (stream, _, out_r):
        yield stream, out_r


@asynccontextmanager
async def connection(stream: ByteStreamFrames, **options: float) -> AsyncIterator[Connection]:
    async with Connection(stream, **options) as conn:  # type: ignore[arg-type]
        yield conn


async def read_frames(fd: int, count: int) -> list[bytes]:
    """Read `count` whole frames from the pipe (waiting for them; bounded by the caller)."""
    rx = FdReceiveStream(fd)
    framer = LineFramer()
    frames: list[bytes] = []
    while len(frames) < count:
        for event in framer.feed(await rx.receive(65536)):
            assert isinstance(event, bytes)
            frames.append(event)
    return frames


def drain_available(fd: int) -> bytes:
    """Everything the pipe holds now."""
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data += chunk


@pytest.mark.parametrize("burst", [True, False])
async def test_frames_from_concurrent_senders_arrive_whole_and_in_order(burst: bool) -> None:
    # frames bigger than the pipe's buffer force partial writes and waits for room, while
    # small frames from other tasks queue behind them; frames are queued (a burst) or each
    # written at once (a peer that waits)
    sizes = {"a": 10, "b": 200_000, "c": 3_000}
    per_sender = 20
    with anyio.fail_after(TIMEOUT), pipes() as (stream, out_r):
        stream.burst = burst
        async with connection(stream) as conn:

            async def sender(name: str) -> None:
                for i in range(per_sender):
                    await conn.notify("t/frame", {"who": name, "i": i, "pad": "x" * sizes[name]})
                    if i % 3 == 0:
                        await anyio.lowlevel.checkpoint()

            async with anyio.create_task_group() as tg:
                for name in sizes:
                    tg.start_soon(sender, name)
                frames = await read_frames(out_r, per_sender * len(sizes))
    seen: dict[str, list[int]] = {name: [] for name in sizes}
    for frame in frames:
        params = orjson.loads(frame)["params"]
        assert len(params["pad"]) == sizes[params["who"]]
        seen[params["who"]].append(params["i"])
    assert seen == {name: list(range(per_sender)) for name in sizes}


def _request(request_id: int) -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "id": request_id, "method": "t/work"}) + b"\n"


@pytest.mark.parametrize("burst", [False, True])
async def test_a_peer_that_waits_gets_each_frame_at_once_a_burst_gets_them_together(
    burst: bool,
) -> None:
    # In the handler, right after a notification is sent (no await in between, so the same
    # event loop turn): with one request read, its frame is in the pipe already; with two
    # requests read at once, it waits in the outbox for the end of the turn.
    in_pipe: list[bytes] = []
    with anyio.fail_after(TIMEOUT), duplex() as (stream, in_w, out_r):

        async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
            await conn.notify("t/progress", {"of": ctx.id})
            in_pipe.append(drain_available(out_r))
            return {"done": ctx.id}

        async with Connection(stream, on_request=handler) as conn:
            os.write(in_w, _request(1) + _request(2) if burst else _request(1))
            expected = 4 if burst else 2
            data = b""
            while (b"".join(in_pipe) + data).count(b"\n") < expected:
                await anyio.wait_readable(out_r)
                data += drain_available(out_r)
    if burst:
        assert in_pipe == [b"", b""]
    else:
        assert [orjson.loads(line) for line in in_pipe[0].splitlines()] == [
            {"jsonrpc": "2.0", "method": "t/progress", "params": {"of": 1}}
        ]
    lines = [orjson.loads(line) for line in data.splitlines()]
    assert {"jsonrpc": "2.0", "id": 1, "result": {"done": 1}} in lines


def fill(stream: ByteStreamFrames) -> int:
    """Fill the stream's pipe with whole filler frames; return how many."""
    fd = stream._tx._fd  # type: ignore[attr-defined]
    filler = b'{"jsonrpc":"2.0","method":"t/filler"}\n'
    count = 0
    while True:
        try:
            os.write(fd, filler)
        except BlockingIOError:
            return count
        count += 1


async def test_a_frame_sent_while_queued_ones_wait_for_room_goes_after_them() -> None:
    with anyio.fail_after(TIMEOUT), pipes() as (stream, out_r):
        async with connection(stream) as conn, anyio.create_task_group() as tg:
            fillers = fill(stream)
            go = anyio.Event()
            frames: list[bytes] = []

            async def reader() -> None:
                await go.wait()
                frames.extend(await read_frames(out_r, fillers + 3))

            tg.start_soon(reader)
            await conn.notify("t/frame", {"i": 0})  # queued
            await conn.notify("t/frame", {"i": 1})
            await anyio.lowlevel.checkpoint()  # the end-of-turn write finds the pipe full
            go.set()
            await conn.notify("t/frame", {"i": 2})  # must go after 0 and 1, which wait for room
    numbers = [orjson.loads(f)["params"]["i"] for f in frames if b"t/frame" in f]
    assert numbers == [0, 1, 2]
    assert all(b"t/frame" not in f for f in frames[:fillers])


async def test_a_frame_written_at_once_into_a_full_pipe_is_finished_before_the_next() -> None:
    with anyio.fail_after(TIMEOUT), pipes() as (stream, out_r):
        async with connection(stream) as conn, anyio.create_task_group() as tg:
            stream.burst = False  # a peer that waits: frames are written at once
            fillers = fill(stream)
            frames: list[bytes] = []
            big = encode_notification("t/frame", {"i": 0, "pad": "x" * 100_000})
            assert conn.send_encoded_nowait(big)  # taken: its rest is finished by a task
            assert not conn.send_encoded_nowait(b"{}")  # anything else must wait for it
            tg.start_soon(conn.notify, "t/frame", {"i": 1})
            frames.extend(await read_frames(out_r, fillers + 2))
    numbers = [orjson.loads(f)["params"]["i"] for f in frames if b"t/frame" in f]
    assert numbers == [0, 1]
    assert all(b"t/frame" not in f for f in frames[:fillers])


async def test_frames_queued_before_a_close_are_written() -> None:
    with anyio.fail_after(TIMEOUT), pipes() as (stream, out_r):
        async with connection(stream) as conn:
            for i in range(3):
                await conn.notify("t/frame", {"i": i})
            # no checkpoint: the frames are still queued when the connection closes
        data = drain_available(out_r)
    assert [orjson.loads(line)["params"]["i"] for line in data.splitlines()] == [0, 1, 2]


async def test_a_reader_that_stops_reading_closes_the_connection() -> None:
    with anyio.fail_after(TIMEOUT), pipes() as (stream, out_r):
        async with connection(stream, send_timeout=0.3) as conn:
            with pytest.raises(ConnectionClosed):
                for i in range(10_000):  # far more than the pipe holds
                    await conn.notify("t/frame", {"i": i, "pad": "x" * 4_000})
            assert conn.closed
        data = drain_available(out_r)
    lines = data.split(b"\n")
    # every complete line is a whole frame, in order; only the last may be cut by the close
    numbers = [orjson.loads(line)["params"]["i"] for line in lines[:-1]]
    assert numbers == list(range(len(numbers)))
    assert numbers


async def test_a_stalled_reader_closes_the_connection_after_queued_frames() -> None:
    # the pipe is full before the frame is queued: the end-of-turn write cannot finish, and
    # the task that waits for room gives up after send_timeout
    with anyio.fail_after(TIMEOUT), pipes() as (stream, _):
        async with connection(stream, send_timeout=0.3) as conn:
            fill(stream)
            await conn.notify("t/frame", {"i": 0})  # queued: the call itself does not wait
            await conn.wait_closed()
            with pytest.raises(ConnectionClosed):
                await conn.notify("t/frame", {"i": 1})


async def test_a_task_pool_runs_calls_and_lets_failures_reach_the_task_group() -> None:
    ran: list[int] = []

    async def work(i: int) -> None:
        ran.append(i)

    async def fail() -> None:
        raise ValueError("boom")

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            pool = TaskPool.of(tg)
            assert TaskPool.of(tg) is pool
            for round_ in range(3):  # later rounds run in parked tasks of earlier ones
                for i in range(5):
                    pool.start_soon(work, round_ * 5 + i)
                while len(ran) < (round_ + 1) * 5:
                    await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        assert sorted(ran) == list(range(15))
        with pytest.raises(ExceptionGroup) as failed:
            async with anyio.create_task_group() as tg:
                TaskPool.of(tg).start_soon(work, 99)
                await anyio.lowlevel.checkpoint()
                TaskPool.of(tg).start_soon(fail)  # runs in the task that ran work(99)
                await anyio.sleep_forever()
        assert [str(e) for e in failed.value.exceptions] == ["boom"]
        assert ran[-1] == 99


async def test_a_call_for_a_task_cancelled_while_parked_goes_elsewhere() -> None:
    # A parked task waits on a bare future: cancelling its group cancels that future at once,
    # while the task itself resumes (and leaves the pool) only later. A call handed over in
    # between must not fail the caller; it is started in a task of its own instead.
    ran: list[int] = []

    async def work(i: int) -> None:
        ran.append(i)

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            pool = TaskPool.of(tg)
            pool.start_soon(work, 1)
            while not ran:
                await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()  # the task that ran work(1) is parked now
            assert len(pool._idle) == 1
            tg.cancel_scope.cancel()
            pool.start_soon(work, 2)  # raised InvalidStateError when handed to the parked task
            assert pool._idle == []
        assert ran[0] == 1


async def test_scopes_from_the_factory_are_the_backends_own_and_cancel() -> None:
    # cancel_scope_factory returns the class anyio.CancelScope() would build, called directly:
    # a scope from it must nest, shield and cancel like any other.
    new_scope = cancel_scope_factory()
    reached: list[str] = []
    with anyio.fail_after(TIMEOUT):
        with new_scope() as outer:
            assert isinstance(outer, anyio.CancelScope)
            assert type(outer) is type(anyio.CancelScope())
            with new_scope() as inner:
                inner.cancel()
                await anyio.lowlevel.checkpoint()
                reached.append("not cancelled")  # pragma: no cover
            assert inner.cancelled_caught
            outer.cancel()
            await anyio.lowlevel.checkpoint()
            reached.append("not cancelled either")  # pragma: no cover
        assert outer.cancelled_caught
    assert reached == []
