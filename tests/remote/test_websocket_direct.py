"""The direct WebSocket channel of `acp-once serve` (`acp_once.server.websocket_protocol`), over
real sockets: messages bypass ASGI, the frames of one event loop turn go in one write, reading
pauses while messages wait unread, a client that stops reading is dropped with its buffers
bounded; and the same app under plain uvicorn (no channel) still serves, through ASGI."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, cast
from unittest import mock

import anyio
import anyio.abc
import pytest
import uvicorn
from websockets.client import ClientProtocol
from websockets.frames import Close, Frame, Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

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


class RawClient:
    """A WebSocket client over a bare TCP stream (websockets' sans-I/O protocol): it writes
    frames in whatever pieces a test asks for, so the server's frame reader sees messages cut
    anywhere, several in one read, control frames between them."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.conn = ClientProtocol(parse_uri("ws://127.0.0.1/acp"))
        self.received: list[Frame] = []

    @classmethod
    @asynccontextmanager
    async def connect(cls, url: str) -> AsyncIterator[RawClient]:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            client = cls(stream)
            client.conn.send_request(client.conn.connect())
            await client.flush()
            while client.conn.state is not State.OPEN:
                client.conn.receive_data(await stream.receive())
                client.conn.events_received()  # the 101 response
            yield client

    async def flush(self) -> None:
        for data in self.conn.data_to_send():
            if data:
                await self.stream.send(data)

    def frames(self, *messages: bytes) -> bytes:
        """`messages` as masked text frames, not yet sent."""
        for message in messages:
            self.conn.send_text(message)
        return b"".join(self.conn.data_to_send())

    async def send_in_pieces(self, data: bytes, sizes: list[int]) -> None:
        at = 0
        for size in sizes:
            await self.stream.send(data[at : at + size])
            at += size
        if at < len(data):
            await self.stream.send(data[at:])

    async def next_frame(self) -> Frame:
        while not self.received:
            self.conn.receive_data(await self.stream.receive())
            self.received += [e for e in self.conn.events_received() if isinstance(e, Frame)]
        return self.received.pop(0)


async def echo(conn: Connection, frames: FrameStream, method: str, params: Any) -> Any:
    return params


async def test_frames_cut_anywhere_are_read_whole_and_in_order() -> None:
    # The server reads an ACP connection's text frames itself: messages of every header
    # size, cut into 1-byte pieces and joined several to a piece, arrive whole and in order
    served = Served(echo)
    sizes = [0, 100, 200, 70_000, 5]
    with anyio.fail_after(TIMEOUT):
        async with serving(served) as (url, _), RawClient.connect(url) as client:
            payloads = [request(i, "t/echo", {"pad": "x" * size}) for i, size in enumerate(sizes)]
            data = client.frames(*payloads)
            await client.send_in_pieces(data, [1] * 40 + [3, 7, 130, 1000])
            answers = [json.loads(bytes((await client.next_frame()).data)) for _ in sizes]
            assert [a["id"] for a in answers] == list(range(len(sizes)))
            assert [len(a["result"]["pad"]) for a in answers] == sizes
            (frames,) = served.streams
            assert isinstance(frames, DirectWebSocketFrames)
            protocol: Any = cast(Any, frames.channel)._protocol

            def reads_frames() -> bool | None:
                value: bool | None = protocol.reads_frames
                return value

            assert reads_frames() is True

            # a ping (as a keepalive's pong would be): websockets reads that frame alone and
            # answers it; the frames after it are read here still
            client.conn.send_ping(b"are you there")
            ping = b"".join(client.conn.data_to_send())
            await client.stream.send(ping + client.frames(request(9, "t/echo", {"n": 9})))
            pong = await client.next_frame()
            assert pong.opcode is Opcode.PONG and pong.data == b"are you there"
            assert json.loads(bytes((await client.next_frame()).data)) == {
                "jsonrpc": "2.0",
                "id": 9,
                "result": {"n": 9},
            }
            assert reads_frames() is True

            # a fragmented message: websockets reads from its first frame on, for good
            client.conn.send_text(request(10, "t/echo", {"n": 10}), fin=False)
            client.conn.send_continuation(b"", fin=True)
            await client.send_in_pieces(b"".join(client.conn.data_to_send()), [1, 2, 3])
            assert json.loads(bytes((await client.next_frame()).data))["id"] == 10
            assert reads_frames() is False
            await client.stream.send(client.frames(request(11, "t/echo", {"n": 11})))
            assert json.loads(bytes((await client.next_frame()).data))["id"] == 11


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        # a length over the server's limit (1 MiB and headroom): 1009, as websockets answers
        (b"\x81\xff" + (1 << 30).to_bytes(8, "big") + b"\x00\x00\x00\x00", 1009),
        # a client frame not masked: 1002
        (b"\x81\x05hello", 1002),
        # a binary message: not an ACP message; the connection goes on
        (b"\x82\x85\x00\x00\x00\x00hello", None),
    ],
    ids=["too-big", "unmasked", "binary"],
)
async def test_frames_the_reader_does_not_take_are_answered_as_websockets_answers(
    frame: bytes, code: int | None
) -> None:
    served = Served(echo)
    with anyio.fail_after(TIMEOUT):
        async with serving(served) as (url, _), RawClient.connect(url) as client:
            await client.stream.send(client.frames(request(1, "t/echo", {"n": 1})))
            assert json.loads(bytes((await client.next_frame()).data))["id"] == 1
            await client.stream.send(frame)
            if code is None:
                await client.stream.send(client.frames(request(2, "t/echo", {"n": 2})))
                assert json.loads(bytes((await client.next_frame()).data))["id"] == 2
            else:
                close = await client.next_frame()
                assert close.opcode is Opcode.CLOSE
                assert Close.parse(close.data).code == code
