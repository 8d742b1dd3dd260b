"""`Connection(inline_reader=True)`: the peer's messages are read by the task that awaits
`serve()` (no reader task of the connection's own), with every behaviour of the reader task:
cancellation, back-pressure, the end of the connection from either side."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anyio
import orjson
import pytest

from acp_once.rpc.connection import Connection, RequestContext
from acp_once.rpc.streams import MemoryFrameStream, memory_pair

pytestmark = pytest.mark.anyio


@pytest.fixture
async def streams() -> AsyncIterator[tuple[MemoryFrameStream, MemoryFrameStream]]:
    ours, peer = memory_pair(100)
    yield ours, peer
    await ours.aclose()
    await peer.aclose()


async def recv(peer: MemoryFrameStream) -> dict[str, Any]:
    with anyio.fail_after(5):
        frame = await peer.receive()
    assert isinstance(frame, bytes)
    value = orjson.loads(frame)
    assert isinstance(value, dict)
    return value


async def send(peer: MemoryFrameStream, obj: object) -> None:
    with anyio.fail_after(5):
        await peer.send(orjson.dumps(obj))


async def test_messages_are_read_in_the_task_that_serves(
    streams: tuple[MemoryFrameStream, MemoryFrameStream],
) -> None:
    ours, peer = streams
    readers: list[asyncio.Task[Any] | None] = []

    async def on_notification(method: str, params: dict[str, Any] | None) -> None:
        readers.append(asyncio.current_task())  # notifications run inline, in the reader

    async def on_request(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        return {"echo": params}

    with anyio.fail_after(10):
        async with Connection(
            ours, on_request=on_request, on_notification=on_notification, inline_reader=True
        ) as conn:
            await send(peer, {"jsonrpc": "2.0", "method": "note"})
            await anyio.wait_all_tasks_blocked()
            assert readers == []  # nothing is read before serve()
            async with anyio.create_task_group() as tg:
                tg.start_soon(conn.serve)
                await send(peer, {"jsonrpc": "2.0", "id": 1, "method": "m", "params": {"a": 1}})
                assert await recv(peer) == {"jsonrpc": "2.0", "id": 1, "result": {"echo": {"a": 1}}}
                assert len(readers) == 1
                with pytest.raises(RuntimeError):
                    await conn.serve()  # one reader only
                await peer.aclose()  # the peer leaves: serve() returns
            assert conn.closed
            await conn.wait_closed()


async def test_serve_is_the_body_and_ends_when_the_peer_leaves(
    streams: tuple[MemoryFrameStream, MemoryFrameStream],
) -> None:
    ours, peer = streams
    serving = asyncio.current_task()
    readers: list[asyncio.Task[Any] | None] = []

    async def on_notification(method: str, params: dict[str, Any] | None) -> None:
        readers.append(asyncio.current_task())

    await send(peer, {"jsonrpc": "2.0", "method": "note"})
    await peer.aclose()
    with anyio.fail_after(10):
        async with Connection(ours, on_notification=on_notification, inline_reader=True) as conn:
            await conn.serve()
            assert conn.closed
    assert readers == [serving]


async def test_cancel_request_and_back_pressure_with_an_inline_reader(
    streams: tuple[MemoryFrameStream, MemoryFrameStream],
) -> None:
    ours, peer = streams
    started: list[int] = []
    release = anyio.Event()

    async def on_request(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        assert isinstance(ctx.id, int)
        started.append(ctx.id)
        if method == "slow":
            await anyio.sleep_forever()
        await release.wait()
        return "done"

    with anyio.fail_after(10):
        async with (
            Connection(ours, on_request=on_request, max_inflight=2, inline_reader=True) as conn,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(conn.serve)
            await send(peer, {"jsonrpc": "2.0", "id": 1, "method": "slow"})
            await send(peer, {"jsonrpc": "2.0", "id": 2, "method": "m"})
            cancel = {"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": 1}}
            await send(peer, cancel)
            cancelled = await recv(peer)
            assert cancelled["id"] == 1 and cancelled["error"]["code"] == -32800
            await send(peer, {"jsonrpc": "2.0", "id": 3, "method": "m"})
            await send(peer, {"jsonrpc": "2.0", "id": 4, "method": "m"})
            await anyio.wait_all_tasks_blocked()
            # two slots, held by 2 and 3: the reader takes no more until an answer is written
            assert started == [1, 2, 3]
            release.set()
            answers = {(await recv(peer))["id"] for _ in range(3)}
            assert answers == {2, 3, 4}
            assert started == [1, 2, 3, 4]
            await peer.aclose()


class _Broken(MemoryFrameStream):
    """Writes fail: the peer is gone, though its last frames were read."""

    async def send(self, frame: bytes) -> None:
        raise anyio.BrokenResourceError


async def test_a_failed_write_ends_serve(
    streams: tuple[MemoryFrameStream, MemoryFrameStream],
) -> None:
    ours, peer = streams
    broken = _Broken(ours._send, ours._receive)

    async def on_request(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        return 1

    with anyio.fail_after(10):
        async with Connection(broken, on_request=on_request, inline_reader=True) as conn:
            await send(peer, {"jsonrpc": "2.0", "id": 1, "method": "m"})
            await conn.serve()  # returns: the answer could not be written, the peer is open
            assert conn.closed


async def test_closing_locally_while_serving(
    streams: tuple[MemoryFrameStream, MemoryFrameStream],
) -> None:
    ours, _peer = streams
    with anyio.fail_after(10):
        async with Connection(ours, inline_reader=True) as conn, anyio.create_task_group() as tg:
            tg.start_soon(conn.serve)
            await anyio.wait_all_tasks_blocked()
            await ours.aclose()  # the server closes the stream (an idle sweep, a shutdown)
            await conn.wait_closed()
        assert conn.closed
