"""The direct WebSocket channel of `acp-once serve` (`acp_once.server.websocket_protocol`), over
real sockets: messages bypass ASGI, the frames of one event loop turn go in one write, reading
pauses while messages wait unread, a client that stops reading is dropped with its buffers
bounded; and the same app under plain uvicorn (no channel) still serves, through ASGI."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from unittest import mock

import anyio
import pytest
import uvicorn

from acp_once.protocol.jsonrpc import encode_notification
from acp_once.rpc.connection import Connection, RequestContext
from acp_once.rpc.errors import ConnectionClosed
from acp_once.rpc.streams import FrameStream
from acp_once.server.app import AcpServer, create_app
from acp_once.server.listen import uvicorn_config
from acp_once.server.websocket_protocol import _PAUSE_AT, DirectChannel
from acp_once.transports.websocket import (
    ClientWebSocketFrames,
    DirectWebSocketFrames,
    ServerWebSocketFrames,
    connect_websocket,
)
from tests.remote.harness import listening_socket

pytestmark = pytest.mark.anyio

TIMEOUT = 30

Handler = Callable[[FrameStream, str, str | None], Awaitable[None]]


@asynccontextmanager
async def serving(
    handler: Handler, *, plain: bool = False, write_timeout: float = 30.0
) -> AsyncIterator[tuple[str, AcpServer]]:
    """`create_app(handler=...)` on uvicorn as `acp-once serve` runs it (`uvicorn_config`), or
    with uvicorn's own `websockets-sansio` protocol (`plain`: no direct channel)."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    app = create_app(None, handler=handler, idle_timeout=None, write_timeout=write_timeout)
    config = uvicorn_config(
        app, host="127.0.0.1", port=port, max_message_bytes=1 << 20, log_level="warning"
    )
    if plain:
        config.ws = "websockets-sansio"
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        try:
            yield f"ws://127.0.0.1:{port}/acp", app.state.acp
        finally:
            server.should_exit = True


def request(id: int, method: str, params: dict[str, Any] | None = None) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode()


async def read_until_answer(client: ClientWebSocketFrames, id: int) -> list[dict[str, Any]]:
    """Every message up to and including the answer to `id`, each parsed on its own."""
    messages: list[dict[str, Any]] = []
    while True:
        frame = await client.receive()
        assert isinstance(frame, bytes)
        messages.append(json.loads(frame))
        if messages[-1].get("id") == id:
            return messages


class Served:
    """A handler that serves each connection with an engine whose requests `on_request`
    answers; records each connection's frame stream."""

    def __init__(
        self,
        on_request: Callable[[Connection, FrameStream, str, Any], Awaitable[Any]],
        **options: Any,
    ) -> None:
        self.on_request = on_request
        self.options = options
        self.streams: list[FrameStream] = []
        self.started = anyio.Event()
        self.ended = anyio.Event()

    async def __call__(self, frames: FrameStream, name: str, tenant: str | None) -> None:
        self.streams.append(frames)
        self.started.set()

        async def handle(method: str, params: Any, ctx: RequestContext) -> Any:
            return await self.on_request(ctx.connection, frames, method, params)

        try:
            async with Connection(frames, on_request=handle, **self.options) as conn:
                await conn.wait_closed()
        finally:
            self.ended.set()


@pytest.mark.parametrize("plain", [False, True], ids=["direct", "plain-asgi"])
async def test_frames_of_one_turn_arrive_in_order_each_its_own_message(plain: bool) -> None:
    # 300 notifications made in one event loop turn, then the answer: each arrives as one
    # message, in order; through the direct channel they take a few writes, not 301
    count = 300

    async def on_request(conn: Connection, frames: FrameStream, method: str, params: Any) -> Any:
        for i in range(count):
            assert conn.send_encoded_nowait(encode_notification("t/n", {"i": i})) or plain
            if plain:
                await conn.notify("t/n", {"i": i})
        return {"done": params["round"]}

    served = Served(on_request)
    with anyio.fail_after(TIMEOUT):
        async with serving(served, plain=plain) as (url, _), connect_websocket(url) as client:
            await client.send(request(1, "t/burst", {"round": 0}))  # the first: accepted
            await read_until_answer(client, 1)
            (frames,) = served.streams
            if plain:
                assert type(frames) is ServerWebSocketFrames
                await client.send(request(2, "t/burst", {"round": 1}))
                messages = await read_until_answer(client, 2)
            else:
                assert isinstance(frames, DirectWebSocketFrames)
                channel = frames.channel
                assert isinstance(channel, DirectChannel)
                with mock.patch.object(channel, "write", wraps=channel.write) as write:
                    await client.send(request(2, "t/burst", {"round": 1}))
                    messages = await read_until_answer(client, 2)
                # 300 frames of ~40 bytes fit one outbox: one write, the answer in another
                # at most (it is made in a later turn)
                assert 1 <= write.call_count <= 3
    assert [m["params"]["i"] for m in messages[:-1]] == list(range(count))
    assert messages[-1] == {"jsonrpc": "2.0", "id": 2, "result": {"done": 1}}


