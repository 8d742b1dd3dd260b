"""Newline-delimited JSON framing as a pure state machine.

`LineFramer.feed(chunk)` takes any bytes as they arrive and returns what became complete: whole
frames (the bytes of one line, without the newline) and `OversizedFrame` reports for lines longer
than the limit. An oversized line is never held in memory: once it passes the limit the framer
keeps only its first bytes (enough to find the request id) and skips the rest up to the next
newline, so the connection lives on. Empty lines and a trailing `\r` are ignored, as peers that
write `\r\n` exist.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

__all__ = ["DEFAULT_MAX_FRAME", "FrameEvent", "LineFramer", "OversizedFrame", "sniff_request_id"]

DEFAULT_MAX_FRAME = 64 * 1024 * 1024
"""Default largest frame in bytes: large enough for a prompt that carries big images."""

_HEAD_BYTES = 1024


@dataclass(frozen=True, slots=True)
class OversizedFrame:
    """A frame longer than the limit was skipped.

    Attributes:
        size: how many bytes the frame had (at least `limit + 1`; counted up to its newline, or
            up to end of stream).
        head: its first bytes, for finding the request id it carried.
    """

    size: int
    head: bytes


FrameEvent = bytes | OversizedFrame


class LineFramer:
    """Splits a byte stream into newline-delimited frames, enforcing `max_frame` bytes per frame.

    Feeding the same bytes in any split gives the same frames in the same order.
    """

    __slots__ = ("_buffer", "_head", "_max", "_skipped")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if max_frame < 1:
            raise ValueError("max_frame must be positive")
        self._max = max_frame
        self._buffer = bytearray()
        self._skipped = -1  # >= 0 while skipping an oversized frame: bytes seen so far
        self._head = b""

    @property
    def max_frame(self) -> int:
        return self._max

    def feed(self, chunk: bytes) -> list[FrameEvent]:
        """Consume `chunk`; return the frames and oversize reports it completed, in order."""
        events: list[FrameEvent] = []
        start = 0
        end = len(chunk)
        while start < end:
            newline = chunk.find(b"\n", start)
            stop = end if newline < 0 else newline
            piece = chunk[start:stop]
            if self._skipped >= 0:
                self._skipped += len(piece)
                if len(self._head) < _HEAD_BYTES:
                    self._head += piece[: _HEAD_BYTES - len(self._head)]
            elif len(self._buffer) + len(piece) > self._max:
                self._head = (bytes(self._buffer[:_HEAD_BYTES]) + piece[:_HEAD_BYTES])[:_HEAD_BYTES]
                self._skipped = len(self._buffer) + len(piece)
                self._buffer.clear()
            else:
                self._buffer += piece
            if newline < 0:
                break
            self._finish_line(events)
            start = newline + 1
        return events

    def close(self) -> list[FrameEvent]:
        """End of stream: return the last unterminated frame (or its oversize report), if any."""
        events: list[FrameEvent] = []
        self._finish_line(events)
        return events

    def _finish_line(self, events: list[FrameEvent]) -> None:
        if self._skipped >= 0:
            events.append(OversizedFrame(size=self._skipped, head=self._head))
            self._skipped = -1
            self._head = b""
            return
        line = bytes(self._buffer)
        self._buffer.clear()
        if line.endswith(b"\r"):
            line = line[:-1]
        if line.strip():
            events.append(line)


# The envelope keys come before the payload in every encoder we know of; nested objects (which
# may hold their own "id" fields) live only under params/result/error, so only the text before
# the first of those is searched.
_PAYLOAD = re.compile(rb'"(?:params|result|error)"\s*:')
# 19 digits: every int64 id (checked below), up to 9,223,372,036,854,775,807
_ID = re.compile(rb'"id"\s*:\s*(-?\d{1,19}(?![\d.eE])|"(?:[^"\\]|\\.){0,256}")')
_INT64 = range(-(2**63), 2**63)


def sniff_request_id(head: bytes) -> int | str | None:
    """Best-effort: the top-level JSON-RPC `id` in the first bytes of a frame, else None.

    Used only to address an error response for a frame too large to parse.
    """
    payload = _PAYLOAD.search(head)
    envelope = head[: payload.start()] if payload else head
    if envelope.lstrip()[:1] != b"{":
        return None
    found = _ID.search(envelope)
    if found is None:
        return None
    raw = found.group(1)
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if isinstance(value, int) and value not in _INT64:
        return None  # not an id the engine would answer either
    return value if isinstance(value, int | str) else None
