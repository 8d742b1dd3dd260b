"""Streamable HTTP (R68): one ACP connection over POSTs in and SSE GET streams out.

- `ServerHttpFrames`: the agent side of one connection, a `FrameStream` fed by the HTTP
  handlers (`post`, `call` for the initialize POST whose answer is its response body) and
  drained by SSE readers (`stream`). Outgoing messages are routed by scope: a response goes to
  the session stream when its request was posted with `Acp-Session-Id`, else to the connection
  stream; a notification or request goes to the stream of its `params.sessionId`, if any.
  While no reader of a scope is attached, its messages wait in a bounded buffer; overflowing
  it closes the connection. Nothing is replayed: a message written to a reader that vanished
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

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import anyio.abc
import httpx
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from acp_once.protocol.framing import FrameEvent
from acp_once.support.refusals import describe_refusal
from acp_once.transports.websocket import CONNECTION_ID_HEADER

__all__ = [
    "CONNECTION_ID_HEADER",
    "DEFAULT_SSE_KEEPALIVE",
    "DEFAULT_STREAM_BUFFER",
    "SESSION_ID_HEADER",
    "ClientHttpFrames",
    "HttpRejected",
    "ServerHttpFrames",
    "SseResponse",
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
    return json.dumps(value, sort_keys=True)


class _Outlet:
    """One scope's stream: a bounded buffer and at most one reader."""

    def __init__(self, size: int) -> None:
        self.send: MemoryObjectSendStream[bytes]
        self.recv: MemoryObjectReceiveStream[bytes]
        self.send, self.recv = anyio.create_memory_object_stream[bytes](size)
        self.reading = False