async def test_reading_pauses_while_messages_wait_unread_and_nothing_is_lost() -> None:
    # The engine takes 2 requests at a time and they wait: what the client sends next waits
    # in the channel until 64 KiB, then the socket is no longer read (the kernel's buffers
    # hold the rest, then the client's writes block). Released, every request is answered.
    release = anyio.Event()
    count, pad = 600, "x" * 4000

    async def on_request(conn: Connection, frames: FrameStream, method: str, params: Any) -> Any:
        await release.wait()
        return params["i"]

    served = Served(on_request, max_inflight=2)
    peak = 0
    paused = anyio.Event()

    def track(push: Callable[[bytes], None], channel: DirectChannel) -> Callable[[bytes], None]:
        def pushed(message: bytes) -> None:
            nonlocal peak
            push(message)
            peak = max(peak, channel.queued)
            if channel._protocol.read_paused:
                paused.set()

        return pushed

    with anyio.fail_after(TIMEOUT):
        async with (
            serving(served) as (url, _),
            connect_websocket(url, ping_interval=None) as client,
            anyio.create_task_group() as tg,
        ):
            await served.started.wait()
            (frames,) = served.streams
            assert isinstance(frames, DirectWebSocketFrames)
            channel = frames.channel
            assert isinstance(channel, DirectChannel)

            async def send_all() -> None:
                for i in range(count):
                    await client.send(request(i, "t/wait", {"i": i, "pad": pad}))

            with mock.patch.object(channel, "_push", track(channel._push, channel)):
                tg.start_soon(send_all)
                await paused.wait()
                release.set()
                answers: dict[int, Any] = {}
                while len(answers) < count:
                    frame = await client.receive()
                    assert isinstance(frame, bytes)
                    answer = json.loads(frame)
                    answers[answer["id"]] = answer["result"]
    assert answers == {i: i for i in range(count)}
    # what waited unread: under the pause mark plus what one read of the socket brought
    assert _PAUSE_AT <= peak <= _PAUSE_AT + 256 * 1024 + 4096
    assert peak < count * len(pad) // 4


async def test_a_client_that_stops_reading_is_dropped_and_its_buffer_stays_bounded() -> None:
    # The server writes 16 KiB notifications to a client that reads nothing: the socket's
    # buffer fills, the engine's writes wait (the transport's buffer stays near its
    # high-water mark), and after write_timeout the TCP connection is dropped at once.
    frame_pad = "y" * 16 * 1024
    largest = 0
    sent = 0

    async def on_request(conn: Connection, frames: FrameStream, method: str, params: Any) -> Any:
        nonlocal largest, sent
        assert isinstance(frames, DirectWebSocketFrames)
        channel = frames.channel
        assert isinstance(channel, DirectChannel)
        transport = channel._protocol.transport
        try:
            # bounded: were writes not held back, this loop would never wait for anything
            while sent < 256 * 1024 * 1024:
                await conn.notify("t/flood", {"pad": frame_pad})
                sent += len(frame_pad)
                largest = max(largest, transport.get_write_buffer_size())
        except ConnectionClosed:
            return None
        return "never held back"

    served = Served(on_request)
    with anyio.fail_after(TIMEOUT):
        async with (
            serving(served, write_timeout=0.5) as (url, _),
            connect_websocket(url, ping_interval=None) as client,
        ):
            await client.send(request(1, "t/flood"))
            await served.ended.wait()
            (frames,) = served.streams
            assert isinstance(frames, ServerWebSocketFrames) and frames.stalled
            # the connection was dropped, not closed: what was buffered, then the end
            with pytest.raises(anyio.EndOfStream):
                while True:
                    await client.receive()
            assert client.close_code != 1000
    # the kernel's buffers took megabytes; the process held a high-water mark's worth, the
    # outbox (64 KiB) and one frame at most
    assert sent > 4 * largest
    assert largest <= 64 * 1024 + 64 * 1024 + 2 * len(frame_pad) + 1024
