"""`FdReceiveStream` over real pipes: one reader callback per stream, bounded read-ahead.

On asyncio the stream watches its pipe for its whole life and reads each chunk when it arrives;
these tests check what that must not change: bytes arrive whole and in order, a writer faster
than the receiver is held back by the pipe once the stream has read `_PAUSE_AT` bytes ahead
(never buffered without bound), the end of the stream and a close are reported, and a receiver
cancelled while waiting leaves the stream usable.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import pytest

from acp_once.transports import stdio
from acp_once.transports.stdio import FdReceiveStream

pytestmark = pytest.mark.anyio

TIMEOUT = 20


@contextmanager
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    try:
        yield r, w
    finally:
        for fd in (r, w):
            with contextlib.suppress(OSError):  # a test may have closed it already
                os.close(fd)


def watching(rx: FdReceiveStream) -> bool:
    """Whether the stream's reader callback is registered (a call, so checks are not narrowed)."""
    return rx._watching


def write_all_nonblocking(fd: int, data: bytes) -> int:
    """Write as much of `data` as the pipe takes now; return how many bytes went."""
    os.set_blocking(fd, False)
    sent = 0
    while sent < len(data):
        try:
            sent += os.write(fd, data[sent : sent + 65536])
        except BlockingIOError:
            break
    return sent


async def test_bytes_arrive_whole_and_in_order_with_small_receives() -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB with a recognisable pattern
    with anyio.fail_after(TIMEOUT), pipe() as (r, w):
        rx = FdReceiveStream(r)
        received = bytearray()

        async def writer() -> None:
            os.set_blocking(w, False)
            view = memoryview(payload)
            while view:
                try:
                    view = view[os.write(w, view[:100_000]) :]
                except BlockingIOError:
                    await anyio.wait_writable(w)
            os.close(w)

        async with anyio.create_task_group() as tg:
            tg.start_soon(writer)
            while True:
                try:
                    chunk = await rx.receive(7_777)  # smaller than what arrives at once
                except anyio.EndOfStream:
                    break
                assert 0 < len(chunk) <= 7_777
                received += chunk
        assert bytes(received) == payload
        await rx.aclose()


async def test_a_receiver_that_falls_behind_holds_the_writer_back() -> None:
    with anyio.fail_after(TIMEOUT), pipe() as (r, w):
        rx = FdReceiveStream(r)
        first = b"x" * 10
        os.write(w, first)
        assert await rx.receive() == first  # the stream now watches the pipe
        # Nobody receives for a while: the callback reads ahead until _PAUSE_AT, then stops,
        # so the pipe fills and the writer is refused.
        total = 0
        refused_rounds = 0
        while refused_rounds < 3:
            sent = write_all_nonblocking(w, b"y" * (1 << 20))
            total += sent
            if sent == 0:
                refused_rounds += 1
            # let the event loop run the reader callback (it reads what arrived)
            await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
            assert total < 64 * (1 << 20), "the stream kept reading without bound"
        assert rx._buffered <= stdio._PAUSE_AT + stdio._READ_SIZE
        assert not watching(rx)
        # The receiver catches up: everything written arrives, and the stream watches again.
        got = 0
        while got < total:
            got += len(await rx.receive(1 << 20))
        assert got == total
        assert watching(rx)
        await rx.aclose()


async def test_end_of_stream_and_close_are_reported() -> None:
    with anyio.fail_after(TIMEOUT), pipe() as (r, w):
        rx = FdReceiveStream(r)
        os.write(w, b"last")
        os.close(w)
        assert await rx.receive() == b"last"
        with pytest.raises(anyio.EndOfStream):
            await rx.receive()
        with pytest.raises(anyio.EndOfStream):  # and again: the end is remembered
            await rx.receive()
    with anyio.fail_after(TIMEOUT), pipe() as (r, w):
        rx = FdReceiveStream(r)
        outcome: list[type[BaseException]] = []
        waiting = anyio.Event()

        async def receiver() -> None:
            waiting.set()
            try:
                await rx.receive()
            except anyio.ClosedResourceError as exc:
                outcome.append(type(exc))

        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver)
            await waiting.wait()
            await anyio.lowlevel.checkpoint()  # the receiver is now parked on its waiter
            await rx.aclose()
        assert outcome == [anyio.ClosedResourceError]


async def test_a_cancelled_receive_leaves_the_stream_usable() -> None:
    with anyio.fail_after(TIMEOUT), pipe() as (r, w):
        rx = FdReceiveStream(r)
        with anyio.move_on_after(0.05) as scope:
            await rx.receive()  # nothing arrives: cancelled while waiting
        assert scope.cancelled_caught
        os.write(w, b"after")
        assert await rx.receive() == b"after"
        await rx.aclose()
