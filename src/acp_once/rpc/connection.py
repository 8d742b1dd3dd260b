"""A method-agnostic JSON-RPC 2.0 engine over a `FrameStream`, on anyio.

One `Connection` per transport connection. It correlates outbound requests with their answers,
runs each inbound request in a task of its own (tasks are reused: a few finished ones wait for
the next request, as starting a task costs more than a whole small request) and its own cancel
scope, implements `$/cancel_request` in
both directions (exactly one answer per request; unknown ids ignored), and holds the single
boundary where exceptions become error responses:

- `AcpError` -> its own code, message and data;
- pydantic `ValidationError` -> -32602 naming the fields, never the library's text or input;
- anything else -> -32603 "Internal error", with the traceback logged.

Outbound frames are queued and written together, one system call for all the frames that the
woken tasks produce within two turns of the event loop (see `Connection._send`); a frame is
never torn, and every write that must wait for the peer is bounded by `send_timeout`.

Back-pressure, and the memory of one connection: a request holds one of `max_inflight` slots
from the moment it is read until its answer has been written to the transport or queued in the
outbox (at most 64 KiB), and the reader takes no new request while every slot is held. So a
peer that sends without reading our answers stops being read from (its writes block, or fail on
its side), and what one connection holds is bounded by: `max_inflight` requests with their
handlers and answers, the outbox, one half-written chunk, and the transport's own read-ahead
(stdio: at most 1 MiB unread, then the pipe; see `acp_once.transports.stdio`). Measured with
`benchmarks/bench_backpressure.py`: 60,000 unread `session/list` requests leave the reference
agent at ~50 MB (665 MB before the slot was held until the answer was written). Frames the
reader answers itself (parse errors, refused requests) are written by the reader, which waits
for them in the same way.

Batches (D21): an inbound JSON array is taken entry by entry, each as if it had come alone
(requests run concurrently in their own tasks, notifications inline, answers to our requests
are matched), and the answers to its requests are written together as one array once the last
is made (`_BatchReply`): a slow entry holds back the answers of the fast ones in its batch. An
empty array, an array over `max_batch` entries, or an array on a connection that refuses
batches (v1, D42) gets one -32600 with `id: null` and none of its entries is processed (D41).
`start_batch` sends a batch of our own.

Methods are strings and params are dicts here: typed faces live in `acp_once.agent` and
`acp_once.client`. The connection's tasks live in a task group that `async with` opens and
closes in the same task.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

import anyio
from anyio.abc import TaskGroup
from pydantic import ValidationError

from acp_once.protocol import jsonrpc
from acp_once.protocol.errors import (
    AcpError,
    InternalError,
    InvalidRequest,
    MethodNotFound,
    RequestCancelled,
    error_from_wire,
    invalid_params_from_validation,
)
from acp_once.protocol.framing import OversizedFrame, sniff_request_id
from acp_once.protocol.jsonrpc import RequestId
from acp_once.protocol.methods import CANCEL_REQUEST
from acp_once.rpc.errors import BatchRefused, ConnectionClosed, FrameTooLarge, RequestTimeout
from acp_once.rpc.streams import FrameStream, NowaitFrameStream
from acp_once.rpc.tasks import TaskPool, cancel_scope_factory

__all__ = [
    "DEFAULT_MAX_BATCH",
    "BatchEntry",
    "Connection",
    "Gate",
    "NotificationHandler",
    "PendingCall",
    "RequestContext",
    "RequestHandler",
    "unwrap_single_exception",
]

logger = logging.getLogger("acp_once.rpc")

_SHUTDOWN_WRITE_TIMEOUT = 2.0
# after the peer's last frame, how long its requests still may take to be answered
_ANSWER_AFTER_EOF = 2.0
# what a write raises when the peer is gone (or the stream closed under it)
_SEND_ERRORS = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)
_OUTBOX_LIMIT = 64 * 1024
DEFAULT_MAX_BATCH = 256
"""Entries one inbound batch may hold (D41); a longer one is refused whole."""


@contextlib.contextmanager
def unwrap_single_exception() -> Iterator[None]:
    """Re-raise the only exception of an exception group as itself.

    anyio wraps an exception raised in a task group's body in a group; callers of our
    context managers should be able to write `except ConnectionClosed:`.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


class Gate(Protocol):
    """Admission rules applied to inbound messages before dispatch (e.g. `InitializeGate`).

    The gate knows which methods it cares about; the engine only asks it.
    """

    def admit_request(self, method: str) -> Callable[[bool], None] | None:
        """Admit a request, or refuse it by raising `AcpError` (which becomes its answer).

        A returned callback is called once the request is answered, with True if it succeeded.
        """
        ...

    def admit_notification(self, method: str) -> bool:
        """True when a notification may be handled (`$/cancel_request` is acted on anyway)."""
        ...


