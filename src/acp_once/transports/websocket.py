"""WebSocket: one text frame = one JSON-RPC message, or one batch array (R69, D21): frames are
moved as they are, whatever they hold.

- `ServerWebSocketFrames`: the agent side, a `FrameStream` over an accepted starlette
  `WebSocket` (any ASGI server). Binary frames are ignored. `server_websocket_frames` picks
  `DirectWebSocketFrames` instead when the ASGI server offers a direct channel
  (`DIRECT_EXTENSION`, see `DirectWebSocket`; `acp-once serve`'s uvicorn protocol does): the
  same stream, written without waiting, several messages in one system call. A text frame
  above `max_frame` bytes is reported as `OversizedFrame` (the engine answers a request with
  -32600) and the connection lives on; the ASGI server's own limit (uvicorn's `ws_max_size`)
  closes the socket with 1009 for anything larger still, before it is held in memory.
- `connect_websocket(url)`: the client side, with the `websockets` asyncio client (so it runs
  on anyio's asyncio backend). Frames above `max_frame` close the connection with 1009.

Closing a socket leaves every pending request on it with an unknown outcome; sessions outlive
it and are resumed on a new connection. Close codes used here: 1000 normal, 1001 going away
(server shutting down), 1008 policy (authentication, limits), 1011 internal error.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import anyio
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    WebSocketException,
)

from acp_once.protocol.framing import DEFAULT_MAX_FRAME, FrameEvent, OversizedFrame
from acp_once.support.refusals import describe_refusal

__all__ = [
    "CONNECTION_ID_HEADER",
    "DIRECT_EXTENSION",
    "ClientWebSocketFrames",
    "DirectWebSocket",
    "DirectWebSocketFrames",
    "ServerWebSocketFrames",
    "WebSocketRejected",
    "connect_websocket",
    "redact_authorization",
    "server_websocket_frames",
]

CONNECTION_ID_HEADER = "Acp-Connection-Id"
"""Sent on the 101 response: the transport-level id of the new connection (not a credential)."""

_HEAD_BYTES = 1024  # what an OversizedFrame keeps, as the line framer does

DIRECT_EXTENSION = "acp_once.websocket.direct"
"""The ASGI scope extension under which a server offers a `DirectWebSocket`:
`scope["extensions"][DIRECT_EXTENSION] == {"channel": <DirectWebSocket>}`."""

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL = 1011


class _RedactAuthorization(logging.Filter):
    """`websockets` logs every handshake header at DEBUG level: never the bearer token."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if (
            isinstance(args, tuple)
            and len(args) == 2
            and str(args[0]).lower() in ("authorization", "proxy-authorization")
        ):
            record.args = (args[0], "[redacted]")
        return True


_REDACT = _RedactAuthorization()


def redact_authorization(logger: logging.Logger) -> logging.Logger:
    """Make `logger` (one `websockets` handshakes log to) hide Authorization headers; idempotent.

    Servers: apply it to the ASGI server's logger (uvicorn's is "uvicorn.error")."""
    if _REDACT not in logger.filters:
        logger.addFilter(_REDACT)
    return logger


_client_logger = redact_authorization(logging.getLogger("acp_once.transports.websocket"))


