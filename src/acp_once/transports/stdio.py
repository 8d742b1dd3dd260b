"""stdio: newline-delimited JSON over pipes (ACP's baseline transport, R67); a line is one
message or one batch array (D21), moved as it is.

- `stdio_frames()`: the agent side, on the process's own stdin and stdout. Nothing but ACP
  frames is ever written to stdout; logs belong on stderr.
- `spawn(command)`: the client side, starting the agent as a subprocess. Leaving the block shuts
  it down cleanly: close its stdin, wait, then terminate, then kill, each step time-boxed.

Both give a `FrameStream` (see `acp_once.rpc.streams`) on pipes of their own, written with
non-blocking writes, so the engine can write a frame the peer has room for without waiting
(`send_nowait`, its fast path). Frames above `max_frame` bytes are reported as `OversizedFrame`,
never held in memory, and the stream lives on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import stat
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream, Process

from acp_once.protocol.framing import DEFAULT_MAX_FRAME, FrameEvent, LineFramer

__all__ = [
    "AgentProcess",
    "ByteStreamFrames",
    "FdReceiveStream",
    "FdSendStream",
    "spawn",
    "stdio_frames",
]

_READ_SIZE = 256 * 1024
_PAUSE_AT = 1024 * 1024
"""Bytes read ahead of the receiver before `FdReceiveStream` stops reading the pipe."""
_RESUME_AT = 256 * 1024


class ByteStreamFrames:
    """A `FrameStream` over a pair of byte streams, framing with newlines."""

    def __init__(
        self,
        receive: ByteReceiveStream,
        send: ByteSendStream,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        writable_after_eof: bool = False,
    ) -> None:
        self._rx = receive
        self._tx = send
        self._framer = LineFramer(max_frame)
        self._events: collections.deque[FrameEvent] = collections.deque()
        self._eof = False
        # True until a read brings exactly one frame: see `NowaitFrameStream.burst`
        self.burst = True
        self.writable_after_eof = writable_after_eof
        """The peer may still read after the end of what it sends (see `FrameStream`)."""

    async def receive(self) -> FrameEvent:
        while not self._events:
            if self._eof:
                raise anyio.EndOfStream
            try:
                chunk = await self._rx.receive(_READ_SIZE)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                self._eof = True
                self._events.extend(self._framer.close())
                continue
            events = self._framer.feed(chunk)
            if events:  # a chunk that only continues a long frame says nothing
                self.burst = len(events) > 1
                self._events.extend(events)
        return self._events.popleft()

    async def send(self, frame: bytes) -> None:
        await self._tx.send(frame + b"\n")

    def send_nowait(self, frame: bytes) -> memoryview | None:
        """Write `frame` and its newline as far as the peer takes them now, without waiting.

        Returns None when all of it was written, else the unwritten rest (possibly all of it),
        which must go through `send_rest` before any other frame.

        Raises:
            anyio.BrokenResourceError: the peer is gone.
            anyio.ClosedResourceError: the stream was closed.
        """
        data = frame + b"\n"
        tx = self._tx
        written = tx.send_nowait(data) if isinstance(tx, FdSendStream) else 0
        if written == len(data):
            return None
        return memoryview(data)[written:]

    def send_frames_nowait(self, frames: Sequence[bytes]) -> memoryview | None:
        """`send_nowait` for several frames: one line each, in one write."""
        return self.send_nowait(b"\n".join(frames))

    async def send_rest(self, rest: memoryview) -> None:
        """Write the rest of a frame that `send_nowait` began, waiting for room as `send` does."""
        if isinstance(self._tx, FdSendStream):
            await self._tx.send(rest)
        else:
            await self._tx.send(bytes(rest))

    async def aclose(self) -> None:
        with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self._tx.aclose()
        with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self._rx.aclose()


def _pollable(fd: int) -> bool:
    """True for a pipe or a socket, which is then made non-blocking; False for anything else
    (a regular file, a terminal), which is read and written in a worker thread."""
    mode = os.fstat(fd).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        os.set_blocking(fd, False)
        return True
    return False


class FdReceiveStream(ByteReceiveStream):
    """Reads a file descriptor: non-blocking for pipes and sockets, a worker thread for anything
    else (a regular file, a terminal).

    On asyncio (and uvloop) a pipe or socket is watched by one reader callback for the stream's
    whole life, which reads each chunk as soon as it arrives and wakes the receiving task: one
    read per arrival, no failed read and no epoll registration per call, as a readiness wait
    per call would cost. At most `_PAUSE_AT` bytes wait unread in the stream; beyond that the
    callback stops watching until the receiver catches up, so a fast writer is slowed by the
    pipe, never buffered without bound. Elsewhere (trio) each call waits for readiness.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._poll = _pollable(fd)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._eof = False
        self._error: OSError | None = None
        self._watching = False
        self._waiter: asyncio.Future[None] | None = None
        # Reads land here and are copied out at their size: `os.read(fd, 256 KiB)` allocates
        # 256 KiB, which glibc maps afresh, shrinks and unmaps for every read (three system
        # calls and a page fault per incoming frame, measured with strace).
        self._buffer = bytearray(_READ_SIZE) if self._poll else bytearray()
        self._view = memoryview(self._buffer)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._closed:
            raise anyio.ClosedResourceError
        if not self._poll:
            data = await anyio.to_thread.run_sync(
                os.read, self._fd, max_bytes, abandon_on_cancel=True
            )
            if not data:
                raise anyio.EndOfStream
            return data
        loop = self._loop
        if loop is None:
            try:
                loop = self._loop = asyncio.get_running_loop()
            except RuntimeError:  # not asyncio: wait for readiness at each call
                return await self._receive_polling(max_bytes)
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                raise anyio.EndOfStream
            if not self._watching:
                self._watch(loop)
            waiter = self._waiter = loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
            if self._closed:
                raise anyio.ClosedResourceError
        chunk = self._chunks.popleft()
        if len(chunk) > max_bytes:
            self._chunks.appendleft(chunk[max_bytes:])
            chunk = chunk[:max_bytes]
        self._buffered -= len(chunk)
        if not self._watching and not self._eof and self._buffered <= _RESUME_AT:
            self._watch(loop)
        return chunk

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self._fd, self._readable)
        self._watching = True

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            assert self._loop is not None
            self._loop.remove_reader(self._fd)

    def _readable(self) -> None:
        # the loop's reader callback: take what arrived, wake the receiver
        try:
            data = bytes(self._view[: os.readv(self._fd, (self._buffer,))])
        except BlockingIOError:
            return
        except OSError as exc:
            self._error = exc
            data = b""
        if data:
            self._chunks.append(data)
            self._buffered += len(data)
            if self._buffered >= _PAUSE_AT:
                self._unwatch()  # the pipe holds the rest until the receiver catches up
        else:
            self._eof = True
            self._unwatch()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _receive_polling(self, max_bytes: int) -> bytes:
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                data = os.read(self._fd, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self._fd)
                continue
            if not data:
                raise anyio.EndOfStream
            return data

    async def aclose(self) -> None:
        self._closed = True
        self._unwatch()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class FdSendStream(ByteSendStream):
    """Writes a file descriptor, waiting for room when a pipe is full (backpressure)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._poll = _pollable(fd)
        self._closed = False

    def send_nowait(self, item: bytes) -> int:
        """Write what the descriptor takes at once, without waiting; return how many bytes.

        0 when it is full, and always 0 for a descriptor that cannot be polled (its writes go
        through a thread in `send`).

        Raises:
            anyio.BrokenResourceError: the reader is gone.
            anyio.ClosedResourceError: the stream was closed.
        """
        if self._closed:
            raise anyio.ClosedResourceError
        if not self._poll:
            return 0
        try:
            return os.write(self._fd, item)
        except BlockingIOError:
            return 0
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise anyio.BrokenResourceError from exc

    async def send(self, item: bytes | memoryview) -> None:
        view = memoryview(item)
        while view:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                if self._poll:
                    written = os.write(self._fd, view)
                else:
                    written = await anyio.to_thread.run_sync(os.write, self._fd, view)
            except BlockingIOError:
                await anyio.wait_writable(self._fd)
                continue
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise anyio.BrokenResourceError from exc
            view = view[written:]

    async def aclose(self) -> None:
        self._closed = True


def stdio_frames(max_frame: int = DEFAULT_MAX_FRAME) -> ByteStreamFrames:
    """The agent side: frames over this process's own stdin and stdout.

    Python's `sys.stdout` is pointed at stderr afterwards, so a stray `print()` cannot corrupt
    the protocol stream.
    """
    stdin_fd = sys.stdin.fileno()
    stdout_fd = os.dup(sys.stdout.fileno())
    sys.stdout.flush()
    # anything printed from now on goes to stderr, not into the ACP stream
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    # a client that closes our stdin has sent everything, and still reads our stdout
    return ByteStreamFrames(
        FdReceiveStream(stdin_fd),
        FdSendStream(stdout_fd),
        max_frame=max_frame,
        writable_after_eof=True,
    )


@dataclass(slots=True)
class AgentProcess:
    """A spawned agent: its frame stream and its process."""

    frames: ByteStreamFrames
    process: Process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode


@contextlib.asynccontextmanager
async def spawn(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
    stderr: int | None = None,
    shutdown_timeout: float = 5.0,
    process_group: bool = False,
) -> AsyncIterator[AgentProcess]:
    """Start `command` with pipes on stdin/stdout and yield its frame stream.

    `stderr` None lets the agent's logs through to ours; pass `subprocess.DEVNULL` to drop them.
    On exit: close the agent's stdin (its cue to finish), wait up to `shutdown_timeout`, then
    SIGTERM, wait again, then SIGKILL.

    With `process_group`, the agent is started in a new session, so a new process group it
    leads, and the signals go to the whole group; once the agent has exited, whatever is left
    of its group is SIGKILLed.

    Raises:
        OSError: the command could not be started.
    """
    # Our own pipes rather than the event loop's pipe transports: the frame stream then
    # writes with plain non-blocking writes, so the engine can write a frame without waiting
    # (see `NowaitFrameStream`). os.pipe() descriptors are not inherited by the child.
    to_child, ours_w = os.pipe()
    ours_r, from_child = os.pipe()
    try:
        process = await anyio.open_process(
            list(command),
            stdin=to_child,
            stdout=from_child,
            stderr=stderr,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=process_group,
        )
    except BaseException:
        for fd in (ours_w, ours_r):
            os.close(fd)
        raise
    finally:
        os.close(to_child)
        os.close(from_child)
    tx = FdSendStream(ours_w)
    frames = ByteStreamFrames(FdReceiveStream(ours_r), tx, max_frame=max_frame)
    try:
        yield AgentProcess(frames, process)
    finally:
        with anyio.CancelScope(shield=True):
            await _shutdown(process, tx, ours_w, ours_r, shutdown_timeout, process_group)


async def _shutdown(
    process: Process,
    tx: FdSendStream,
    write_fd: int,
    read_fd: int,
    timeout: float,
    group: bool,
) -> None:
    await tx.aclose()
    os.close(write_fd)  # the agent's stdin ends: its cue to finish
    try:
        await _stop(process, timeout, group)
    finally:
        os.close(read_fd)
        if group:
            # what the agent started and left behind; its group id cannot have been reused
            # while any of them lives
            _signal(process, signal.SIGKILL, group)


def _signal(process: Process, signum: signal.Signals, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)


async def _stop(process: Process, timeout: float, group: bool) -> None:
    for step in ("wait", "terminate", "kill"):
        if step == "terminate":
            _signal(process, signal.SIGTERM, group)
        elif step == "kill":
            _signal(process, signal.SIGKILL, group)
        with anyio.move_on_after(timeout):
            await process.wait()
        if process.returncode is not None:
            break