@dataclass(eq=False, slots=True)
class RequestContext:
    """What a request handler knows about the request it serves.

    A handler that must decide for itself what a `$/cancel_request` means (an already inserted
    prompt answers success, a held one is withdrawn) calls `on_cancel(callback)`; the engine then
    calls the callback instead of cancelling the handler's scope.
    """

    id: RequestId
    method: str
    connection: Connection
    seq: int = 0
    """Arrival order on this connection (requests and notifications share one counter)."""
    cooperative: bool = False
    """The handler decides what a cancel means: the engine never cancels its scope for it."""
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    cancel_requested: bool = False
    _cancel_callback: Callable[[], None] | None = None

    def on_cancel(self, callback: Callable[[], None] | None) -> None:
        """Take over `$/cancel_request` for this request (None gives it back to the engine).

        If a cancel already arrived, the callback runs at once.
        """
        self._cancel_callback = callback
        if callback is not None and self.cancel_requested:
            callback()

    def _cancel(self) -> None:
        self.cancel_requested = True
        if self._cancel_callback is not None:
            self._cancel_callback()
        elif not self.cooperative:
            self.scope.cancel()


RequestHandler = Callable[[str, dict[str, Any] | None, RequestContext], Awaitable[Any]]
"""`(method, params, ctx) -> result`: the result must be JSON-serialisable (dicts, lists...)."""
NotificationHandler = Callable[[str, dict[str, Any] | None], Awaitable[None]]
"""`(method, params) -> None`. Runs inline in the reader, in arrival order: it must not wait for
an answer from the peer."""