class WebSocketRejected(ConnectionError):
    """The server refused the upgrade (for example 401: missing or wrong token; 503: full).

    A `ConnectionError`, so a reconnecting client treats it like a refused connection.

    Attributes:
        status: the HTTP status of the refusal (0 when the handshake failed otherwise).
    """

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ServerWebSocketFrames:
    """A `FrameStream` over an accepted starlette `WebSocket` (the agent side).

    Call `accept()` once (or accept the socket yourself) before the engine reads from it.

    `write_timeout`: seconds a frame may wait for a client that stopped reading (the socket's
    send buffer full) before `send` gives up with `anyio.BrokenResourceError` and the stream
    ends (`stalled`); no close frame is sent then, since it could not be delivered either.
    """

    def __init__(
        self,
        websocket: WebSocket,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        write_timeout: float | None = None,
    ) -> None:
        if max_frame < 1:
            raise ValueError("max_frame must be positive")
        self.websocket = websocket
        self.max_frame = max_frame
        self.write_timeout = write_timeout
        self.close_code: int | None = None
        """The close code once the socket is closed (ours, or the peer's on disconnect)."""
        self.stalled = False
        """True once a write waited longer than `write_timeout`."""
        self._ended = False
        self._last_activity = time.monotonic()

    def idle_for(self) -> float:
        """Seconds since the last frame went either way."""
        return time.monotonic() - self._last_activity

    async def accept(self, connection_id: str) -> None:
        """Complete the upgrade, with `Acp-Connection-Id` on the 101 response. The request's
        headers are dropped then (read them before): a server holds many idle connections,
        and nothing needs them once the connection is authenticated."""
        header = (CONNECTION_ID_HEADER.lower().encode("latin-1"), connection_id.encode("latin-1"))
        await self.websocket.accept(headers=[header])
        websocket = self.websocket
        websocket.scope["headers"] = []
        if "_headers" in vars(websocket):  # starlette's cache of them
            del websocket._headers

    async def receive(self) -> FrameEvent:
        while True:
            if self._ended:
                raise anyio.EndOfStream
            try:
                message = await self.websocket.receive()
            except (RuntimeError, OSError, WebSocketDisconnect):
                self._ended = True
                raise anyio.EndOfStream from None
            kind = message["type"]
            if kind == "websocket.disconnect":
                self._ended = True
                if self.close_code is None:
                    self.close_code = int(message.get("code", CLOSE_NORMAL))
                raise anyio.EndOfStream
            if kind != "websocket.receive":
                continue
            self._last_activity = time.monotonic()
            text = message.get("text")
            if not isinstance(text, str):
                continue  # binary frames carry no ACP messages
            frame = text.encode("utf-8", errors="surrogatepass")
            if len(frame) > self.max_frame:
                return OversizedFrame(size=len(frame), head=frame[:_HEAD_BYTES])
            return frame

    async def send(self, frame: bytes) -> None:
        if self._ended or self.websocket.application_state != WebSocketState.CONNECTED:
            raise anyio.ClosedResourceError
        try:
            # the ASGI server's send waits while the socket's buffer is full: bound it
            with anyio.fail_after(self.write_timeout):
                await self.websocket.send_text(frame.decode("utf-8"))
        except TimeoutError:
            self.stalled = self._ended = True
            raise anyio.BrokenResourceError("the client stopped reading") from None
        except (RuntimeError, OSError, WebSocketDisconnect) as exc:
            raise anyio.BrokenResourceError from exc
        self._last_activity = time.monotonic()

    async def close(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        """Close the socket with `code`; the reading side then sees the end of the stream.
        Idempotent."""
        if self.stalled or self.websocket.application_state != WebSocketState.CONNECTED:
            return
        if self.close_code is None:
            self.close_code = code
        with (
            contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect),
            anyio.move_on_after(self.write_timeout),  # a full send buffer would hold it
        ):
            await self.websocket.close(code, reason)

    async def aclose(self) -> None:
        await self.close(CLOSE_NORMAL)


class DirectWebSocket(Protocol):
    """The messages of one accepted WebSocket without an ASGI event each (what a server puts
    under `DIRECT_EXTENSION`; `acp_once.server.websocket_protocol.DirectChannel` is one)."""

    close_code: int | None

    def start(self) -> None:
        """Take the messages over from ASGI (after the upgrade was accepted)."""
        ...

    async def receive(self) -> bytes:
        """The next text message's UTF-8 bytes. Raises `anyio.EndOfStream` at the end."""
        ...

    @property
    def writable(self) -> bool:
        """Whether `write` may be called now (the socket's buffer has room)."""
        ...

    def encode(self, frames: Sequence[bytes]) -> bytes:
        """`frames` as text messages. Raises `anyio.ClosedResourceError` once closing."""
        ...

    def write(self, data: bytes | memoryview) -> None:
        """Write encoded messages. Raises `anyio.BrokenResourceError` when gone."""
        ...

    async def wait_writable(self) -> None:
        """Wait until `writable`, or the connection ended."""
        ...

    def abort(self) -> None:
        """Drop the connection at once."""
        ...


def server_websocket_frames(
    websocket: WebSocket, *, max_frame: int = DEFAULT_MAX_FRAME, write_timeout: float | None = None
) -> ServerWebSocketFrames:
    """The frame stream for an ASGI `websocket` (not accepted yet): `DirectWebSocketFrames`
    when its server offers a direct channel, else `ServerWebSocketFrames`."""
    offered: Any = websocket.scope.get("extensions", {}).get(DIRECT_EXTENSION)
    if isinstance(offered, dict) and offered.get("channel") is not None:
        return DirectWebSocketFrames(
            websocket, offered["channel"], max_frame=max_frame, write_timeout=write_timeout
        )
    return ServerWebSocketFrames(websocket, max_frame=max_frame, write_timeout=write_timeout)


