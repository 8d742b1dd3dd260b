"""uvicorn's WebSocket protocol with a direct channel for ACP connections beside ASGI.

`DirectWebSocketProtocol` is uvicorn's `websockets-sansio` protocol (passed as
`uvicorn.Config(ws=...)` by `uvicorn_config`). The handshake, the denial response, the close
handshake and keepalive pings stay uvicorn's, through ASGI. It also puts a `DirectChannel` in
the scope's extensions (`acp_once.transports.websocket.DIRECT_EXTENSION`); an app that takes it
(`ServerWebSocketFrames` does, after the upgrade is accepted) reads and writes messages through
it instead of one ASGI event per message:

- several messages ready in the same event loop turn are written as one `transport.write`
  (one system call), instead of one ASGI `send`, one wait and one write each;
- a text message is handed over as the bytes that arrived (checked to be UTF-8 as uvicorn
  does, 1007 otherwise), not decoded to a `str` and encoded again;
- whole text frames, the only frames an ACP connection needs, are read and written here
  (header, unmasking) rather than through websockets' `Frame` objects and parser generator;
  a ping or a pong is handed to websockets alone; anything else (a close, a binary or
  fragmented message, an extension such as permessage-deflate, websockets' debug log) is
  websockets' from that frame on, exactly as without this path;
- reading is paused once `_PAUSE_AT` bytes of messages wait unread (and resumed when they are
  read), not after every message: a pause and a resume are two system calls.

An idle connection holds little: once the channel is started, the handshake's headers (the
request's and the 101 response's) are dropped, messages wait in a list (a deque is ~0.8 KiB
even when empty), and "the socket has room" is a `_Writable` flag, not an `asyncio.Event` with a
deque of its own.

What one connection holds stays bounded: at most `_PAUSE_AT` bytes of unread messages plus one
read, and what the transport's write buffer holds up to its high-water mark (beyond it nothing
is written until it drains: `DirectChannel.writable`). An app that never takes the channel
(any ASGI app, or ours mounted under another server) sees plain uvicorn behaviour.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Sequence
from typing import Any

import anyio
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.protocol import State

try:  # websockets' C unmasking, where it was built (its pure-Python one otherwise)
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover
    from websockets.utils import apply_mask

from acp_once.transports.websocket import CLOSE_NORMAL, DIRECT_EXTENSION

__all__ = ["DirectChannel", "DirectWebSocketProtocol"]

_PAUSE_AT = 64 * 1024
"""Bytes of received messages waiting for the app before reading from the socket pauses."""
_CLOSE_ABNORMAL = 1006
_FIN_TEXT = 0x81  # FIN and the text opcode: one whole text message
_FIN_PING = 0x89
_FIN_PONG = 0x8A
_HEAD_16 = struct.Struct("!BBH")
_HEAD_64 = struct.Struct("!BBQ")


class _Writable:
    """What uvicorn's protocol uses as its `writable` event (`set`, `clear`, `is_set`,
    `wait`): a flag, with a list of waiters made only while someone waits."""

    __slots__ = ("_loop", "_value", "_waiters")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._value = True
        self._waiters: list[asyncio.Future[None]] | None = None

    def is_set(self) -> bool:
        return self._value

    def set(self) -> None:
        self._value = True
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def clear(self) -> None:
        self._value = False

    async def wait(self) -> None:
        if self._value:
            return
        waiter = self._loop.create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if self._waiters is not None and waiter in self._waiters:
                self._waiters.remove(waiter)


class _Routed:
    """Takes the place of uvicorn's ASGI receive queue once the channel is started: the events
    uvicorn's code puts there (a disconnect, from several places) reach the channel."""

    __slots__ = ("_channel",)

    def __init__(self, channel: DirectChannel) -> None:
        self._channel = channel

    def put_nowait(self, message: dict[str, Any]) -> None:
        if message.get("type") == "websocket.disconnect":
            self._channel._end(int(message.get("code", _CLOSE_ABNORMAL)))

    def empty(self) -> bool:
        return True

    async def get(self) -> dict[str, Any]:
        # nobody reads ASGI events once the channel is started; an app that does sees the end
        return {"type": "websocket.disconnect", "code": self._channel.close_code or CLOSE_NORMAL}