async def _no_requests(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
    raise MethodNotFound(f"Method not found: {method}")


async def _no_notifications(method: str, params: dict[str, Any] | None) -> None:
    return None


@dataclass(frozen=True, slots=True)
class BatchEntry:
    """One message of a batch we send (`Connection.start_batch`): a request, or a
    notification when `notification` is True."""

    method: str
    params: Any = None
    notification: bool = False


class _BatchReply:
    """The answers to one inbound batch's requests, written as one array when the last is in.

    The reader counts each answer it expects (`expect`) while it takes the batch's entries and
    `seal`s it after the last; every expected answer arrives by `add` exactly once (an entry's
    own answer path: its task, or the reader for a refused or invalid entry). Nothing is written
    for a batch that expects no answer (notifications and responses only).
    """

    __slots__ = ("_connection", "_expected", "_frames", "_sealed")

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._frames: list[bytes] = []
        self._expected = 0
        self._sealed = False

    def expect(self) -> None:
        self._expected += 1

    async def add(self, frame: bytes) -> None:
        self._frames.append(frame)
        await self._write_if_complete()

    async def seal(self) -> None:
        self._sealed = True
        await self._write_if_complete()

    async def _write_if_complete(self) -> None:
        if not self._sealed or len(self._frames) < self._expected:
            return
        frames, self._frames = self._frames, []
        try:
            if frames:
                await self._connection._answer_quietly(jsonrpc.encode_batch(frames))
        finally:
            self._connection._answered_one()


class PendingCall:
    """An outbound request awaiting its answer."""

    __slots__ = ("_done", "_outcome", "connection", "id", "method")

    def __init__(self, connection: Connection, id: RequestId, method: str) -> None:
        self.connection = connection
        self.id = id
        self.method = method
        self._done = anyio.Event()
        self._outcome: tuple[bool, Any] | None = None

    @property
    def done(self) -> bool:
        return self._outcome is not None

    def _resolve(self, ok: bool, value: Any) -> None:
        if self._outcome is None:
            self._outcome = (ok, value)
            self._done.set()

    async def result(self, timeout: float | None = None) -> Any:
        """Wait for the answer and return its `result`.

        Raises:
            AcpError: the peer answered with an error (the subclass matching its code).
            ConnectionClosed: the connection ended first; the outcome is unknown.
            FrameTooLarge: the answer exceeded the frame limit.
            RequestTimeout: no answer within `timeout` seconds; `$/cancel_request` was sent.
        """
        try:
            if timeout is None:
                await self._done.wait()
            else:
                with anyio.fail_after(timeout):
                    await self._done.wait()
        except TimeoutError:
            await self.cancel()
            raise RequestTimeout(f"No answer to '{self.method}' within {timeout} s") from None
        assert self._outcome is not None
        ok, value = self._outcome
        if ok:
            return value
        raise value

    async def cancel(self) -> None:
        """Ask the peer to cancel (`$/cancel_request`); the definite answer still arrives."""
        if not self.done:
            await self.connection.notify(CANCEL_REQUEST, {"requestId": self.id}, quiet=True)


class Connection(anyio.AsyncContextManagerMixin):
    """A JSON-RPC connection over one `FrameStream`.

    Use as `async with Connection(stream, ...) as conn:`; leaving the block closes the stream,
    cancels inbound handlers and fails outbound requests with `ConnectionClosed`.

    Args:
        stream: the transport.
        on_request: handles inbound requests (default: -32601 for every method).
        on_notification: handles inbound notifications (default: ignore).
        gate: admission rules checked before dispatch (the agent side passes `InitializeGate`);
            the entries of a batch are admitted one by one, in order.
        cooperative_cancel: methods whose handlers take `$/cancel_request` into their own hands
            (`RequestContext.on_cancel`), even when it arrives before the handler started: the
            engine then never cancels their scope (an inserted prompt must still succeed).
        max_inflight: inbound requests handled or being answered at once; beyond it the
            reader waits (bounded by the peer: a slot frees when an answer is written).
        send_timeout: seconds a frame may wait for the peer to read it before the connection
            is treated as gone.
        max_batch: entries an inbound batch may hold; a longer batch gets one -32600 (D41).
        name: shown in logs.
        inline_reader: read in the task that calls `serve()`, not in a reader task that
            `async with` starts: a server with many idle connections holds one task less per
            connection (~2.5 KiB). Nothing is read until `serve()` is called.
    """

    # Slots: with ~30 attributes, a dict per connection would be ~1.6 KiB (a server holds
    # many). The mixin's own attribute still lives in a small __dict__.
    __slots__ = (
        "_all_answered",
        "_answer_after_eof",
        "_arrivals",
        "_batch_refusal",
        "_call_soon",
        "_closed",
        "_cooperative",
        "_free_slots",
        "_gate",
        "_ids",
        "_inflight",
        "_inline_reader",
        "_input_ended",
        "_is_closed",
        "_max_batch",
        "_name",
        "_new_scope",
        "_nowait",
        "_on_notification",
        "_on_request",
        "_outbox",
        "_outbox_size",
        "_pending",
        "_reading",
        "_rest",
        "_send_lock",
        "_send_timeout",
        "_servers",
        "_slot_freed",
        "_stream",
        "_tg",
        "_unanswered",
    )

    def __init__(
        self,
        stream: FrameStream,
        *,
        on_request: RequestHandler = _no_requests,
        on_notification: NotificationHandler = _no_notifications,
        gate: Gate | None = None,
        max_inflight: int = 256,
        name: str = "acp",
        cooperative_cancel: frozenset[str] = frozenset(),
        send_timeout: float = 60.0,
        max_batch: int = DEFAULT_MAX_BATCH,
        inline_reader: bool = False,
    ) -> None:
        self._inline_reader = inline_reader
        self._reading = False
        self._send_timeout = send_timeout
        self._max_batch = max_batch
        self._batch_refusal: str | None = None  # set: arrays are refused whole (v1, D42)
        self._cooperative = cooperative_cancel
        self._arrivals = 0
        self._stream = stream
        self._nowait = stream if isinstance(stream, NowaitFrameStream) else None
        self._outbox: list[bytes] = []  # frames queued in this event loop turn (see _send)
        self._outbox_size = 0
        self._rest: memoryview | None = None  # a half-written chunk: it goes before anything
        self._call_soon: Callable[..., object] | None = None
        self._on_request = on_request
        self._on_notification = on_notification
        self._gate = gate
        self._name = name
        # Inbound request slots: a count, and an event made only while the reader waits for
        # one (the reader is the only task that takes slots). An idle connection holds no
        # lock, semaphore or event (each ~0.8 KiB with its waiters' deque): see `_lock`.
        self._free_slots = max_inflight
        self._slot_freed: anyio.Event | None = None
        self._send_lock: anyio.Lock | None = None
        self._ids = itertools.count(0)
        self._pending: dict[RequestId, PendingCall] = {}
        self._inflight: dict[RequestId, RequestContext] = {}
        self._servers: TaskPool | None = None
        self._new_scope: Callable[[], anyio.CancelScope] = anyio.CancelScope
        self._tg: TaskGroup | None = None
        self._closed: anyio.Event | None = None  # made when someone waits for the close
        self._is_closed = False  # the state, read on the send path; _closed is for waiters
        # the peer may read after it sent its last frame (stdin closed, stdout still open)
        self._answer_after_eof: bool = getattr(stream, "writable_after_eof", False)
        self._input_ended = False
        self._unanswered = 0  # requests handed to a task, until their answer is sent
        self._all_answered: anyio.Event | None = None  # set up when the reader waits for them

    # -- lifecycle -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncIterator[Self]:
        try:
            with unwrap_single_exception():
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    self._servers = TaskPool(tg, name=f"{self._name}-request")
                    self._new_scope = cancel_scope_factory()
                    if self._nowait is not None:
                        with contextlib.suppress(RuntimeError):  # not on asyncio: no outbox
                            self._call_soon = asyncio.get_running_loop().call_soon
                    if not self._inline_reader:
                        tg.start_soon(self._read_loop, name=f"{self._name}-reader")
                    try:
                        yield self
                    finally:
                        self._shutdown()
                        tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(_SHUTDOWN_WRITE_TIMEOUT):
                if self._outbox or self._rest is not None:  # what was sent before the close
                    with contextlib.suppress(*_SEND_ERRORS):
                        async with self._lock():
                            await self._drain_locked()
                await self._stream.aclose()

    @property
    def arrivals(self) -> int:
        """How many messages have arrived so far; a message's `seq` is the count at its arrival.

        Handlers use it to order a notification (`session/cancel`) against requests that arrived
        before it but have not run yet.
        """
        return self._arrivals

    @property
    def closed(self) -> bool:
        """True once the peer went away or the connection was closed."""
        return self._is_closed

    async def wait_closed(self) -> None:
        """Wait until the connection has ended (peer gone or closed locally)."""
        if self._is_closed:
            return
        if self._closed is None:
            self._closed = anyio.Event()
        await self._closed.wait()

    async def serve(self) -> None:
        """Serve until the connection has ended: with `inline_reader`, read and dispatch the
        peer's messages in this task (call it once, inside the `async with` block); otherwise
        the same as `wait_closed`.

        Raises:
            RuntimeError: called a second time with `inline_reader`.
        """
        if not self._inline_reader:
            await self.wait_closed()
            return
        if self._reading:
            raise RuntimeError("serve() reads in the task that calls it: call it once")
        self._reading = True
        if not self._is_closed:
            await self._read_loop()

    def _lock(self) -> anyio.Lock:
        """The send lock, made on first use (fast_acquire: an uncontended lock is taken
        without a trip through the event loop)."""
        lock = self._send_lock
        if lock is None:
            lock = self._send_lock = anyio.Lock(fast_acquire=True)
        return lock

    def _writing(self) -> bool:
        """Whether a writer holds the send lock."""
        lock = self._send_lock
        return lock is not None and lock.locked()

    def refuse_batches(self, reason: str) -> None:
        """From now on, answer every inbound batch with one -32600 (`reason` as its message)
        and refuse to send one (`start_batch` raises `BatchRefused`): the peer speaks a
        version without batches (ACP v1, D42)."""
        self._batch_refusal = reason

    def _shutdown(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if self._closed is not None:
            self._closed.set()
        if self._inline_reader and self._tg is not None:
            # the reader is the task that hosts the task group (`serve`): stop it reading
            self._tg.cancel_scope.cancel()
        pending, self._pending = self._pending, {}
        for call in pending.values():
            call._resolve(
                False, ConnectionClosed(f"Connection closed before '{call.method}' was answered")
            )
        for ctx in list(self._inflight.values()):
            ctx.scope.cancel()

    # -- outbound --------------------------------------------------------------------------

    async def _send(self, frame: bytes) -> None:
        """Write one whole frame, in order with every other frame of this connection.

        With a transport that can write without waiting (`NowaitFrameStream`) on asyncio, the
        frame is written at once when the peer waits on us, or else joins the outbox, which is
        written with one system call after the current turn of the event loop (see `_queue`
        and `_flush_outbox`; at most `_OUTBOX_LIMIT` bytes wait, a bigger frame is written at
        once with those before it). A write that has to wait for the peer is shielded: a frame
        cancelled half-way would leave a torn line that corrupts the stream for everything
        after it. It is bounded instead: a peer that reads nothing for
        `send_timeout` seconds is treated as gone, and the connection is closed. A frame is
        "sent" once it is queued: like bytes in a pipe's buffer, it is lost if the peer dies
        before reading it.

        Raises:
            ConnectionClosed: the connection is closed, or broke (or stalled) while sending.
        """
        if self._is_closed:
            raise ConnectionClosed("Connection is closed")
        try:
            written = False
            lock = self._send_lock  # inline, not _writing(): this is every frame's path
            if (
                self._nowait is not None
                and self._rest is None
                and (lock is None or not lock.locked())
            ):
                # Nobody is writing and nothing is half-written, so no await is needed: queue
                # the frame, or write the outbox and the frame now.
                if self._queue(frame):
                    return
                self._rest = self._write_outbox(frame)
                if self._rest is None:
                    return
                written = True  # partly: the rest waits for room under the lock, below
            async with self._lock():
                with anyio.CancelScope(
                    shield=True, deadline=anyio.current_time() + self._send_timeout
                ) as scope:
                    await self._drain_locked()
                    if not written:
                        await self._stream.send(frame)
                if scope.cancelled_caught:
                    raise anyio.BrokenResourceError("the peer stopped reading")
        except _SEND_ERRORS as exc:
            raise self._lost_while_sending() from exc

    def _queue(self, frame: bytes) -> bool:
        """Send `frame` without waiting if this transport can: write it now, or add it to the
        outbox if it has room; True if done.

        Only when nobody holds the send lock and nothing is half-written (the caller checks).
        A peer that waits on us (`NowaitFrameStream.burst` is False: it sent one frame) gets
        each frame at once: it reads and handles one while we make the next, instead of
        receiving a loop turn's frames together after the last. A peer with many requests in
        flight gets them together (one system call for many frames).

        Raises:
            anyio.BrokenResourceError, anyio.ClosedResourceError, OSError: as `send_nowait`.
        """
        if self._call_soon is None:
            return False
        assert self._nowait is not None
        if not self._outbox and not self._nowait.burst:
            self._rest = self._nowait.send_nowait(frame)
            if self._rest is not None:
                self._finish_later()  # the pipe is full: the next frame waits for this one
            return True
        if self._outbox_size + len(frame) > _OUTBOX_LIMIT:
            return False
        self._outbox.append(frame)
        self._outbox_size += len(frame)
        if len(self._outbox) == 1:
            self._call_soon(self._flush_outbox)
        return True

    def send_encoded_nowait(self, frame: bytes) -> bool:
        """Send a notification already encoded (`jsonrpc.encode_notification`) if that needs no
        waiting; True when it was sent.

        It is queued in the outbox like any frame (same order, same write). False, with
        nothing sent, when sending would have to wait (a write is in progress, the outbox is
        full, or the transport has no outbox): then await `send_encoded`. It spares a caller
        that sends many small notifications (a turn's updates) a coroutine each, and one sent
        to several connections is encoded once.

        Raises:
            ConnectionClosed: the connection is closed.
        """
        if self._is_closed:
            raise ConnectionClosed("Connection is closed")
        lock = self._send_lock
        if (
            self._call_soon is None
            or self._rest is not None
            or (lock is not None and lock.locked())
        ):
            return False
        try:
            return self._queue(frame)
        except _SEND_ERRORS as exc:
            raise self._lost_while_sending() from exc

    async def send_encoded(self, frame: bytes) -> None:
        """`notify` for a notification already encoded (`jsonrpc.encode_notification`).

        Raises:
            ConnectionClosed: the connection is closed, or broke while sending.
        """
        await self._send(frame)

    def _write_outbox(self, frame: bytes | None) -> memoryview | None:
        """Write the outbox (and `frame`) without waiting; return the unwritten rest, if any."""
        assert self._nowait is not None
        frames = self._outbox
        if frame is not None:
            frames.append(frame)
        self._outbox = []
        self._outbox_size = 0
        if len(frames) == 1:
            return self._nowait.send_nowait(frames[0])
        return self._nowait.send_frames_nowait(frames)

    async def _drain_locked(self) -> None:
        """Under the send lock: finish a half-written chunk, then write the outbox."""
        while self._rest is not None or self._outbox:
            if self._rest is not None:
                assert self._nowait is not None
                await self._nowait.send_rest(self._rest)
                self._rest = None
            if self._outbox:
                self._rest = self._write_outbox(None)

    def _flush_outbox(self) -> None:
        """After the event loop turn in which frames were queued: write them, in one call.

        Not one turn later, although the tasks that turn woke (a prompt's answer starts its
        turn) would then add their frames to the same write: a prompt's answer is what tells a
        client its message is in (the moment after which a retry is safe), so it goes out as
        soon as it is ready, and the peer reads it while the turn's first updates are made.
        Measured with the echo turn: one more system call, and a turn that ends sooner.
        """
        if not self._outbox or self._rest is not None or self._writing():
            return  # a writer holds the lock and writes the outbox before its own frame
        try:
            self._rest = self._write_outbox(None)
        except _SEND_ERRORS:
            self._lost_while_sending()
            return
        if self._rest is not None:
            self._finish_later()

    def _lost_while_sending(self) -> ConnectionClosed:
        """A write failed (the peer is gone): shut the connection down; returns the error for
        the sender to raise."""
        self._shutdown()
        return ConnectionClosed("Connection lost while sending")

    def _finish_later(self) -> None:
        """The peer's buffer is full: finish the half-written chunk in a task, which may wait
        (bounded); until then, every sender waits for it under the send lock."""
        try:
            assert self._tg is not None
            self._tg.start_soon(self._finish_rest, name=f"{self._name}-writer")
        except RuntimeError:  # the task group has ended: nobody is left to finish it
            self._shutdown()

    async def _finish_rest(self) -> None:
        try:
            async with self._lock():
                with anyio.CancelScope(
                    shield=True, deadline=anyio.current_time() + self._send_timeout
                ) as scope:
                    await self._drain_locked()
                if scope.cancelled_caught:
                    raise anyio.BrokenResourceError("the peer stopped reading")
        except _SEND_ERRORS:
            self._lost_while_sending()

    async def start_request(self, method: str, params: Any = None) -> PendingCall:
        """Send a request and return its `PendingCall` without waiting for the answer.

        Raises:
            ConnectionClosed: the connection is closed, or broke while sending.
        """
        if self._input_ended:
            raise ConnectionClosed(f"The peer stopped sending: '{method}' could not be answered")
        id = next(self._ids)
        call = PendingCall(self, id, method)
        self._pending[id] = call
        try:
            await self._send(jsonrpc.encode_request(id, method, params))
        except BaseException:
            self._pending.pop(id, None)
            raise
        return call

    async def start_batch(self, entries: Sequence[BatchEntry]) -> list[PendingCall]:
        """Send `entries` as one JSON-RPC batch; return the `PendingCall` of each request entry,
        in their order (notifications have none).

        Each call is answered on its own (the peer writes its answers as one array, in any
        order, once it has made them all: D21); `PendingCall.cancel` cancels one entry.

        Raises:
            BatchRefused: nothing was sent: `entries` is empty, the transport carries no
                batches (Streamable HTTP, D43) or the peer speaks a version without them (D42).
            ConnectionClosed: the connection is closed, or broke while sending.
        """
        if not entries:
            raise BatchRefused("A batch must hold at least one message")
        if self._batch_refusal is not None:
            raise BatchRefused(self._batch_refusal)
        if not getattr(self._stream, "carries_batches", True):
            raise BatchRefused("This transport carries no batches: send each message alone")
        if self._input_ended:
            raise ConnectionClosed("The peer stopped sending: a batch could not be answered")
        calls: list[PendingCall] = []
        frames: list[bytes] = []
        try:
            for entry in entries:
                if entry.notification:
                    frames.append(jsonrpc.encode_notification(entry.method, entry.params))
                    continue
                id = next(self._ids)
                call = PendingCall(self, id, entry.method)
                self._pending[id] = call
                calls.append(call)
                frames.append(jsonrpc.encode_request(id, entry.method, entry.params))
            await self._send(jsonrpc.encode_batch(frames))
        except BaseException:
            for call in calls:
                self._pending.pop(call.id, None)
            raise
        return calls

    async def request(
        self, method: str, params: Any = None, *, timeout: float | None = None
    ) -> Any:
        """Send a request and return the `result` of its answer.

        If the caller is cancelled while waiting, `$/cancel_request` is sent for it.

        Raises:
            AcpError: the peer answered with an error.
            ConnectionClosed: the connection ended before the answer; the outcome is unknown.
            RequestTimeout: no answer within `timeout`.
        """
        call = await self.start_request(method, params)
        try:
            return await call.result(timeout)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(_SHUTDOWN_WRITE_TIMEOUT):
                await call.cancel()
            raise
        finally:
            self._pending.pop(call.id, None)

    async def notify(self, method: str, params: Any = None, *, quiet: bool = False) -> None:
        """Send a notification.

        Raises:
            ConnectionClosed: the connection is closed (unless `quiet`, which drops it silently).
        """
        try:
            await self._send(jsonrpc.encode_notification(method, params))
        except ConnectionClosed:
            if not quiet:
                raise

    # -- inbound ---------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    frame = await self._stream.receive()
                except anyio.EndOfStream:
                    if self._answer_after_eof:
                        await self._answer_before_closing()
                    break
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    break
                if isinstance(frame, OversizedFrame):
                    await self._on_oversized(frame)
                    continue
                self._arrivals += 1
                await self._dispatch(jsonrpc.decode(frame))
        except OSError as exc:
            logger.debug("%s: connection lost: %s", self._name, exc.strerror or exc)
        finally:
            self._shutdown()

    async def _answer_before_closing(self) -> None:
        """The peer sent its last frame but may still read: answer the requests it sent (a last
        line without a newline included), for at most `_ANSWER_AFTER_EOF` seconds. Requests of
        ours can get no answer any more: they fail now."""
        self._input_ended = True
        pending, self._pending = self._pending, {}
        for call in pending.values():
            call._resolve(
                False,
                ConnectionClosed(f"The peer stopped sending before '{call.method}' was answered"),
            )
        if self._unanswered:
            self._all_answered = anyio.Event()
            with anyio.move_on_after(_ANSWER_AFTER_EOF):
                await self._all_answered.wait()

    async def _dispatch(self, msg: jsonrpc.Message) -> None:
        match msg:
            case jsonrpc.Request():
                await self._on_inbound_request(msg)
            case jsonrpc.Notification():
                await self._on_inbound_notification(msg)
            case jsonrpc.Response(id=id, result=result):
                call = self._pending.pop(id, None)
                if call is None:
                    logger.debug("%s: dropping answer for unknown id", self._name)
                else:
                    call._resolve(True, result)
            case jsonrpc.ErrorResponse(id=id, error=error):
                call = self._pending.pop(id, None) if id is not None else None
                if call is None:
                    logger.warning(
                        "%s: peer sent an error for no pending request: %s",
                        self._name,
                        error.get("code"),
                    )
                else:
                    call._resolve(False, error_from_wire(error))
            case jsonrpc.Invalid(code=code, message=message, id=id, answer=answer):
                logger.warning("%s: invalid message from peer (%s): %s", self._name, code, message)
                if answer:
                    await self._answer_quietly(
                        jsonrpc.encode_error(id, {"code": code, "message": message})
                    )
            case jsonrpc.Batch(entries=entries):
                await self._on_batch(entries)

    async def _on_batch(self, entries: list[Any]) -> None:
        """Take a batch's entries one by one, in order, as if each had come alone (D21): its
        requests' answers go into one reply array, written when the last one is made."""
        refusal = self._batch_refusal
        if refusal is None and len(entries) > self._max_batch:
            refusal = f"A batch may hold at most {self._max_batch} messages"
        if refusal is not None:
            logger.warning("%s: refused a batch of %d messages", self._name, len(entries))
            await self._answer_quietly(jsonrpc.encode_error(None, InvalidRequest(refusal)))
            return
        reply = _BatchReply(self)
        self._unanswered += 1  # the reply array: the reader waits for it at end of input
        self._arrivals -= 1  # the read loop counted the frame; each entry counts instead
        try:
            for entry in entries:
                self._arrivals += 1
                msg = jsonrpc.decode_entry(entry)
                match msg:
                    case jsonrpc.Request():
                        reply.expect()
                        await self._on_inbound_request(msg, reply)
                    case jsonrpc.Invalid(code=code, message=message, id=id, answer=answer):
                        logger.warning(
                            "%s: invalid batch entry from peer (%s): %s", self._name, code, message
                        )
                        if answer:
                            reply.expect()
                            error = {"code": code, "message": message}
                            await reply.add(jsonrpc.encode_error(id, error))
                    case _:
                        await self._dispatch(msg)
        finally:
            await reply.seal()

    def _answered_one(self) -> None:
        """An answer (or a batch's reply array) taken into account by `_unanswered` is sent."""
        self._unanswered -= 1
        if self._all_answered is not None and not self._unanswered:
            self._all_answered.set()

    async def _on_oversized(self, frame: OversizedFrame) -> None:
        id = sniff_request_id(frame.head)
        looks_like_request = b'"method"' in frame.head
        logger.warning("%s: dropped a frame of %d bytes over the limit", self._name, frame.size)
        if looks_like_request:
            error = InvalidRequest("Message exceeds the maximum frame size")
            await self._answer_quietly(jsonrpc.encode_error(id, error))
        elif id is not None:
            call = self._pending.pop(id, None)
            if call is not None:
                call._resolve(False, FrameTooLarge(f"The answer to '{call.method}' was too large"))

    async def _on_inbound_notification(self, msg: jsonrpc.Notification) -> None:
        if msg.method == CANCEL_REQUEST:
            request_id: Any = (msg.params or {}).get("requestId")
            if jsonrpc.is_request_id(request_id):
                ctx = self._inflight.get(request_id)
                if ctx is not None and not ctx.cancel_requested:
                    ctx._cancel()
            # unknown or answered ids: ignore, never a second answer
            if self._gate is None or self._gate.admit_notification(msg.method):
                await self._call_notification_handler(msg)
            return
        if self._gate is not None and not self._gate.admit_notification(msg.method):
            logger.debug("%s: ignoring '%s' before initialization", self._name, msg.method)
            return
        await self._call_notification_handler(msg)

    async def _call_notification_handler(self, msg: jsonrpc.Notification) -> None:
        try:
            await self._on_notification(msg.method, msg.params)
        except Exception:
            logger.exception("%s: notification handler for '%s' failed", self._name, msg.method)

    async def _on_inbound_request(
        self, msg: jsonrpc.Request, batch: _BatchReply | None = None
    ) -> None:
        if msg.id in self._inflight:
            # D19: echoing the id would look like the original's answer
            refused = jsonrpc.encode_error(None, InvalidRequest("Request id is already in use"))
            if batch is None:
                await self._answer_quietly(refused)
            else:
                await batch.add(refused)
            return
        answered: Callable[[bool], None] | None = None
        if self._gate is not None:
            try:
                answered = self._gate.admit_request(msg.method)
            except AcpError as exc:
                if batch is None:
                    await self._answer_quietly(jsonrpc.encode_error(msg.id, exc))
                else:
                    await batch.add(jsonrpc.encode_error(msg.id, exc))
                return
        ctx = RequestContext(
            msg.id,
            msg.method,
            self,
            self._arrivals,
            cooperative=msg.method in self._cooperative,
            scope=self._new_scope(),
        )
        self._inflight[msg.id] = ctx
        self._unanswered += 1
        while self._free_slots <= 0:  # every slot held: wait for an answer to be written
            if self._slot_freed is None:
                self._slot_freed = anyio.Event()
            await self._slot_freed.wait()
        self._free_slots -= 1  # free (the common case): no checkpoint needed
        assert self._servers is not None
        self._servers.start_soon(self._serve, msg, ctx, answered, batch)

    async def _serve(
        self,
        msg: jsonrpc.Request,
        ctx: RequestContext,
        answered: Callable[[bool], None] | None,
        batch: _BatchReply | None,
    ) -> None:
        frame: bytes | None = None
        ok = False
        try:
            with ctx.scope:
                try:
                    result = await self._on_request(msg.method, msg.params, ctx)
                    frame = jsonrpc.encode_result(msg.id, result)
                    ok = True
                except AcpError as exc:
                    frame = jsonrpc.encode_error(msg.id, exc)
                except ValidationError as exc:
                    frame = jsonrpc.encode_error(msg.id, invalid_params_from_validation(exc))
                except Exception:
                    logger.exception("%s: handler for '%s' failed", self._name, msg.method)
                    frame = jsonrpc.encode_error(msg.id, InternalError())
            if frame is None and not self._is_closed:
                # the scope was cancelled: by $/cancel_request, or by shutdown of the handler
                frame = jsonrpc.encode_error(msg.id, RequestCancelled())
        finally:
            # Answered: a cancel means nothing now. Dropping the handler's callback also breaks
            # the cycle it usually closes (callback -> handler state -> this context), which
            # would otherwise leave ~17 objects per prompt for the cyclic garbage collector.
            ctx._cancel_callback = None
            self._inflight.pop(msg.id, None)
            if answered is not None:
                answered(ok)
        try:
            if frame is None:
                pass
            elif batch is None:
                await self._answer_quietly(frame)
            else:
                # kept with its batch's other answers (at most `max_batch` of them): the
                # slot is free for a request of a batch that could never finish otherwise
                await batch.add(frame)
        finally:
            # The slot is given back only now that the answer is written (or queued in the
            # bounded outbox): a peer that does not read keeps every slot taken, so the reader
            # stops taking its requests instead of making answers nobody reads (issue 20).
            self._free_slots += 1
            freed = self._slot_freed
            if freed is not None:
                self._slot_freed = None
                freed.set()
            self._answered_one()

    async def _answer_quietly(self, frame: bytes) -> None:
        try:
            await self._send(frame)  # shielded and bounded inside
        except ConnectionClosed:
            logger.debug("%s: answer dropped, the connection is closed", self._name)
