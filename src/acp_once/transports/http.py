"""Streamable HTTP (R68): one ACP connection over POSTs in and SSE GET streams out.

- `ServerHttpFrames`: the agent side of one connection, a `FrameStream` fed by the HTTP
  handlers (`post`, `call` for the initialize POST whose answer is its response body) and
  drained by SSE readers (`stream`). Outgoing messages are routed by scope: a response goes to
  the session stream when its request was posted with `Acp-Session-Id`, else to the connection
  stream; a notification or request goes to the stream of its `params.sessionId`, if any.
  While no reader of a scope is attached, its messages wait in a bounded buffer; overflowing
  it closes the connection. The engine hands over the messages of one event loop turn together
  (a `NowaitFrameStream`), and each stream writes those of its scope as one chunk: through the
  server's `SseWriter` (`SSE_EXTENSION`) as they are sent, else by the stream's task with one
  ASGI event. Nothing is replayed: a message written to a reader that vanished
  is lost (its request's outcome is unknown to the client).
- `connect_http(url)`: the client side with httpx. The first frame sent (initialize) is
  POSTed without `Acp-Connection-Id` and its 200 body is the first frame received; then the
  connection stream is opened, and each session's stream when its id first appears in a sent
  message. The answer to an agent's request (a permission request) is POSTed with the
  `Acp-Session-Id` of the stream that request came on (the TypeScript SDK's server refuses it
  with 400 otherwise). A failed POST raises `anyio.BrokenResourceError`; a lost GET stream
  ends the connection (`receive()` raises `anyio.EndOfStream`), since responses on it may be
  lost.

A POST carries one message, never a batch array (D43: the per-message headers cannot
describe one); `ClientHttpFrames.carries_batches` tells the engine so.

Only JSON-RPC envelope fields are read here (`id`, `method`, `params.sessionId`): transports
know no method names.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, cast

import anyio
import anyio.abc
import anyio.lowlevel
import httpx
import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from acp_once.protocol.framing import FrameEvent
from acp_once.support.refusals import describe_refusal
from acp_once.transports.websocket import CONNECTION_ID_HEADER

__all__ = [
    "CONNECTION_ID_HEADER",
    "DEFAULT_SSE_KEEPALIVE",
    "DEFAULT_STREAM_BUFFER",
    "Flag",
    "SESSION_ID_HEADER",
    "SSE_EXTENSION",
    "ClientHttpFrames",
    "HttpRejected",
    "ServerHttpFrames",
    "SseResponse",
    "SseWriter",
    "connect_http",
    "message_session_id",
]

logger = logging.getLogger("acp_once.transports.http")

SESSION_ID_HEADER = "Acp-Session-Id"
DEFAULT_STREAM_BUFFER = 1000
"""Messages kept per scope while no SSE reader is attached; one more closes the connection."""
MAX_SESSION_REQUESTS = 10_000
"""Requests posted with `Acp-Session-Id` remembered until answered; beyond it the oldest is
forgotten (its answer then goes to the connection stream). Bounds what a client gets by posting
requests the engine answers with `id: null` (never matched)."""
DEFAULT_SSE_KEEPALIVE = 15.0
"""Seconds an SSE stream may be silent before a comment line (`:`) is written on it, as the
TypeScript SDK's server does: Node's fetch ends a body silent for 300 s (and the SDK's client
then its whole connection), proxies sooner. Comments are not messages: they do not count against
the idle timeout."""


def message_session_id(message: Mapping[str, Any]) -> str | None:
    """`params.sessionId` of a JSON-RPC message, when it is a string."""
    params = message.get("params")
    if isinstance(params, dict):
        sid = params.get("sessionId")
        if isinstance(sid, str):
            return sid
    return None


def _id_key(value: Any) -> str:
    kind = type(value)
    if kind is str:
        return f"s{value}"
    if kind is int:
        return "i" + str(value)
    return json.dumps(value, sort_keys=True)


def _parse(frame: bytes) -> Any:
    """The JSON value of `frame`, or None when it is not JSON (orjson first: it is faster, and
    json where orjson refuses what json reads, such as integers beyond 64 bits)."""
    try:
        return orjson.loads(frame)
    except orjson.JSONDecodeError:
        try:
            return json.loads(frame)
        except (ValueError, RecursionError):
            return None


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def _sse(frames: Iterable[bytes]) -> bytes:
    """`frames` as SSE events, one `data:` line each (a frame holds no newline)."""
    return b"".join([b"data: " + frame + b"\n\n" for frame in frames])


class SseWriter(Protocol):
    """A server's way to write a started SSE response's body without an ASGI event per write
    (`acp-once serve`'s HTTP protocol offers one as the scope extension `SSE_EXTENSION`)."""

    @property
    def writable(self) -> bool:
        """False while the socket's write buffer is above its high-water mark: write nothing."""
        ...

    def write(self, data: bytes) -> None:
        """Write `data` as body bytes now (into the socket or its transport's buffer).

        Raises:
            anyio.BrokenResourceError: the connection is gone.
        """
        ...

    async def wait_writable(self) -> None:
        """Wait until `writable`, or the connection is gone."""
        ...

    def on_lost(self, callback: Callable[[], object] | None) -> None:
        """Call `callback` (once) when the connection is lost; None: no longer."""
        ...


SSE_EXTENSION = "acp_once.sse_writer"
"""The ASGI scope extension (`{"writer": SseWriter}`) an SSE response may write through."""


class Flag:
    """A one-way flag with `anyio.Event`'s `set`, `is_set` and `wait`, holding no event (and
    no queue of waiters) until someone waits: a connection has two, and there may be many
    connections."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._set = True
        waiter, self._waiter = self._waiter, None
        _wake(waiter)

    def is_set(self) -> bool:
        return self._set

    async def wait(self) -> None:
        """Return once `set` was called (at once if it was)."""
        if self._set:
            await anyio.lowlevel.checkpoint()
            return
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._waiter)


class _Outlet:
    """One scope's stream: the messages waiting for its reader, and whether one is attached.

    With a reader that writes directly (`direct`), messages are written as they are sent, and
    wait here only while its socket's buffer is full."""

    __slots__ = ("direct", "due", "ended", "frames", "reading", "scope", "waiter", "written")

    def __init__(self) -> None:
        self.frames: list[bytes] = []  # always taken whole: a list is smaller than a deque
        self.reading = False
        self.ended = False
        """Set when the attached reader is to end (`end`)."""
        self.waiter: asyncio.Future[None] | None = None
        """Set while the reader task waits for messages (a direct reader may be written to)."""
        self.scope: anyio.CancelScope | None = None
        """Set while the reader waits on anything else (`end` cancels it)."""
        self.direct: SseWriter | None = None
        self.written = 0.0
        """`time.monotonic()` of the last write to the reader (for the keep-alive comment)."""
        self.due = 0.0
        """When the reader's keep-alive alarm rings (`_Alarms`); 0.0: none is set."""

    def end(self) -> None:
        """End the attached reader: it leaves its wait for messages, or is cancelled out of
        any other wait, and writes nothing more."""
        self.ended = True
        if self.scope is not None:
            self.scope.cancel()
        _wake(self.waiter)

    def __lt__(self, other: _Outlet) -> bool:
        """Any order: for alarms due at the same time (`_Alarms`)."""
        return id(self) < id(other)


class _Alarms:
    """The keep-alive alarms of the SSE readers of one event loop, on one timer: a heap of
    (due, outlet) and a timer armed for the earliest. Each idle stream holds a tuple in the
    heap, not a timer handle of its own (with uvloop, a handle, its context and a libuv
    timer: ~0.6 KiB). An alarm whose outlet's `due` has changed since (its reader ended, or
    set another) is dropped when it rings."""

    __slots__ = ("_at", "_heap", "_timer")

    def __init__(self) -> None:
        self._heap: list[tuple[float, _Outlet]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0

    def set(self, outlet: _Outlet, due: float) -> None:
        """Wake `outlet`'s reader at `due` (`time.monotonic()`), unless its `due` changes."""
        outlet.due = due
        heapq.heappush(self._heap, (due, outlet))
        if self._timer is None or due < self._at:
            self._arm(due)

    def _arm(self, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = due
        delay = max(0.0, due - time.monotonic())
        self._timer = asyncio.get_running_loop().call_later(delay, self._ring)

    def _ring(self) -> None:
        self._timer = None
        heap = self._heap
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            due, outlet = heapq.heappop(heap)
            if outlet.due == due:
                outlet.due = 0.0
                _wake(outlet.waiter)
        if heap:
            self._arm(heap[0][0])


_ALARMS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Alarms] = weakref.WeakKeyDictionary()


def _alarms(loop: asyncio.AbstractEventLoop) -> _Alarms:
    """The `_Alarms` of `loop`."""
    alarms = _ALARMS.get(loop)
    if alarms is None:
        alarms = _ALARMS[loop] = _Alarms()
    return alarms


def _sse_writer(scope: Scope) -> SseWriter | None:
    """The `SseWriter` a server offers in `scope` (`SSE_EXTENSION`), if any."""
    extensions = scope.get("extensions")
    offered = extensions.get(SSE_EXTENSION) if extensions else None
    writer = offered.get("writer") if isinstance(offered, dict) else None
    return cast("SseWriter | None", writer)


_UNWATCHED = contextlib.nullcontext()
"""What a direct reader enters instead of the task group of a reader that watches ASGI's
`receive` for the peer's disconnect (a `nullcontext` may be entered any number of times)."""


class ServerHttpFrames:
    """The agent side of one Streamable HTTP connection (see the module docstring).

    A `NowaitFrameStream`: the engine hands over the messages of one event loop turn together
    (`send_frames_nowait`), and each SSE stream writes those of its scope as one body chunk (one
    system call), never waiting on a reader: messages wait in a bounded buffer per scope.

    `write_timeout`: seconds an SSE write may wait for a reader that stopped reading (its
    socket's send buffer full) before the connection ends (`stalled`). `keepalive`: seconds of
    silence on an SSE stream before a comment line is written on it (`DEFAULT_SSE_KEEPALIVE`;
    None: never). `on_close`: called once, when the connection ends, before its streams do.
    """

    burst = True
    """Always (see `NowaitFrameStream.burst`): the messages of one event loop turn for one
    stream leave in one write."""

    def __init__(
        self,
        connection_id: str,
        *,
        buffer: int = DEFAULT_STREAM_BUFFER,
        write_timeout: float | None = None,
        keepalive: float | None = DEFAULT_SSE_KEEPALIVE,
        on_close: Callable[[], object] | None = None,
    ) -> None:
        if buffer < 1:
            raise ValueError("buffer must be positive")
        if keepalive is not None and keepalive <= 0:
            raise ValueError("keepalive must be positive (or None)")
        self.connection_id = connection_id
        self._on_close = on_close
        self.buffer = buffer
        self.write_timeout = write_timeout
        self.keepalive = keepalive
        self.stalled = False
        """True once an SSE reader stopped reading for longer than `write_timeout`."""
        self.created = time.monotonic()
        self._last_activity = self.created
        self._inbox: list[bytes] = []  # at most INBOX: a list is smaller than a deque
        self._inbox_waiter: asyncio.Future[None] | None = None
        self._room: list[asyncio.Future[None]] = []  # POSTs waiting for room in the inbox
        self._outlets: dict[str | None, _Outlet] = {}
        self._session_requests: dict[str, str] = {}
        self._calls: dict[str, asyncio.Future[bytes | None]] = {}
        self._readers: set[_Outlet] = set()
        """The outlets with a reader attached."""
        self.closed = Flag()
        self.overflowed = False
        self.opened = Flag()
        """Set once an SSE stream was opened (the connection is in use, not a lone POST)."""

    def idle_for(self) -> float:
        """Seconds since the last message went either way (POSTed in, or sent by the engine)."""
        return time.monotonic() - self._last_activity

    @property
    def scopes(self) -> int:
        """How many scopes have a stream entry (a reader, or messages waiting for one)."""
        return len(self._outlets)

    def reading(self, session_id: str | None) -> bool:
        """Whether the stream of `session_id` has a reader (creates no entry for it)."""
        outlet = self._outlets.get(session_id)
        return outlet is not None and outlet.reading

    def waiting(self, session_id: str | None) -> list[bytes]:
        """The messages of `session_id`'s stream not written yet (a copy)."""
        outlet = self._outlets.get(session_id)
        return list(outlet.frames) if outlet is not None else []

    def outlet(self, session_id: str | None) -> _Outlet:
        outlet = self._outlets.get(session_id)
        if outlet is None:
            outlet = self._outlets[session_id] = _Outlet()
        return outlet

    INBOX = 16
    """POSTed messages the engine has not taken yet; a POST beyond them waits for room."""

    async def post(self, frame: bytes, message: Mapping[str, Any], session_id: str | None) -> None:
        """Hand one POSTed message to the engine; `session_id`: the scope its response goes to.

        Raises `anyio.ClosedResourceError` when the connection has ended."""
        if self.closed.is_set():
            raise anyio.ClosedResourceError
        self._last_activity = time.monotonic()
        if session_id is not None and "method" in message and "id" in message:
            self._session_requests[_id_key(message["id"])] = session_id
            if len(self._session_requests) > MAX_SESSION_REQUESTS:
                del self._session_requests[next(iter(self._session_requests))]
        while len(self._inbox) >= self.INBOX:
            room = asyncio.get_running_loop().create_future()
            self._room.append(room)
            try:
                await room
            finally:
                with contextlib.suppress(ValueError):
                    self._room.remove(room)
            if self.closed.is_set():
                raise anyio.ClosedResourceError
        self._inbox.append(frame)
        _wake(self._inbox_waiter)

    async def call(self, frame: bytes, message: Mapping[str, Any]) -> bytes:
        """Post a request and return its response frame (the initialize POST's body).

        Raises `anyio.ClosedResourceError` when the connection ends before the answer."""
        key = _id_key(message.get("id"))
        answer: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        self._calls[key] = answer
        try:
            await self.post(frame, message, None)
            got = await answer
        finally:
            self._calls.pop(key, None)
        if got is None:
            raise anyio.ClosedResourceError
        return got

    # FrameStream, for the engine

    async def receive(self) -> FrameEvent:
        inbox = self._inbox
        while not inbox:
            if self.closed.is_set():
                raise anyio.EndOfStream
            waiter = self._inbox_waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._inbox_waiter = None
        frame = inbox.pop(0)
        if self._room:
            _wake(self._room[0])
        return frame

    def _scope(self, frame: bytes) -> tuple[bool, str | None]:
        """(False, scope) for a message going to that scope's stream; (True, None) for the
        answer to a `call`, handed over here."""
        message = _parse(frame)
        if not isinstance(message, dict):
            return False, None
        if "method" not in message and "id" in message:
            key = _id_key(message["id"])
            answer = self._calls.get(key)
            if answer is not None:
                if not answer.done():
                    answer.set_result(frame)
                return True, None
            return False, self._session_requests.pop(key, None)
        return False, message_session_id(message)

    def send_frames_nowait(self, frames: Sequence[bytes]) -> None:
        """Route `frames` to their streams, in order; each stream writes what it got in one
        chunk, now (a direct reader) or once its reader task runs. Never waits.

        Raises:
            anyio.ClosedResourceError: the connection has ended.
            anyio.BrokenResourceError: a stream without a reader has `buffer` messages waiting
                already: the connection is closed (`overflowed`).
        """
        if self.closed.is_set():
            raise anyio.ClosedResourceError
        self._last_activity = time.monotonic()
        touched: _Outlet | None = None
        more: list[_Outlet] | None = None
        for frame in frames:
            handed, scope = self._scope(frame)
            if handed:
                continue
            outlet = self._outlets.get(scope)
            if outlet is None:
                outlet = self.outlet(scope)
            if len(outlet.frames) >= self.buffer:
                logger.warning(
                    "HTTP connection %s: more than %d messages waiting for a reader; closing it",
                    self.connection_id,
                    self.buffer,
                )
                self.overflowed = True
                self.close()
                raise anyio.BrokenResourceError
            outlet.frames.append(frame)
            if touched is None:
                touched = outlet
            elif outlet is not touched:
                if more is None:
                    more = []
                if outlet not in more:
                    more.append(outlet)
        if touched is not None:
            self._flush(touched)
            for outlet in more or ():
                self._flush(outlet)

    def _flush(self, outlet: _Outlet) -> None:
        """Write what waits in `outlet` now if its reader writes directly and can, else wake
        its reader task."""
        direct = outlet.direct
        if direct is None or outlet.waiter is None or not direct.writable:
            _wake(outlet.waiter)
            return
        frames = outlet.frames
        data = _sse(frames)
        frames.clear()
        try:
            direct.write(data)
        except anyio.BrokenResourceError:
            _wake(outlet.waiter)  # the reader ends: its socket is gone
            return
        outlet.written = self._last_activity

    def send_nowait(self, frame: bytes) -> None:
        """`send_frames_nowait` for one frame."""
        self.send_frames_nowait((frame,))

    async def send_rest(self, rest: memoryview) -> None:
        """Never needed: `send_nowait` takes every frame whole (or raises)."""
        raise AssertionError("ServerHttpFrames takes every frame whole")  # pragma: no cover

    async def send(self, frame: bytes) -> None:
        self.send_frames_nowait((frame,))

    def close(self) -> None:
        """End the connection: the engine sees the end of its input, SSE readers end."""
        if self.closed.is_set():
            return
        self.closed.set()
        if self._on_close is not None:
            self._on_close()  # before any stream ends: the id is unknown from then on
        _wake(self._inbox_waiter)
        for room in self._room:
            _wake(room)
        for answer in self._calls.values():
            if not answer.done():
                answer.set_result(None)
        for outlet in self._outlets.values():
            outlet.frames.clear()
            _wake(outlet.waiter)
        for outlet in list(self._readers):
            outlet.end()

    async def aclose(self) -> None:
        """`close`, for the `FrameStream` interface."""
        self.close()

    def drop_readers(self) -> int:
        """End every attached SSE stream without ending the connection (a test's injected
        fault: what a proxy timing out a long-lived GET does); returns how many."""
        readers = list(self._readers)
        for outlet in readers:
            outlet.end()
        return len(readers)

    async def stream(
        self, session_id: str | None, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Serve one SSE reader of a scope (the GET of `scope`) until the connection ends or
        the peer leaves. The caller has checked `reading(session_id)` (409). The request's
        headers are cleared once the response has started: nobody reads them after.

        Through the server's `SseWriter` (`SSE_EXTENSION` in `scope`) when it offers one:
        messages are then written as the engine sends them, and the end of the socket is
        reported by the server; else through ASGI events, by this task, with a second one
        watching for the peer's disconnect. One frame (this one) waits for the life of a
        direct stream, with no cancel scope and no timer of its own: there are as many as
        idle clients.

        Raises:
            anyio.BrokenResourceError: the socket was found gone while writing to it.
        """
        direct = _sse_writer(scope)
        outlet = self.outlet(session_id)
        outlet.reading = True
        outlet.ended = self.closed.is_set()
        self.opened.set()
        self._readers.add(outlet)
        watch = anyio.create_task_group() if direct is None else None
        try:
            async with watch or _UNWATCHED:
                if watch is not None:
                    outlet.scope = watch.cancel_scope
                    watch.start_soon(_watch_disconnect, receive, outlet)
                elif direct is not None and not await self._writable(outlet, direct):
                    return  # the start could not be written either
                await send(_SSE_START)
                headers = scope.get("headers")
                if isinstance(headers, list):
                    headers.clear()
                loop = asyncio.get_running_loop()
                keepalive = self.keepalive
                frames = outlet.frames
                if direct is not None:
                    direct.on_lost(outlet.end)
                    outlet.direct = direct
                outlet.written = time.monotonic()
                while not outlet.ended:
                    if frames:
                        data = _sse(frames)
                        frames.clear()
                    elif keepalive is not None and (time.monotonic() - outlet.written >= keepalive):
                        data = b":\n\n"
                    else:
                        if keepalive is not None and not outlet.due:
                            _alarms(loop).set(outlet, outlet.written + keepalive)
                        waiter = outlet.waiter = loop.create_future()
                        try:
                            await waiter
                        finally:
                            outlet.waiter = None
                        continue
                    if not await self._write(outlet, send, direct, data):
                        break
                    outlet.written = time.monotonic()
                if watch is not None:
                    watch.cancel_scope.cancel()
            if not self.stalled:  # else the end could not be written either
                with contextlib.suppress(OSError, RuntimeError):
                    await send(_SSE_END)
        finally:
            if direct is not None:
                direct.on_lost(None)
            outlet.direct = None
            outlet.scope = None
            outlet.due = 0.0  # its alarm, if set, is dropped when it rings
            self._readers.discard(outlet)
            outlet.reading = False
            # an entry ends with its reader unless messages wait in it: session ids are the
            # client's to choose, so entries for any number of them must not accumulate, and
            # an idle connection holds no entry for a stream it closed
            if self._outlets.get(session_id) is outlet and not outlet.frames:
                del self._outlets[session_id]

    async def _writable(self, outlet: _Outlet, direct: SseWriter) -> bool:
        """Return at once when `direct` is writable, else wait until it is (or its socket is
        gone). False when the reader ended meanwhile, or `write_timeout` passed first: the
        connection is then closed (`stalled`)."""
        if direct.writable:
            return True
        with anyio.move_on_after(self.write_timeout) as waiting:
            outlet.scope = waiting
            try:
                await direct.wait_writable()
            finally:
                outlet.scope = None
        if outlet.ended:
            return False
        if waiting.cancelled_caught:
            self._stall()
            return False
        return True

    async def _write(
        self, outlet: _Outlet, send: Send, direct: SseWriter | None, data: bytes
    ) -> bool:
        """Write SSE events; False, having written nothing, when the reader ended meanwhile or
        a reader that takes nothing for `write_timeout` seconds ended the connection (the ASGI
        server's send waits while the socket's buffer is full).

        Raises:
            anyio.BrokenResourceError: the direct writer's socket is gone.
        """
        if direct is not None:
            if not await self._writable(outlet, direct):
                return False
            direct.write(data)
            return True
        try:
            with anyio.fail_after(self.write_timeout):
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except TimeoutError:
            self._stall()
            return False
        return True

    def _stall(self) -> None:
        logger.warning(
            "HTTP connection %s: an SSE reader stopped reading; closing it", self.connection_id
        )
        self.stalled = True
        self.close()  # ends this reader too


async def _watch_disconnect(receive: Receive, outlet: _Outlet) -> None:
    """End `outlet`'s reader once ASGI's `receive` says the peer has left."""
    while (await receive())["type"] != "http.disconnect":
        pass
    outlet.end()


_SSE_START: dict[str, Any] = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store")],
}
_SSE_END: dict[str, Any] = {"type": "http.response.body", "body": b"", "more_body": False}


class SseResponse(Response):
    """The `text/event-stream` answer to a GET: one scope of a `ServerHttpFrames`."""

    def __init__(self, frames: ServerHttpFrames, session_id: str | None) -> None:
        super().__init__(media_type="text/event-stream")
        self.frames = frames
        self.session_id = session_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.frames.stream(self.session_id, scope, receive, send)


class HttpRejected(ConnectionError):
    """The server answered a POST or GET with an error status (`status`)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ClientHttpFrames:
    """The client side of one Streamable HTTP connection (see `connect_http`).

    It carries no batches (D43): the server refuses them, so the engine raises before sending.
    """

    carries_batches = False

    def __init__(
        self, client: httpx.AsyncClient, url: str, tg: anyio.abc.TaskGroup, buffer: int
    ) -> None:
        self.client = client
        self.url = url
        self._tg = tg
        self.connection_id: str | None = None
        """The server's `Acp-Connection-Id`, once initialize was answered."""
        self.sessions: set[str] = set()
        """The sessions whose GET stream was opened."""
        self.streams: dict[str | None, httpx.Response] = {}
        """The open SSE responses by scope (tests close them to lose what is in flight)."""
        self._response_scopes: dict[str, str] = {}
        # the session stream each agent-to-client request arrived on: its response is POSTed
        # with that Acp-Session-Id (R68; the TypeScript SDK's server answers 400 without)
        self._inbox_send, self._inbox_recv = anyio.create_memory_object_stream[bytes](buffer)
        self.ended = False
        """True once a stream or a POST failed (or `aclose`): `receive()` ends."""

    def _end(self) -> None:
        self.ended = True
        self._inbox_send.close()

    async def receive(self) -> FrameEvent:
        try:
            return await self._inbox_recv.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise anyio.EndOfStream from None

    async def send(self, frame: bytes) -> None:
        if self.ended:
            raise anyio.ClosedResourceError
        try:
            message = json.loads(frame)
        except (ValueError, RecursionError):
            message = None
        session_id = message_session_id(message) if isinstance(message, dict) else None
        if isinstance(message, dict) and "method" not in message and "id" in message:
            session_id = self._response_scopes.pop(_id_key(message["id"]), None)
        headers = {"Content-Type": "application/json"}
        if self.connection_id is None:  # the first message is initialize
            response = await self._post(frame, headers)
            if response.status_code != 200:
                raise anyio.BrokenResourceError(
                    f"initialize: {describe_refusal(response.status_code)}"
                )
            connection_id = response.headers.get(CONNECTION_ID_HEADER)
            if not connection_id:
                raise anyio.BrokenResourceError("initialize: no Acp-Connection-Id")
            self.connection_id = connection_id
            await self._inbox_send.send(response.content)
            await self._open(None)
            return
        if session_id is not None and session_id not in self.sessions:
            self.sessions.add(session_id)
            await self._open(session_id)  # before the POST: its answer needs somewhere to go
        headers[CONNECTION_ID_HEADER] = self.connection_id
        if session_id is not None:
            headers[SESSION_ID_HEADER] = session_id
        response = await self._post(frame, headers)
        if response.status_code != 202:
            raise anyio.BrokenResourceError(f"POST: {describe_refusal(response.status_code)}")

    async def _post(self, frame: bytes, headers: dict[str, str]) -> httpx.Response:
        try:
            return await self.client.post(self.url, content=frame, headers=headers)
        except httpx.HTTPError as exc:
            self._end()  # outcome unknown: this connection is done
            # the class and httpx's text (no body, no header): why, for the caller's message
            raise anyio.BrokenResourceError(f"{type(exc).__name__}: {exc}") from exc

    async def _open(self, session_id: str | None) -> None:
        refused: list[HttpRejected] = []
        await self._tg.start(self._read, session_id, refused)
        if refused:
            # raised here, to the sender, not out of the reader's task: a failure in the task
            # group would join whatever the caller's block raises (the engine's lost
            # connection) in an exception group that no `except ConnectionError` catches
            raise refused[0]

    async def _read(
        self,
        session_id: str | None,
        refused: list[HttpRejected],
        *,
        task_status: anyio.abc.TaskStatus[None],
    ) -> None:
        assert self.connection_id is not None
        headers = {"Accept": "text/event-stream", CONNECTION_ID_HEADER: self.connection_id}
        if session_id is not None:
            headers[SESSION_ID_HEADER] = session_id
        started = False
        try:
            async with self.client.stream("GET", self.url, headers=headers) as response:
                if response.status_code != 200:
                    refused.append(
                        HttpRejected(
                            f"GET: {describe_refusal(response.status_code)}",
                            response.status_code,
                        )
                    )
                    return
                self.streams[session_id] = response
                task_status.started()
                started = True
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        frame = line[5:].strip().encode("utf-8")
                        if session_id is not None:
                            self._note_request_scope(frame, session_id)
                        await self._inbox_send.send(frame)
        except (httpx.HTTPError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            logger.info("SSE stream %s ended: %s", session_id, type(exc).__name__)
        finally:
            self.streams.pop(session_id, None)
            # a lost stream may have lost responses: the connection is done
            self._end()
            if not started:
                task_status.started()

    def _note_request_scope(self, frame: bytes, session_id: str) -> None:
        if b'"id"' not in frame or b'"method"' not in frame:
            return  # neither a request nor worth parsing
        try:
            message = json.loads(frame)
        except (ValueError, RecursionError):
            return
        if isinstance(message, dict) and "method" in message and "id" in message:
            self._response_scopes[_id_key(message["id"])] = session_id

    async def aclose(self) -> None:
        self._end()


@contextlib.asynccontextmanager
async def connect_http(
    url: str,
    *,
    token: str | None = None,
    timeout: float = 10.0,
    buffer: int = DEFAULT_STREAM_BUFFER,
) -> AsyncIterator[ClientHttpFrames]:
    """A Streamable HTTP connection to `url` (`http://host:port/acp`); nothing is sent until
    the first frame (initialize). Leaving the block DELETEs the connection (best effort)."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else None
    try:
        async with (
            httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, read=None)) as client,
            anyio.create_task_group() as tg,
        ):
            frames = ClientHttpFrames(client, url, tg, buffer)
            try:
                yield frames
            finally:
                frames._end()
                frames._inbox_recv.close()
                tg.cancel_scope.cancel()  # the SSE readers
                with anyio.CancelScope(shield=True):
                    if frames.connection_id is not None:
                        with anyio.move_on_after(timeout), contextlib.suppress(httpx.HTTPError):
                            await client.delete(
                                url, headers={CONNECTION_ID_HEADER: frames.connection_id}
                            )
    except BaseExceptionGroup as group:
        # the task group wraps what the caller's block raised: give it back as itself, so
        # `except ConnectionClosed:` around this block works as it does over WebSocket
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
