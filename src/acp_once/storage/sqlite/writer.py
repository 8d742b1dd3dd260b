"""The SQLite store's writer process: user messages and retained updates written by a process
of the store's own, so that SQLite's work runs beside the event loop instead of on it.

Why a process: a prompt's SQLite work (two INSERTs, and its share of the COMMIT that appends
the WAL frames) is ~40 µs, which on the event loop is time no connection is served. A thread
does not help: every SQLite call gives the GIL up and must win it back from a busy event loop
(which keeps it for `sys.getswitchinterval()`, 5 ms), several times a batch. A process has a
GIL of its own.

The protocol, over a Unix socket pair: the store sends frames (a 4-byte little-endian length,
then a pickle) each holding a list of `WriterOp`; the writer answers every frame, in order,
with a frame holding each write's outcome, after the COMMIT that holds it. Only the store's own
process holds the other end of the socket, so pickle is safe here. Writes:

* `("u", session_id, message_id, update, key, digest, now)`: a user message with its key;
  outcome `(True, (message_id, inserted, digest))`;
* `("a", session_id, entries, now)`: retained updates; outcome `(True, first seq)`;
* `("f", session_id)`: read the session's tail again at its next write (`Tail`);
* a failed write: `(False, ("missing", session_id))` or `(False, ("error", message))`.

Pipelined, so that the event loop's side costs one send and a share of one receive a batch:
the writes submitted while the event loop runs its ready tasks go out as one frame at the end
of that round (`loop.call_soon`), without waiting for the frames already out; a reader kept
for the store's lifetime settles the frames as their answers come back, and while frames are
out the event loop polls for them instead of sleeping (`acp_once.support.busypoll`). The
writer writes every frame it has received when it is free in one `BEGIN IMMEDIATE`
transaction, exactly as the store does in-process (`writes.write_together`, with the session
tails the writer keeps), so a busy writer makes bigger transactions rather than a queue.

The writer runs the checkpoints of what it writes in a thread of its own (`Checkpointer`, as
the store in-process does) and exits at end of file: when the store closes, or when the
store's process dies and the kernel closes its end, after the transaction in progress. A
frame the store sent and never heard back from stays as SQLite left it, committed or not,
never half; its callers are told that the outcome is unknown, and the next write starts a new
writer. The store's side needs the asyncio event loop (uvloop included).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import pickle
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.to_thread

from acp_once.storage.base import InsertOutcome, SessionMissing, StorageError
from acp_once.storage.grouping import GroupStats
from acp_once.storage.sqlite.checkpoint import (
    CHECKPOINT_EVERY,
    CHECKPOINT_LAG_LIMIT,
    Checkpointer,
    truncate_checkpoint,
)
from acp_once.storage.sqlite.writes import Tails, append_rows, insert_user_row, write_together
from acp_once.support.busypoll import DEFAULT_LIMIT_S, BusyPoll

if TYPE_CHECKING:
    from collections.abc import Callable

    from acp_once.support.sqlite import Connection, Synchronous

__all__ = ["WriterOp", "WriterProcess", "main"]

WriterOp = tuple[Any, ...]
"""One write sent to the writer (see the module docstring)."""

_HEADER: Final = struct.Struct("<I")
_READY: Final = b"ready"  # the writer's first frame: its connection is open
_START_TIMEOUT_S: Final = 30.0
# Beyond the busy timeout (a transaction's longest wait for another connection's lock): the
# time a frame may take to be answered. Past it the writer is taken for hung, killed, and the
# outcome of every frame out reported unknown.
_REPLY_MARGIN_S: Final = 30.0
_RECEIVE_BYTES: Final = 1 << 18
logger = logging.getLogger(__name__)
_UNKNOWN: Final = "the SQLite writer process failed: the write may or may not have been stored"


class _Slot:
    """One submitted write: its outcome once known, and the future its caller waits on."""

    __slots__ = ("done", "ok", "value", "waiter")

    def __init__(self) -> None:
        self.done = False
        self.ok = False
        self.value: Any = None
        self.waiter: asyncio.Future[None] | None = None


class _Resend:
    """The outcome of a write that never reached a writer: its caller submits it again."""


_RESEND: Final = _Resend()


def _settle(slot: _Slot, ok: bool, value: object) -> None:
    slot.ok = ok
    slot.value = value
    slot.done = True
    waiter = slot.waiter
    if waiter is not None and not waiter.done():  # not cancelled meanwhile
        waiter.set_result(None)


class _Frame:
    """A frame out: its writes, in order, and when its answer is due."""

    __slots__ = ("deadline", "slots")

    def __init__(self, slots: list[_Slot], deadline: float) -> None:
        self.slots = slots
        self.deadline = deadline


class WriterProcess:
    """The store's side of its writer process: starts it (again after a failure), sends it
    the writes submitted to it and settles them as its answers arrive, and stops it."""

    def __init__(
        self,
        path: str,
        synchronous: Synchronous,
        busy_timeout_ms: int,
        busy_poll_s: float = DEFAULT_LIMIT_S,
    ) -> None:
        """`busy_poll_s`: how long the event loop keeps polling for the answers, instead of
        sleeping, after it sent a frame, while frames are out (`acp_once.support.busypoll`);
        0: never."""
        self._path = path
        self._busy_poll_s = busy_poll_s
        self._poll: BusyPoll | None = None
        self._synchronous = synchronous
        self._busy_timeout_ms = busy_timeout_ms
        self._process: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._start_lock = anyio.Lock()
        self._queue: list[tuple[WriterOp, _Slot]] = []  # submitted, not yet sent
        self._flush_due = False
        self._out: collections.deque[_Frame] = collections.deque()  # sent, not yet answered
        self._unsent = bytearray()  # what the socket did not take yet
        self._received = bytearray()
        self._timer: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future[None] | None = None  # what `aclose` waits on
        self.stats = GroupStats()
        """Frames sent (`batches`) and writes; the writer may join frames in a transaction."""
        self.starts = 0
        """Writers started, for the tests."""

    @property
    def pid(self) -> int | None:
        """The running writer's process id, if one runs."""
        return None if self._process is None else self._process.pid

    async def start(self) -> None:
        """Start a writer if none runs.

        Raises:
            StorageError: the store is closed, the event loop is not asyncio's, or the writer
                did not start (its error, such as a database it cannot open, is on its
                standard error).
        """
        async with self._start_lock:
            if self._closed:
                raise StorageError("the store is closed")
            if self._sock is not None:
                return
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise StorageError(
                    "the SQLite writer process needs the asyncio event loop"
                ) from None
            process, sock = await anyio.to_thread.run_sync(self._spawn)
            self._loop, self._process, self._sock, self._fd = loop, process, sock, sock.fileno()
            self._received.clear()
            loop.add_reader(self._fd, self._on_readable)
            if self._poll is None or self._poll.loop is not loop:
                self._poll = BusyPoll(loop, lambda: bool(self._out), self._busy_poll_s)
            self.starts += 1

    def _spawn(self) -> tuple[subprocess.Popen[bytes], socket.socket]:
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from acp_once.storage.sqlite.writer import main; main()",
                    str(theirs.fileno()),
                    self._path,
                    self._synchronous,
                    str(self._busy_timeout_ms),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            ours.close()
            raise StorageError(f"{self._path}: cannot start the writer process: {exc}") from exc
        finally:
            theirs.close()
        ours.settimeout(_START_TIMEOUT_S)
        try:
            ready = _read_frame(ours)
        except OSError:
            ready = None
        if ready != _READY:
            ours.close()
            process.kill()
            process.wait()
            raise StorageError(f"{self._path}: the writer process did not start")
        ours.setblocking(False)
        return process, ours

    async def submit(self, op: WriterOp) -> Any:
        """Write `op` with the others submitted in this round of the event loop; return its
        result once the transaction holding it has committed.

        A cancelled caller waits for its write's outcome (for at most the busy timeout and a
        margin) and gets it; the cancellation is delivered at its next checkpoint (as anyio's
        worker threads do), so a stored write is never left unknown to its caller.

        Raises:
            SessionMissing: the write's session does not exist (nothing was written).
            StorageError: the store is closed or no writer could be started (nothing was
                written); or the writer failed, or took too long and was killed, after the
                write was sent: then it may or may not have been stored.
        """
        while True:
            if self._sock is None:
                await self.start()
            loop = self._loop
            assert loop is not None
            slot = _Slot()
            self._queue.append((op, slot))
            if not self._flush_due:
                self._flush_due = True
                loop.call_soon(self._flush)
            slot.waiter = loop.create_future()
            try:
                await slot.waiter
            except BaseException:
                # The frame holding it has gone out (its flush was scheduled before this
                # caller could be woken): learn its outcome first, bounded by the frame's
                # deadline; the cancellation is delivered at the caller's next checkpoint.
                with anyio.CancelScope(shield=True):
                    while not slot.done:
                        slot.waiter = loop.create_future()
                        await slot.waiter
                if slot.value is _RESEND:
                    raise  # it never reached a writer: nothing was written
            if slot.ok:
                return slot.value
            if slot.value is not _RESEND:
                raise slot.value

    def _flush(self) -> None:
        """Send the writes submitted in this round as one frame (a `call_soon` callback)."""
        self._flush_due = False
        batch, self._queue = self._queue, []
        if not batch:
            return
        sock, loop = self._sock, self._loop
        if sock is None or loop is None:  # the writer stopped since: nothing of these was sent
            for _, slot in batch:
                _settle(slot, False, _RESEND)
            return
        payload = pickle.dumps([op for op, _ in batch], protocol=pickle.HIGHEST_PROTOCOL)
        data = _HEADER.pack(len(payload)) + payload
        slots = [slot for _, slot in batch]
        if not self._unsent:
            try:
                sent = sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                # the writer's end is closed: this frame never reached it
                for slot in slots:
                    _settle(slot, False, _RESEND)
                self._lost()
                return
            if sent < len(data):
                self._unsent += data[sent:]
                loop.add_writer(self._fd, self._on_writable)
        else:
            self._unsent += data
        self._out.append(
            _Frame(slots, loop.time() + self._busy_timeout_ms / 1000 + _REPLY_MARGIN_S)
        )
        if self._timer is None:
            self._timer = loop.call_at(self._out[0].deadline, self._on_deadline)
        if self._poll is not None:
            self._poll.arm()
        stats = self.stats
        stats.batches += 1
        stats.writes += len(slots)
        if len(slots) > stats.largest:
            stats.largest = len(slots)

    def _on_writable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            sent = sock.send(self._unsent)
        except BlockingIOError:
            return
        except OSError:
            self._lost()
            return
        del self._unsent[:sent]
        if not self._unsent:
            assert self._loop is not None
            self._loop.remove_writer(self._fd)

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            chunk = sock.recv(_RECEIVE_BYTES)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._lost()
            return
        self._received += chunk
        out = self._out
        try:
            for body in _take_frames(self._received):
                outcomes: list[tuple[bool, Any]] = pickle.loads(body)
                for slot, (ok, value) in zip(out[0].slots, outcomes, strict=True):
                    if ok:
                        result = InsertOutcome(*value) if type(value) is tuple else value
                        _settle(slot, True, result)
                    else:
                        kind, detail = value
                        missing = kind == "missing"
                        _settle(slot, False, (SessionMissing if missing else StorageError)(detail))
                out.popleft()
        except Exception:  # an answer out of step with the frames out: trust none of it
            logger.exception("the SQLite writer process of %s answered out of step", self._path)
            self._lost()
            return
        if not out:
            self._on_drained()

    def _on_deadline(self) -> None:
        """The oldest frame's answer is due: kill a writer that is late, else wait for the
        next frame's deadline."""
        self._timer = None
        loop = self._loop
        if not self._out or loop is None:
            return
        if self._out[0].deadline <= loop.time():
            self._lost()
        else:
            self._timer = loop.call_at(self._out[0].deadline, self._on_deadline)

    def _lost(self) -> None:
        """The writer died, hung or closed its socket: kill it if it still runs, and tell the
        callers of every frame out that their writes may or may not have been stored."""
        self._discard()
        out, self._out = self._out, collections.deque()
        for frame in out:
            for slot in frame.slots:
                if not slot.done:
                    _settle(slot, False, StorageError(_UNKNOWN))
        self._on_drained()

    def _on_drained(self) -> None:
        if self._drained is not None and not self._drained.done() and not self._queue:
            self._drained.set_result(None)

    def _discard(self) -> None:
        """Forget the current writer, killing it if it still runs (it may be hung)."""
        sock, process, loop = self._sock, self._process, self._loop
        self._sock = self._process = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._unsent.clear()
        if sock is not None:
            if loop is not None:
                loop.remove_reader(self._fd)
                loop.remove_writer(self._fd)
            sock.close()
        if process is not None:
            if process.poll() is None:
                process.kill()
            process.wait()  # killed, or already exited: no wait to speak of

    async def aclose(self) -> None:
        """Stop the writer once every frame out is answered (each is bounded by its deadline);
        idempotent. The writer exits at the end of the socket; one that does not within 30 s
        is killed."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            loop = self._loop
            if loop is not None and (self._out or self._queue):
                self._drained = loop.create_future()
                await self._drained
            process = self._process
            self._process = None
            sock = self._sock
            self._sock = None
            if sock is not None:
                if loop is not None:
                    loop.remove_reader(self._fd)
                    loop.remove_writer(self._fd)
                sock.close()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if process is not None:
                await anyio.to_thread.run_sync(_reap, process)


def _reap(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(_START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- the writer process ------------------------------------------------------------------------


def _read_frame(sock: socket.socket) -> bytes | None:
    """The next frame's payload, waiting for it alone (the store reads the writer's first
    frame so, on a socket with a timeout, before it reads through `_on_readable`); None at
    end of file."""
    header = _read_exact(sock, _HEADER.size)
    return None if header is None else _read_exact(sock, _HEADER.unpack(header)[0])


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _take_frames(buffer: bytearray) -> list[bytes]:
    """The payloads of the complete frames at the start of `buffer`, taken out of it (both
    sides' reader: the store's and the writer's)."""
    frames: list[bytes] = []
    start = 0
    while len(buffer) - start >= _HEADER.size:
        end = start + _HEADER.size + _HEADER.unpack_from(buffer, start)[0]
        if end > len(buffer):
            break
        frames.append(bytes(buffer[start + _HEADER.size : end]))
        start = end
    del buffer[:start]
    return frames


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


class _Frames:
    """The frames arriving on the writer's socket (blocking reads)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()

    def next(self) -> list[bytes] | None:
        """Every complete frame received so far, waiting for one if there is none; None at
        end of file."""
        while not (frames := _take_frames(self._buffer)):
            chunk = self._sock.recv(_RECEIVE_BYTES)
            if not chunk:
                return None
            self._buffer += chunk
        # and whatever else has arrived meanwhile, without waiting
        with contextlib.suppress(BlockingIOError):
            while chunk := self._sock.recv(_RECEIVE_BYTES, socket.MSG_DONTWAIT):
                self._buffer += chunk
                frames += _take_frames(self._buffer)
        return frames


def serve(sock: socket.socket, path: str, synchronous: Synchronous, busy_timeout_ms: int) -> None:
    """Write the frames read from `sock` until its end (see the module docstring): every
    frame waiting when the writer is free, in one transaction.

    Raises:
        sqlite3.Error: the database cannot be opened.
        OSError: the socket failed.
    """
    from acp_once.storage.sqlite.schema import connect

    conn = connect(path, synchronous, busy_timeout_ms)
    try:
        conn.execute("PRAGMA wal_autocheckpoint = 0")  # the checkpoint thread's work
        checkpointer = Checkpointer.open(path, synchronous)
    except BaseException:
        conn.close()
        raise
    tails: Tails = {}
    written = 0
    incoming = _Frames(sock)
    try:
        _send_frame(sock, _READY)
        while (frames := incoming.next()) is not None:
            sizes: list[int] = []
            works: list[Callable[[Connection], object]] = []
            for frame in frames:
                ops: list[WriterOp] = pickle.loads(frame)
                sizes.append(len(ops))
                works += [_work(op, tails) for op in ops]
            with checkpointer.restarting:  # a RESTART checkpoint holds writers off: wait here
                pass
            try:
                outcomes = write_together(conn, works, path, tails)
            except sqlite3.Error as exc:
                failed = (False, ("error", f"{path}: {exc}"))
                wired: list[tuple[bool, object]] = [failed] * len(works)
            else:
                wired = [_wire(ok, value) for ok, value in outcomes]
            replies: list[bytes] = []
            start = 0
            for size in sizes:
                payload = pickle.dumps(wired[start : start + size], pickle.HIGHEST_PROTOCOL)
                replies += (_HEADER.pack(len(payload)), payload)
                start += size
            sock.sendall(b"".join(replies))
            written, before = written + len(works), written
            if written // CHECKPOINT_EVERY != before // CHECKPOINT_EVERY:
                if written - checkpointer.done_for > CHECKPOINT_LAG_LIMIT:
                    # the thread is not keeping up: checkpoint here once (see `Checkpointer`)
                    with contextlib.suppress(sqlite3.Error):
                        truncate_checkpoint(conn, lock=checkpointer.lock)
                    checkpointer.done_for = written
                checkpointer.poke(written)
    finally:
        checkpointer.close()
        conn.close()


def _wire(ok: bool, value: object) -> tuple[bool, object]:
    if not ok:
        if isinstance(value, SessionMissing):
            return (False, ("missing", value.session_id))
        return (False, ("error", str(value)))
    if isinstance(value, InsertOutcome):
        return (True, (value.message_id, value.inserted, value.prompt_digest))
    return (True, value)


def _work(op: WriterOp, tails: Tails) -> Callable[[Connection], object]:
    if op[0] == "u":
        _, session_id, message_id, update, key, digest, now = op
        return lambda conn: insert_user_row(
            conn, tails, session_id, message_id, update, key, digest, now
        )
    if op[0] == "f":  # the store changed or deleted the session: read its tail again
        _, session_id = op
        return lambda conn: tails.pop(session_id, None) and None
    _, session_id, entries, now = op
    return lambda conn: append_rows(conn, tails, session_id, entries, now)


def main() -> None:
    """The writer's entry point: `main()` with argv `FD PATH SYNCHRONOUS BUSY_TIMEOUT_MS`
    (what `WriterProcess` passes)."""
    fd, path, synchronous, busy = sys.argv[1:5]
    # The store decides when the writer stops (end of file, once the frames out are answered):
    # a Ctrl-C, a hang-up or a SIGTERM sent to the whole process group must not end it under
    # a transaction its store is still waiting on.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    sock = socket.socket(fileno=int(fd))
    sock.setblocking(True)
    try:
        serve(sock, path, synchronous, int(busy))  # type: ignore[arg-type]
    except (sqlite3.Error, OSError) as exc:
        print(f"acp-once: the SQLite writer of {path} stopped: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        sock.close()
