"""uvicorn's h11 protocol (with `acp_once.server.guard`'s limits) offering SSE responses a
direct writer beside ASGI.

A `POST` whose whole body arrived with its headers says so (`BODY_COMPLETE_EXTENSION`).
Every `GET` gets a `DirectSseWriter` in its scope's extensions
(`acp_once.transports.http.SSE_EXTENSION`). An SSE response that takes it
(`ServerHttpFrames.stream` does, once its response has started through ASGI) writes the events
of its stream as the engine sends them, from the engine's own turn of the event loop, instead
of waking a task per batch that then sends one ASGI event; and it learns that the socket is
gone from the protocol, with no task waiting on ASGI `receive` for the disconnect. The
response's start and end, keep-alive and flow control stay uvicorn's: the writer refuses to
write while the transport's buffer is above its high-water mark (`writable`), as uvicorn's own
`send` would wait.

An app that ignores the extension (any ASGI app) sees plain uvicorn behaviour. Used by
`uvicorn_config` on the uvicorn versions in `acp_once.server.listen.VERIFIED_UVICORN` only: it
reads uvicorn's request cycle (`conn`, `disconnected`, `flow`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, cast

import anyio
import h11

from acp_once.transports.http import SSE_EXTENSION

from .guard import HalfOpenGuard, _GuardedH11

__all__ = [
    "ACCEPTED_EXTENSION",
    "BODY_COMPLETE_EXTENSION",
    "DirectSseWriter",
    "direct_http_protocol",
    "send_accepted",
]

BODY_COMPLETE_EXTENSION = "acp_once.body_complete"
"""In a POST's scope extensions when its whole body had arrived before the app was called:
its first `receive` returns all of it at once (the app then needs no deadline for it)."""


ACCEPTED_EXTENSION = "acp_once.accepted"
"""In a POST's scope extensions: `send_accepted(scope)` may answer it 202 in one write."""

_CLOSE_HEADER = (b"connection", b"close")


def send_accepted(scope: Any, headers: list[tuple[bytes, bytes]]) -> bool:
    """Answer the POST of `scope` 202 Accepted with `headers` (a `content-length: 0` among
    them) and no body, as uvicorn's `send` of the response's start and end does, but with one
    h11 response event per set of default headers (uvicorn's `Date` changes once a second), not
    one built and checked per POST, and no trip through ASGI's send wrappers.

    Returns False, having done nothing, when it cannot: the extension is not offered (not
    under `acp-once serve`), the response has started, the socket's buffer is full (ASGI's
    `send` waits for it to drain), or uvicorn's access log would write a line for it. The caller
    then sends the response through ASGI.
    """
    protocol: _DirectSseH11 | None = scope.get("extensions", {}).get(ACCEPTED_EXTENSION)
    if protocol is None:
        return False
    cycle = protocol.cycle
    if (
        cycle is None
        or cycle.scope is not scope
        or cycle.response_started
        or cycle.disconnected
        or (cycle.access_log and cycle.access_logger.isEnabledFor(logging.INFO))
        or protocol.flow.write_paused
    ):
        return False
    close = _CLOSE_HEADER in scope["headers"]
    cached = _DirectSseH11.accepted_cache
    default_headers = cycle.default_headers
    if (
        cached is not None
        and cached[0] is default_headers
        and cached[1] is headers
        and cached[2] == close
    ):
        response = cached[3]
    else:
        every = default_headers + headers
        if close and _CLOSE_HEADER not in every:
            every = [*every, _CLOSE_HEADER]
        response = h11.Response(status_code=202, headers=every, reason=b"Accepted")
        _DirectSseH11.accepted_cache = (default_headers, headers, close, response)
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    conn = cycle.conn
    output = conn.send(response)
    end = conn.send(h11.EndOfMessage())
    protocol.transport.write(output + end if end else output)
    cycle.response_complete = True
    cycle.message_event.set()
    if conn.our_state is h11.MUST_CLOSE or not cycle.keep_alive:
        conn.send(h11.ConnectionClosed())
        protocol.transport.close()
    cycle.on_response()
    return True


_NO_WAITERS: Final = cast("collections.deque[asyncio.Future[Any]]", ())


class LazyEvent(asyncio.Event):
    """An `asyncio.Event` whose deque of waiters is made by the first `wait` that waits.

    An empty deque is ~0.75 KiB. uvicorn gives every connection an Event (its flow control's
    "writable") and every request one (its cycle's "a message arrived"), and on an idle
    connection neither is ever waited on: a socket whose buffer never filled, an SSE stream
    whose events the direct writer sends. `set` and `clear` behave as `asyncio.Event`'s (`set`
    wakes the waiters of the deque, which is empty until someone waits).
    """

    def __init__(self) -> None:
        # not asyncio.Event.__init__, which makes the deque; the loop binds on the first wait
        self._waiters = _NO_WAITERS
        self._value = False

    async def wait(self) -> Literal[True]:
        if not self._value and self._waiters is _NO_WAITERS:
            self._waiters = collections.deque()
        return await super().wait()


