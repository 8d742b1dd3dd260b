"""The one contract between the engine and a transport: a stream of frames.

A transport gives the engine a `FrameStream`: `receive()` returns the next frame (the bytes of one
JSON-RPC message) or an `OversizedFrame` report, and raises `anyio.EndOfStream` when the peer is
gone; `send(frame)` returns once the transport has accepted the frame (that is the
backpressure: a slow peer slows the sender, nothing queues without bound); `aclose()` ends it.
Transports know nothing of methods or ids.

A stream whose peer may still read after the end of what it sends (the agent's own stdin and
stdout: a client may close our stdin and wait for the answers) says so with a true
`writable_after_eof` attribute; the engine then answers the requests it has before closing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from acp_once.protocol.framing import FrameEvent

__all__ = ["FrameStream", "MemoryFrameStream", "NowaitFrameStream", "memory_pair"]


@runtime_checkable
class FrameStream(Protocol):
    async def receive(self) -> FrameEvent:
        """Return the next frame. Raises `anyio.EndOfStream` when the peer has finished."""
        ...

    async def send(self, frame: bytes) -> None:
        """Deliver one frame. Raises `anyio.BrokenResourceError` (or `ClosedResourceError`) when
        the peer is gone."""
        ...

    async def aclose(self) -> None:
        """Close the stream; idempotent."""
        ...


@runtime_checkable
class NowaitFrameStream(FrameStream, Protocol):
    """A `FrameStream` that can also write without waiting (the engine's fast path).

    `send_nowait(frame)` writes as much of the frame as the peer takes at once, with no await,
    and returns None when all of it went, or else the unwritten rest. The rest must then be
    passed to `send_rest` before any other frame is sent, or the stream is torn.

    `burst` is False when the last read from the peer brought exactly one frame: a peer that
    sends a request and waits for what it causes. The engine then writes each frame as soon as
    it is made, so the peer reads one while the next is made; otherwise (several frames per
    read: a peer with many requests in flight; or nothing read yet) it writes the frames made
    in one event loop turn together. A hint for speed only: either way is correct.
    """

    burst: bool

    def send_nowait(self, frame: bytes) -> memoryview | None:
        """Write what fits now; the unwritten rest, or None. Raises like `send`."""
        ...

    def send_frames_nowait(self, frames: Sequence[bytes]) -> memoryview | None:
        """`send_nowait` for several whole frames, in order, with one write where the
        transport can (lines joined for stdio, one WebSocket message each)."""
        ...

    async def send_rest(self, rest: memoryview) -> None:
        """Finish a frame that `send_nowait` could not write whole. Raises like `send`."""
        ...


class MemoryFrameStream:
    """One end of an in-memory frame pipe (for fast unit tests)."""

    def __init__(
        self, send: MemoryObjectSendStream[bytes], receive: MemoryObjectReceiveStream[bytes]
    ) -> None:
        self._send = send
        self._receive = receive

    async def receive(self) -> FrameEvent:
        return await self._receive.receive()

    async def send(self, frame: bytes) -> None:
        await self._send.send(frame)

    async def aclose(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()


def memory_pair(buffer: int = 0) -> tuple[MemoryFrameStream, MemoryFrameStream]:
    """Two connected in-memory frame streams. `buffer` 0 gives full backpressure."""
    a_send, b_receive = anyio.create_memory_object_stream[bytes](buffer)
    b_send, a_receive = anyio.create_memory_object_stream[bytes](buffer)
    return MemoryFrameStream(a_send, a_receive), MemoryFrameStream(b_send, b_receive)
