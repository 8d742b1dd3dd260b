"""`ServerHttpFrames` alone: how the messages of one event loop turn reach an SSE stream (one
write, every message, in order), through ASGI events or a server's direct writer, and what a
reader's end, a stalled reader and the connection's end do to them."""

from __future__ import annotations

import json
from collections.abc import Callable, MutableMapping
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from acp_once.transports.http import SSE_EXTENSION, Flag, ServerHttpFrames

pytestmark = pytest.mark.anyio

TIMEOUT = 10


def response(id_: int) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": id_, "result": {"n": id_}}).encode()


def update(sid: str, n: int) -> bytes:
    params = {"sessionId": sid, "update": {"n": n}}
    return json.dumps({"jsonrpc": "2.0", "method": "session/update", "params": params}).encode()


def events(chunk: bytes) -> list[dict[str, Any]]:
    """The messages of the SSE events in `chunk` (every event a `data:` line and a blank)."""
    assert chunk.endswith(b"\n\n")
    parsed = []
    for event in chunk[:-2].split(b"\n\n"):
        assert event.startswith(b"data: ") and b"\n" not in event
        parsed.append(json.loads(event[6:]))
    return parsed


class AsgiReader:
    """An SSE response's ASGI `send` and `receive`: the body chunks written, the disconnect
    reported when `leave` is called."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.chunks: list[bytes] = []
        self.wrote = anyio.Event()
        self.ended = False
        self._left = anyio.Event()

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200
            self.started.set()
        elif message.get("more_body"):
            self.chunks.append(message["body"])
            self.wrote.set()
        else:
            self.ended = True

    async def receive(self) -> MutableMapping[str, Any]:
        await self._left.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self._left.set()

    async def next_write(self) -> list[dict[str, Any]]:
        await self.wrote.wait()
        self.wrote = anyio.Event()
        chunk = self.chunks[-1]
        return events(chunk)


class DirectWriter:
    """A server's `SseWriter`: records each write; `full` makes it not writable."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.full = False
        self.room = anyio.Event()
        self.lost: Callable[[], object] | None = None

    @property
    def writable(self) -> bool:
        return not self.full

    def write(self, data: bytes) -> None:
        assert not self.full
        self.chunks.append(data)

    async def wait_writable(self) -> None:
        while self.full:
            await self.room.wait()

    def on_lost(self, callback: Callable[[], object] | None) -> None:
        self.lost = callback


def sse_scope(writer: DirectWriter | None = None) -> dict[str, Any]:
    """A GET's ASGI scope, offering `writer` as the server's `SseWriter` when given."""
    scope: dict[str, Any] = {"type": "http", "method": "GET", "headers": [(b"accept", b"x")]}
    if writer is not None:
        scope["extensions"] = {SSE_EXTENSION: {"writer": writer}}
    return scope


async def wait_for(predicate: Callable[[], bool]) -> None:
    """Until `predicate()`, checking at each turn of the event loop (bounded by the caller)."""
    while not predicate():
        await anyio.lowlevel.checkpoint()


async def test_one_turns_messages_go_out_as_one_write_in_order_through_asgi() -> None:
    frames = ServerHttpFrames("c1")
    reader = AsgiReader()
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            scope = sse_scope()
            tg.start_soon(frames.stream, "s1", scope, reader.receive, reader.send)
            await reader.started.wait()
            await wait_for(lambda: frames.reading("s1"))
            assert scope["headers"] == []  # not held for the life of the stream
            prompt = {"jsonrpc": "2.0", "id": 7, "method": "session/prompt"}
            await frames.post(b"{}", {**prompt, "params": {"sessionId": "s1"}}, "s1")
            assert await frames.receive() == b"{}"
            batch = [response(7), update("s1", 1), update("s1", 2), update("s1", 3)]
            frames.send_frames_nowait(batch)
            got = await reader.next_write()
            assert [m.get("id", m.get("params", {}).get("update")) for m in got] == [
                7,
                {"n": 1},
                {"n": 2},
                {"n": 3},
            ]
            assert len(reader.chunks) == 1
            # the next turn's messages: the next write
            frames.send_frames_nowait([update("s1", 4)])
            assert [m["params"]["update"]["n"] for m in await reader.next_write()] == [4]
            reader.leave()
        assert reader.ended
        assert not frames.reading("s1") and frames.scopes == 0  # the entry ended with it


async def test_messages_of_several_scopes_in_one_turn_go_to_their_streams() -> None:
    frames = ServerHttpFrames("c1")
    connection, session = AsgiReader(), AsgiReader()
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(frames.stream, None, sse_scope(), connection.receive, connection.send)
            tg.start_soon(frames.stream, "s1", sse_scope(), session.receive, session.send)
            await wait_for(lambda: frames.reading(None) and frames.reading("s1"))
            frames.send_frames_nowait([update("s1", 1), response(3), update("s1", 2)])
            assert [m["params"]["update"]["n"] for m in await session.next_write()] == [1, 2]
            assert [m["id"] for m in await connection.next_write()] == [3]
            await frames.aclose()
        assert connection.ended and session.ended