class DirectWebSocketFrames(ServerWebSocketFrames):
    """`ServerWebSocketFrames` over a server's `DirectWebSocket`: the upgrade and the close
    go through ASGI, messages through the channel. A `NowaitFrameStream`: the engine writes
    the frames of one event loop turn with one system call (`send_frames_nowait`).

    A peer that stops reading fills the socket's buffer; a frame then waits for room at most
    `write_timeout` seconds, after which the TCP connection is dropped at once (`stalled`)
    and its buffers freed.
    """

    def __init__(
        self,
        websocket: WebSocket,
        channel: DirectWebSocket,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        write_timeout: float | None = None,
    ) -> None:
        super().__init__(websocket, max_frame=max_frame, write_timeout=write_timeout)
        self.channel = channel

    burst = True
    """Always (see `NowaitFrameStream.burst`): the frames made in one event loop turn go in one
    write, even to a peer that sent one request and waits. A server has many peers, and the
    system calls are what it runs out of first: with 20 clients doing keyed prompts, 2 writes
    per prompt instead of 5 (a prompt's answer still leaves at the end of its own turn)."""

    async def accept(self, connection_id: str) -> None:
        await super().accept(connection_id)
        self.channel.start()

    async def receive(self) -> FrameEvent:
        try:
            frame = await self.channel.receive()
        except anyio.EndOfStream:
            self._ended = True
            if self.close_code is None:
                self.close_code = self.channel.close_code or CLOSE_NORMAL
            raise
        self._last_activity = time.monotonic()
        if len(frame) > self.max_frame:
            return OversizedFrame(size=len(frame), head=frame[:_HEAD_BYTES])
        return frame

    def send_nowait(self, frame: bytes) -> memoryview | None:
        """Write one frame now if the socket's buffer has room; else return it encoded, to be
        finished by `send_rest`.

        Raises:
            anyio.BrokenResourceError, anyio.ClosedResourceError: the connection is gone or
                closing.
        """
        return self.send_frames_nowait((frame,))

    def send_frames_nowait(self, frames: Sequence[bytes]) -> memoryview | None:
        """`send_nowait` for several frames, one message each, in one write."""
        if self._ended:
            raise anyio.ClosedResourceError
        channel = self.channel
        data = channel.encode(frames)
        if not channel.writable:
            return memoryview(data)
        channel.write(data)
        self._last_activity = time.monotonic()
        return None

    async def send_rest(self, rest: memoryview) -> None:
        """Write what `send_nowait` returned once the socket's buffer has room, waiting at most
        `write_timeout` seconds (then the connection is dropped: `stalled`)."""
        channel = self.channel
        with anyio.move_on_after(self.write_timeout):
            await channel.wait_writable()
            channel.write(rest)
            self._last_activity = time.monotonic()
            return
        self.stalled = self._ended = True
        channel.abort()
        raise anyio.BrokenResourceError("the client stopped reading")

    async def send(self, frame: bytes) -> None:
        rest = self.send_nowait(frame)
        if rest is not None:
            await self.send_rest(rest)


class ClientWebSocketFrames:
    """A `FrameStream` over a `websockets` client connection (the client side)."""

    def __init__(self, connection: ClientConnection) -> None:
        self.connection = connection
        response = connection.response
        self.connection_id: str | None = (
            response.headers.get(CONNECTION_ID_HEADER) if response is not None else None
        )
        """The server's `Acp-Connection-Id` for this connection, if it sent one."""

    async def receive(self) -> FrameEvent:
        while True:
            try:
                message = await self.connection.recv()
            except ConnectionClosed:
                raise anyio.EndOfStream from None
            if isinstance(message, str):
                return message.encode("utf-8", errors="surrogatepass")
            # binary frames carry no ACP messages

    async def send(self, frame: bytes) -> None:
        try:
            await self.connection.send(frame, text=True)
        except ConnectionClosed as exc:
            raise anyio.BrokenResourceError from exc

    @property
    def close_code(self) -> int | None:
        """The close code once closed (None before)."""
        return self.connection.close_code

    async def abort(self) -> None:
        """Drop the TCP connection without a closing handshake (what a network failure does)."""
        transport = self.connection.transport
        transport.abort()

    async def aclose(self) -> None:
        with contextlib.suppress(OSError, WebSocketException):
            await self.connection.close()


@contextlib.asynccontextmanager
async def connect_websocket(
    url: str,
    *,
    token: str | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
    open_timeout: float = 10.0,
    close_timeout: float = 5.0,
    ping_interval: float | None = 20.0,
    ping_timeout: float | None = 20.0,
) -> AsyncIterator[ClientWebSocketFrames]:
    """Open a WebSocket to an ACP server (`ws://host:port/acp`) and yield its frame stream.

    `token` is sent as `Authorization: Bearer <token>`. Keepalive pings detect a silent peer.
    Needs anyio's asyncio backend.

    Raises:
        WebSocketRejected: the server refused the upgrade (`status` tells why).
        OSError: the server could not be reached.
        TimeoutError: no handshake within `open_timeout`.
    """
    headers = {"Authorization": f"Bearer {token}"} if token is not None else None
    try:
        connection = await connect(
            url,
            additional_headers=headers,
            max_size=max_frame,
            open_timeout=open_timeout,
            close_timeout=close_timeout,
            ping_interval=ping_interval,
            ping_timeout=ping_timeout,
            compression=None,
            logger=_client_logger,
        )
    except InvalidStatus as exc:
        status = exc.response.status_code
        raise WebSocketRejected(
            f"The server refused the WebSocket: {describe_refusal(status)}", status
        ) from None
    except InvalidHandshake as exc:
        raise WebSocketRejected(f"The WebSocket handshake failed: {type(exc).__name__}") from exc
    frames = ClientWebSocketFrames(connection)
    try:
        yield frames
    finally:
        with anyio.CancelScope(shield=True):
            await frames.aclose()