def _lazy(event: asyncio.Event) -> LazyEvent:
    """A `LazyEvent` in the state of `event`, which nothing waits on yet."""
    lazy = LazyEvent()
    if event.is_set():
        lazy.set()
    return lazy


class DirectSseWriter:
    """Writes body chunks of one started response on an h11 connection (implements
    `acp_once.transports.http.SseWriter`)."""

    __slots__ = ("_cycle", "_lost", "_protocol")

    def __init__(self, protocol: _DirectSseH11, cycle: Any) -> None:
        self._protocol = protocol
        self._cycle = cycle
        self._lost: Callable[[], object] | None = None

    @property
    def writable(self) -> bool:
        return not self._protocol.flow.write_paused

    def write(self, data: bytes) -> None:
        cycle = self._cycle
        transport = self._protocol.transport
        if cycle.disconnected or cycle.response_complete or transport.is_closing():
            raise anyio.BrokenResourceError
        try:
            output = cycle.conn.send(h11.Data(data=data))
        except h11.LocalProtocolError as exc:  # the response is not in its body
            raise anyio.BrokenResourceError from exc
        transport.write(output)

    async def wait_writable(self) -> None:
        protocol = self._protocol
        while protocol.flow.write_paused and not self._cycle.disconnected:
            await protocol.flow.drain()

    def on_lost(self, callback: Callable[[], object] | None) -> None:
        self._lost = callback
        if callback is not None and self._cycle.disconnected:
            self._lost = None
            callback()

    def _connection_lost(self) -> None:
        callback, self._lost = self._lost, None
        if callback is not None:
            callback()


class _DirectSseH11(_GuardedH11):
    accepted_cache: tuple[Any, Any, bool, h11.Response] | None = None
    """`send_accepted`'s last response event: (uvicorn's default headers object, the caller's
    headers object, Connection: close asked, the event)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # nothing waits on it yet: only a response's send does, once the socket's buffer fills
        self.flow._is_writable_event = _lazy(self.flow._is_writable_event)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        cycle = self.cycle
        # a new request's cycle: its task has not started yet, so the app sees the extension
        # and nothing waits on its message event (which a whole body has set already)
        if cycle is None or cycle is before:
            return
        cycle.message_event = _lazy(cycle.message_event)
        method = cycle.scope["method"]
        if method == "GET":
            # kept in the scope only: one more attribute would grow every protocol's __dict__
            writer = DirectSseWriter(self, cycle)
            cycle.scope.setdefault("extensions", {})[SSE_EXTENSION] = {"writer": writer}
        elif method == "POST":
            extensions: dict[str, Any] = cycle.scope.setdefault("extensions", {})
            extensions[ACCEPTED_EXTENSION] = self
            if not cycle.more_body:
                extensions[BODY_COMPLETE_EXTENSION] = {}

    def on_response_complete(self) -> None:
        cycle = self.cycle
        if cycle is not None:  # (before super(), which may start the next request's cycle)
            _release(cycle.scope)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        cycle = self.cycle
        if cycle is not None:
            extensions: dict[str, Any] = cycle.scope.get("extensions") or {}
            offered = extensions.get(SSE_EXTENSION)
            writer = offered.get("writer") if isinstance(offered, dict) else None
            if isinstance(writer, DirectSseWriter):
                writer._connection_lost()
            _release(cycle.scope)


def _release(scope: Mapping[str, object]) -> None:
    """Take the extensions that refer to the protocol out of a request's `scope` once its
    response is complete or its socket gone: a writer holds the protocol and the request's
    cycle, which holds the scope, and `ACCEPTED_EXTENSION` is the protocol itself. Left in,
    each would be a reference cycle that only the cyclic garbage collector frees, and
    `acp-once serve` runs it rarely (`tune_gc_for_serving`): the socket, protocol and cycle of
    every SSE stream a client closed would stay in memory until then (~5 KiB each)."""
    extensions = scope.get("extensions")
    if isinstance(extensions, dict):
        extensions.pop(SSE_EXTENSION, None)
        extensions.pop(ACCEPTED_EXTENSION, None)


def direct_http_protocol(guard: HalfOpenGuard) -> type[_GuardedH11]:
    """uvicorn's h11 protocol bound to `guard`, with direct SSE writers (module docstring)."""
    return type("GuardedH11Protocol", (_DirectSseH11,), {"guard": guard})