class ServerHttpFrames:
    """The agent side of one Streamable HTTP connection (see the module docstring).

    `write_timeout`: seconds an SSE event may wait for a reader that stopped reading (its
    socket's send buffer full) before the connection ends (`stalled`); the engine never waits
    on a reader, only on the bounded buffer. `keepalive`: seconds of silence on an SSE stream
    before a comment line is written on it (`DEFAULT_SSE_KEEPALIVE`; None: never).
    """

    def __init__(
        self,
        connection_id: str,
        *,
        buffer: int = DEFAULT_STREAM_BUFFER,
        write_timeout: float | None = None,
        keepalive: float | None = DEFAULT_SSE_KEEPALIVE,
    ) -> None:
        if buffer < 1:
            raise ValueError("buffer must be positive")
        if keepalive is not None and keepalive <= 0:
            raise ValueError("keepalive must be positive (or None)")
        self.connection_id = connection_id
        self.buffer = buffer
        self.write_timeout = write_timeout
        self.keepalive = keepalive
        self.stalled = False
        """True once an SSE reader stopped reading for longer than `write_timeout`."""
        self._last_activity = time.monotonic()
        self._in_send, self._in_recv = anyio.create_memory_object_stream[bytes](16)
        self._outlets: dict[str | None, _Outlet] = {}
        self._session_requests: dict[str, str] = {}
        self._calls: dict[str, list[bytes]] = {}
        self._call_events: dict[str, anyio.Event] = {}
        self._readers: set[anyio.CancelScope] = set()
        self.closed = anyio.Event()
        self.overflowed = False
        self.opened = anyio.Event()
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

    def outlet(self, session_id: str | None) -> _Outlet:
        outlet = self._outlets.get(session_id)
        if outlet is None:
            outlet = self._outlets[session_id] = _Outlet(self.buffer)
        return outlet

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
        try:
            await self._in_send.send(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise anyio.ClosedResourceError from None

    async def call(self, frame: bytes, message: Mapping[str, Any]) -> bytes:
        """Post a request and return its response frame (the initialize POST's body)."""
        key = _id_key(message.get("id"))
        event = self._call_events[key] = anyio.Event()
        self._calls[key] = []
        try:
            await self.post(frame, message, None)
            async with anyio.create_task_group() as tg:

                async def closed() -> None:
                    await self.closed.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(closed)
                await event.wait()
                tg.cancel_scope.cancel()
            if not self._calls[key]:
                raise anyio.ClosedResourceError
            return self._calls[key][0]
        finally:
            self._call_events.pop(key, None)
            self._calls.pop(key, None)

    # FrameStream, for the engine

    async def receive(self) -> FrameEvent:
        try:
            return await self._in_recv.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise anyio.EndOfStream from None

    async def send(self, frame: bytes) -> None:
        if self.closed.is_set():
            raise anyio.ClosedResourceError
        self._last_activity = time.monotonic()
        try:
            message = json.loads(frame)
        except (ValueError, RecursionError):
            message = None
        scope: str | None = None
        if isinstance(message, dict):
            if "method" not in message and "id" in message:
                key = _id_key(message["id"])
                if key in self._call_events:
                    self._calls[key].append(frame)
                    self._call_events[key].set()
                    return
                scope = self._session_requests.pop(key, None)
            else:
                scope = message_session_id(message)
        try:
            self.outlet(scope).send.send_nowait(frame)
        except anyio.WouldBlock:
            logger.warning(
                "HTTP connection %s: more than %d messages waiting for a reader; closing it",
                self.connection_id,
                self.buffer,
            )
            self.overflowed = True
            await self.aclose()
            raise anyio.BrokenResourceError from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise anyio.ClosedResourceError from None

    async def aclose(self) -> None:
        """End the connection: the engine sees the end of its input, SSE readers end."""
        if self.closed.is_set():
            return
        self.closed.set()
        self._in_send.close()
        self._in_recv.close()
        for outlet in self._outlets.values():
            outlet.send.close()
            outlet.recv.close()
        for scope in list(self._readers):
            scope.cancel()

    async def _write(self, send: Send, event: bytes) -> None:
        """Write one SSE event; a reader that takes nothing for `write_timeout` seconds ends
        the connection (the ASGI server's send waits while the socket's buffer is full)."""
        try:
            with anyio.fail_after(self.write_timeout):
                await send({"type": "http.response.body", "body": event, "more_body": True})
        except TimeoutError:
            logger.warning(
                "HTTP connection %s: an SSE reader stopped reading; closing it", self.connection_id
            )
            self.stalled = True
            await self.aclose()  # cancels this reader too

    def drop_readers(self) -> int:
        """End every attached SSE stream without ending the connection (a test's injected
        fault: what a proxy timing out a long-lived GET does); returns how many."""
        readers = list(self._readers)
        for scope in readers:
            scope.cancel()
        return len(readers)

    async def stream(self, session_id: str | None, send: Send, receive: Receive) -> None:
        """Serve one SSE reader of a scope until the connection ends or the peer leaves.
        The caller has checked `outlet(session_id).reading` (409)."""
        outlet = self.outlet(session_id)
        outlet.reading = True
        self.opened.set()
        cancel = anyio.CancelScope()
        self._readers.add(cancel)
        try:
            with cancel:
                if self.closed.is_set():
                    cancel.cancel()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"text/event-stream"),
                            (b"cache-control", b"no-store"),
                        ],
                    }
                )
                lock = anyio.Lock()  # events and keep-alive comments, one write at a time
                last_write = anyio.current_time()

                async def write(event: bytes) -> None:
                    nonlocal last_write
                    async with lock:
                        await self._write(send, event)
                        last_write = anyio.current_time()

                async with anyio.create_task_group() as tg:

                    async def watch_disconnect() -> None:
                        while (await receive())["type"] != "http.disconnect":
                            pass
                        tg.cancel_scope.cancel()

                    async def keep_alive(interval: float) -> None:
                        while True:
                            await anyio.sleep(last_write + interval - anyio.current_time())
                            if anyio.current_time() >= last_write + interval:
                                await write(b":\n\n")

                    tg.start_soon(watch_disconnect)
                    if self.keepalive is not None:
                        tg.start_soon(keep_alive, self.keepalive)
                    # aclose() (a DELETE, the server ending) closes the outlet under a waiting
                    # reader: that is the end of this stream, not an error of the app
                    with contextlib.suppress(anyio.ClosedResourceError):
                        async for frame in outlet.recv:
                            await write(b"data: " + frame + b"\n\n")
                    tg.cancel_scope.cancel()
            if not self.stalled:  # else the end could not be written either
                with contextlib.suppress(OSError, RuntimeError):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._readers.discard(cancel)
            outlet.reading = False
            # a session's entry ends with its reader unless messages wait in it: the ids are
            # the client's to choose, so entries for any number of them must not accumulate
            if (
                session_id is not None
                and self._outlets.get(session_id) is outlet
                and outlet.recv.statistics().current_buffer_used == 0
            ):
                del self._outlets[session_id]
                outlet.send.close()
                outlet.recv.close()


class SseResponse(Response):
    """The `text/event-stream` answer to a GET: one scope of a `ServerHttpFrames`."""

    def __init__(self, frames: ServerHttpFrames, session_id: str | None) -> None:
        super().__init__(media_type="text/event-stream")
        self.frames = frames
        self.session_id = session_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.frames.stream(self.session_id, send, receive)


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
        await self._tg.start(self._read, session_id)

    async def _read(
        self, session_id: str | None, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        assert self.connection_id is not None
        headers = {"Accept": "text/event-stream", CONNECTION_ID_HEADER: self.connection_id}
        if session_id is not None:
            headers[SESSION_ID_HEADER] = session_id
        started = False
        try:
            async with self.client.stream("GET", self.url, headers=headers) as response:
                if response.status_code != 200:
                    raise HttpRejected(
                        f"GET: {describe_refusal(response.status_code)}", response.status_code
                    )
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