class DirectChannel:
    """Messages of one WebSocket connection without ASGI events (see the module docstring).

    Implements `acp_once.transports.websocket.DirectWebSocket`.
    """

    def __init__(self, protocol: DirectWebSocketProtocol) -> None:
        self._protocol = protocol
        # received messages, the next one at `_head`; emptied when all are read (an empty
        # list is 56 bytes, a deque ~0.8 KiB)
        self._inbox: list[bytes] = []
        self._head = 0
        self._queued = 0
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self.started = False
        self.ended = False
        self.close_code: int | None = None
        """The close code once the connection has ended (the peer's, or ours)."""

    # -- reading ------------------------------------------------------------------------

    def start(self) -> None:
        """From now on messages arrive here, not as ASGI events. Call it once, after the
        upgrade was accepted; events uvicorn queued before are taken over in order."""
        protocol = self._protocol
        if self.started:
            return
        self.started = True
        queue = protocol.queue
        while not queue.empty():
            message = queue.get_nowait()
            if message["type"] == "websocket.receive":
                text = message.get("text")
                if isinstance(text, str):
                    self._push(text.encode("utf-8", errors="surrogatepass"))
            elif message["type"] == "websocket.disconnect":
                self._end(int(message.get("code", _CLOSE_ABNORMAL)))
        protocol.queue = _Routed(self)  # type: ignore[assignment]
        self._forget_handshake()
        # uvicorn pauses reading after each message it queues, until the app reads them all
        if protocol.read_paused and self._queued < _PAUSE_AT:
            protocol.read_paused = False
            protocol.transport.resume_reading()

    def _forget_handshake(self) -> None:
        """Drop the headers of the upgrade request and of the 101 response (~2.5 KiB a
        connection): nothing reads them once the upgrade is accepted. Emptied in place, as the
        handshake parser of `websockets` keeps the request in its frame for the connection's
        life."""
        protocol = self._protocol
        for name in ("request", "response"):
            message = getattr(protocol, name, None)
            headers = getattr(message, "headers", None)
            if headers is not None:
                headers.clear()

    @property
    def queued(self) -> int:
        """Bytes of messages received and not read yet."""
        return self._queued

    def _push(self, message: bytes) -> None:
        self._inbox.append(message)
        self._queued += len(message)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        protocol = self._protocol
        if self._queued >= _PAUSE_AT and not protocol.read_paused:
            protocol.read_paused = True
            protocol.transport.pause_reading()

    def _end(self, code: int) -> None:
        if self.close_code is None:
            self.close_code = code
        self.ended = True
        for future in (self._waiter, self._drained):
            if future is not None and not future.done():
                future.set_result(None)

    async def receive(self) -> bytes:
        """The next text message, as its UTF-8 bytes.

        Raises:
            anyio.EndOfStream: the connection has ended (`close_code` says how).
        """
        inbox = self._inbox
        while self._head >= len(inbox):
            if self.ended:
                raise anyio.EndOfStream
            self._waiter = self._protocol.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message = inbox[self._head]
        self._head += 1
        if self._head == len(inbox):
            inbox.clear()
            self._head = 0
        elif self._head >= 64 and 2 * self._head >= len(inbox):
            del inbox[: self._head]  # a peer that never lets it empty: the read part goes
            self._head = 0
        else:
            inbox[self._head - 1] = b""  # not held until the list empties
        self._queued -= len(message)
        protocol = self._protocol
        if protocol.read_paused and self._queued < _PAUSE_AT // 2:
            protocol.read_paused = False
            protocol.transport.resume_reading()
        return message

    # -- writing ------------------------------------------------------------------------

    @property
    def writable(self) -> bool:
        """False while the socket's write buffer is above its high-water mark, or once the
        connection is closing: write nothing then (`wait_writable`)."""
        protocol = self._protocol
        return protocol.writable.is_set() and not protocol.transport.is_closing()

    def encode(self, frames: Sequence[bytes]) -> bytes:
        """`frames` as text messages, ready for `write`.

        Raises:
            anyio.ClosedResourceError: a close frame was sent or received already.
        """
        protocol = self._protocol
        if self.ended or protocol.close_sent:
            raise anyio.ClosedResourceError
        conn = protocol.conn
        if conn.extensions or conn.debug or conn.expect_continuation_frame:
            return self._encode_by_websockets(frames)
        if conn.state is not State.OPEN:
            raise anyio.ClosedResourceError
        # A server's text frame is a header of 2, 4 or 10 bytes and the payload, unmasked
        # (RFC 6455 5.2): built here, it costs a few operations a frame where websockets'
        # `send_text` makes a `Frame`, checks it and serializes it through a `BytesIO`. With an
        # extension (permessage-deflate), websockets' debug log or a fragmented message in
        # progress, websockets writes them. Control frames it has queued (a pong) go first.
        parts = conn.data_to_send() if conn.writes else []
        for frame in frames:
            size = len(frame)
            if size < 126:
                parts.append(bytes((_FIN_TEXT, size)))
            elif size < 65536:
                parts.append(_HEAD_16.pack(_FIN_TEXT, 126, size))
            else:
                parts.append(_HEAD_64.pack(_FIN_TEXT, 127, size))
            parts.append(frame)
        return b"".join(parts)

    def _encode_by_websockets(self, frames: Sequence[bytes]) -> bytes:
        conn = self._protocol.conn
        try:
            for frame in frames:
                conn.send_text(frame)
        except Exception as exc:  # websockets' InvalidState: the closing handshake began
            raise anyio.ClosedResourceError from exc
        return b"".join(conn.data_to_send())

    def write(self, data: bytes | memoryview) -> None:
        """Write encoded messages (one system call, or into the transport's buffer).

        Raises:
            anyio.BrokenResourceError: the connection is gone.
        """
        transport = self._protocol.transport
        if self.ended or transport.is_closing():
            raise anyio.BrokenResourceError
        transport.write(data)

    async def wait_writable(self) -> None:
        """Wait until `writable` (or the connection ended)."""
        protocol = self._protocol
        while not self.ended and not protocol.writable.is_set():
            await protocol.writable.wait()

    def abort(self) -> None:
        """Drop the TCP connection at once (a peer that stopped reading: its buffer is freed)."""
        self._end(_CLOSE_ABNORMAL)
        self._protocol.transport.abort()


class DirectWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's `websockets-sansio` protocol with a `DirectChannel` (module docstring)."""

    # uvicorn's attributes (as of the verified versions) in slots, not in a dict of ~40 keys
    # (~1.6 KiB a connection); an attribute of another version still lands in __dict__.
    __slots__ = (
        "_need",
        "_partial",
        "_request_read",
        "app",
        "app_state",
        "asgi_version",
        "channel",
        "client",
        "close_sent",
        "close_timeout",
        "close_timer",
        "config",
        "conn",
        "connections",
        "curr_msg_data_type",
        "default_headers",
        "disconnected",
        "frames",
        "handshake_complete",
        "handshake_initiated",
        "heard",
        "initial_response",
        "last_ping_rtt",
        "logger",
        "loop",
        "pending_ping_payload",
        "ping_interval",
        "ping_sent_at",
        "ping_timeout",
        "ping_timer",
        "pong_timer",
        "queue",
        "read_paused",
        "reads_frames",
        "request",
        "response",
        "root_path",
        "scheme",
        "scope",
        "server",
        "tasks",
        "transport",
        "writable",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writable = _Writable(self.loop)  # type: ignore[assignment]
        self.channel = DirectChannel(self)
        self.heard = False
        """Something arrived since the last keepalive ping was due."""
        self.reads_frames: bool | None = None
        """This protocol reads the connection's frames (`_receive_frames`); False: websockets
        does; None: not decided before the first bytes after the handshake's request."""
        self._request_read = False
        self._partial: bytearray | None = None
        self._need = 0

    def data_received(self, data: bytes) -> None:
        self.heard = True
        if self.reads_frames:
            self._receive_frames(data)
            return
        if self.reads_frames is None and self._request_read:
            # The first bytes after the handshake's request: frames, at a frame's start. Read
            # here when the upgrade is done with no extension; otherwise (or when the client
            # sent them before the 101), websockets reads every frame of this connection.
            self.reads_frames = (
                self.conn.state is State.OPEN
                and not self.conn.extensions
                and not self.conn.debug
                and not self.close_sent
                and not self.conn.reader.buffer
            )
            if self.reads_frames:
                self._receive_frames(data)
                return
        super().data_received(data)
        if self.reads_frames is None and self._request_read and self._past_request(data):
            self.reads_frames = False  # frame bytes came with the request: websockets reads

    def _past_request(self, data: bytes) -> bool:
        """Did `data`, the chunk that completed the handshake's request, hold bytes after it
        (the request ends at its first empty line; a GET upgrade has no body)?"""
        return not data.endswith(b"\r\n\r\n") or data.find(b"\r\n\r\n") != len(data) - 4

    def _receive_frames(self, data: bytes) -> None:
        """Read whole, unfragmented, masked text frames, the messages of an ACP connection,
        without websockets' frame parser (the `Frame`, its checks and the generator steps cost
        more than the rest of a message's reading). A whole ping or pong goes to websockets
        alone. Anything else (a close, a binary or fragmented message, a frame over the size
        limit or not masked) is left to websockets from its first byte on, for the rest of the
        connection: its parser stands at a frame's start, so it answers it as it would have."""
        partial = self._partial
        if partial is not None:
            partial += data
            if len(partial) < self._need:
                return
            data = bytes(partial)
            self._partial = None
        size = len(data)
        at = 0
        conn = self.conn
        limit = conn.max_message_size  # a whole message is one fragment: the smaller bound
        fragment = conn.max_fragment_size
        if fragment is not None and (limit is None or fragment < limit):
            limit = fragment
        while at < size:
            need = at + 2
            if size < need:
                break
            head1 = data[at]
            head2 = data[at + 1]
            if head1 != _FIN_TEXT or head2 < 0x80 or self.close_sent:
                if (
                    head1 in (_FIN_PING, _FIN_PONG)
                    and 0x80 <= head2 <= 0xFD
                    and not self.close_sent
                ):
                    # a whole masked ping or pong (payload <= 125 bytes): websockets reads that one
                    # frame, whole, so its parser ends where it began, at a frame's start; the
                    # keepalive's pong of an idle connection does not end this path for it
                    need += 4 + (head2 & 0x7F)
                    if size < need:
                        break
                    super().data_received(data[at:need])
                    at = need
                    if self.close_sent or self.conn.parser_exc is not None:
                        self.reads_frames = False
                        return
                    continue
                self._hand_to_websockets(data, at)
                return
            length = head2 & 0x7F
            if length == 126:
                need += 2
                if size < need:
                    break
                length = int.from_bytes(data[at + 2 : need], "big")
            elif length == 127:
                need += 8
                if size < need:
                    break
                length = int.from_bytes(data[at + 2 : need], "big")
            if limit is not None and length > limit:
                self._hand_to_websockets(data, at)
                return
            mask = need
            need += 4 + length
            if size < need:
                break
            self.curr_msg_data_type = "text"
            self.frames = [apply_mask(data[mask + 4 : need], data[mask : mask + 4])]
            at = need
            self.send_receive_event_to_app()
        if at < size:  # a frame not whole yet: kept until `need` bytes are here
            self._partial = bytearray(data[at:])
            self._need = need - at

    def _hand_to_websockets(self, data: bytes, at: int) -> None:
        self.reads_frames = False
        super().data_received(data[at:])

    def send_keepalive_ping(self) -> None:
        """uvicorn pings every connection each `ws_ping_interval`; a peer heard from since
        the last one is there, so it is not pinged this time (with 10,000 connections all
        prompting, the pings were a tenth of the server's CPU). A silent peer is pinged as
        before, and dropped if it does not answer within `ws_ping_timeout`."""
        if self.heard and self.pending_ping_payload is None:
            self.heard = False
            self.ping_timer = None
            self.schedule_ping()
            return
        self.heard = False
        super().send_keepalive_ping()

    def handle_connect(self, event: Any) -> None:
        self._request_read = True
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][DIRECT_EXTENSION] = {"channel": self.channel}

    def send_receive_event_to_app(self) -> None:
        channel = self.channel
        if not channel.started:
            super().send_receive_event_to_app()
            return
        frames = self.frames
        data = frames[0] if len(frames) == 1 else b"".join(frames)
        self.frames = []
        if self.close_sent or self.curr_msg_data_type != "text":
            return  # binary messages carry no ACP message; after our close, nothing is read
        message = data if type(data) is bytes else bytes(data)
        try:
            message.decode("utf-8")
        except UnicodeDecodeError:
            logging.getLogger("uvicorn.error").warning(
                "Invalid UTF-8 sequence received from client."
            )
            self.conn.send_close(1007)
            self.handle_parser_exception()
            return
        channel._push(message)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.channel.started:  # uvicorn told the routed queue already; this is for safety
            self.channel._end(_CLOSE_ABNORMAL)