async def test_a_direct_writer_gets_each_turn_as_one_write_without_the_reader_task() -> None:
    frames = ServerHttpFrames("c1")
    reader, writer = AsgiReader(), DirectWriter()
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(frames.stream, "s1", sse_scope(writer), reader.receive, reader.send)
            # until the reader task waits for messages
            await wait_for(
                lambda: writer.lost is not None and frames.outlet("s1").waiter is not None
            )
            frames.send_frames_nowait([update("s1", 1), update("s1", 2)])
            # written within the call: nothing waits for the reader task
            assert len(writer.chunks) == 1
            assert [m["params"]["update"]["n"] for m in events(writer.chunks[0])] == [1, 2]
            assert frames.waiting("s1") == []

            # a full socket: messages wait, then leave together, in order, once there is room
            writer.full = True
            frames.send_frames_nowait([update("s1", 3)])
            frames.send_frames_nowait([update("s1", 4)])
            assert len(writer.chunks) == 1 and len(frames.waiting("s1")) == 2
            writer.full = False
            writer.room.set()
            frames.send_frames_nowait([update("s1", 5)])
            await wait_for(lambda: not frames.waiting("s1"))
            written = [m["params"]["update"]["n"] for c in writer.chunks for m in events(c)]
            assert written == [1, 2, 3, 4, 5]

            # the server reports the socket gone: the reader ends, the connection does not
            assert writer.lost is not None
            writer.lost()
        assert not frames.reading("s1") and not frames.closed.is_set()
        assert reader.chunks == []  # nothing went through ASGI events but the start and end


async def test_a_stalled_direct_reader_ends_the_connection_after_write_timeout() -> None:
    frames = ServerHttpFrames("c1", write_timeout=0.2)
    reader, writer = AsgiReader(), DirectWriter()
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(frames.stream, "s1", sse_scope(writer), reader.receive, reader.send)
            await wait_for(lambda: frames.reading("s1"))
            writer.full = True
            frames.send_frames_nowait([update("s1", 1)])
            await frames.closed.wait()
        assert frames.stalled and not reader.ended  # the end could not be written either
        with pytest.raises(anyio.ClosedResourceError):
            frames.send_frames_nowait([update("s1", 2)])


async def test_keepalive_comment_after_silence_only() -> None:
    frames = ServerHttpFrames("c1", keepalive=0.2)
    reader = AsgiReader()
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(frames.stream, None, sse_scope(), reader.receive, reader.send)
            await reader.wrote.wait()
            assert reader.chunks == [b":\n\n"]
            reader.leave()


async def test_keepalive_counts_silence_from_the_last_message() -> None:
    """Messages more often than `keepalive` keep the stream free of comments (the alarm set
    before them rings early and is set again for what is left); the comment comes a whole
    `keepalive` after the last message."""
    frames = ServerHttpFrames("c1", keepalive=1.0)
    reader = AsgiReader()
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(frames.stream, "s1", sse_scope(), reader.receive, reader.send)
            await reader.started.wait()
            for n in range(15):  # 1.5 s of messages, 0.1 s apart: the scenario's pace
                frames.send_frames_nowait([update("s1", n)])
                await reader.next_write()
                await anyio.sleep(0.1)
            last = anyio.current_time()
            assert b":\n\n" not in reader.chunks
            while reader.chunks[-1] != b":\n\n":
                reader.wrote = anyio.Event()  # no write can come between the check and here
                await reader.wrote.wait()
            assert anyio.current_time() - last >= 0.85  # a whole keepalive, less the last sleep
            reader.leave()


async def test_initialize_call_is_answered_in_its_post_and_ends_with_the_connection() -> None:
    frames = ServerHttpFrames("c1")
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize"}
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:

            async def engine() -> None:
                assert await frames.receive() == b"init"
                frames.send_frames_nowait([json.dumps({"jsonrpc": "2.0", "id": 0}).encode()])

            tg.start_soon(engine)
            answer = await frames.call(b"init", init)
        assert json.loads(answer)["id"] == 0
        assert frames.scopes == 0  # the answer went to the POST, to no stream
        async with anyio.create_task_group() as tg:
            tg.start_soon(frames.aclose)
            with pytest.raises(anyio.ClosedResourceError):
                await frames.call(b"init", {**init, "id": 1})


async def test_posts_wait_for_room_and_end_with_the_connection() -> None:
    frames = ServerHttpFrames("c1")
    message = {"jsonrpc": "2.0", "method": "n"}
    with anyio.fail_after(TIMEOUT):
        for n in range(ServerHttpFrames.INBOX):
            await frames.post(str(n).encode(), message, None)
        posted = anyio.Event()

        async def one_more() -> None:
            await frames.post(b"last", message, None)
            posted.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(one_more)
            await wait_for(lambda: len(frames._room) == 1)  # the POST waits for room
            assert not posted.is_set()
            assert await frames.receive() == b"0"
            await posted.wait()
        taken = [await frames.receive() for _ in range(ServerHttpFrames.INBOX)]
        assert taken[-1] == b"last" and taken[0] == b"1"
        await frames.aclose()
        with pytest.raises(anyio.EndOfStream):
            await frames.receive()
        with pytest.raises(anyio.ClosedResourceError):
            await frames.post(b"x", message, None)


async def test_flag_wakes_every_waiter_once_set_and_survives_a_cancelled_one() -> None:
    flag = Flag()
    woken: list[int] = []

    async def waiter(n: int) -> None:
        await flag.wait()
        woken.append(n)

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as gone:
                gone.cancel()
                await flag.wait()  # cancelled while waiting: the flag is unaffected
            tg.start_soon(waiter, 1)
            tg.start_soon(waiter, 2)
            await wait_for(lambda: flag._waiter is not None)
            assert not flag.is_set()
            flag.set()
        assert sorted(woken) == [1, 2] and flag.is_set()
        await flag.wait()  # set: returns at once
