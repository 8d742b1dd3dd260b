"""The SQLite store's writer process: user messages and retained updates written by a process
of the store's own, so that SQLite's work runs beside the event loop instead of on it.

Why a process: a prompt's SQLite work (two INSERTs, and its share of the COMMIT that appends
the WAL frames) is ~40 µs, which on the event loop is time no connection is served. A thread
does not help: every SQLite call gives the GIL up and must win it back from a busy event loop
(which keeps it for `sys.getswitchinterval()`, 5 ms), several times a batch. A process has a
GIL of its own; the event loop only sends a batch and reads its outcomes, one message each way.

The protocol, over a Unix socket pair, one batch in flight at a time (the store's group commit
sees to that): the store sends a frame (a 4-byte little-endian length, then a pickle) holding
a list of `WriterOp`; the writer writes them in one `BEGIN IMMEDIATE` transaction, exactly as
the store does in-process (`store._write_together`, with the session tails the writer keeps),
and after the COMMIT answers with a frame holding each write's outcome, in order. Only the
store's own process holds the other end of the socket, so pickle is safe here. Writes:

* `("u", session_id, message_id, update, key, digest, now)`: a user message with its key;
  outcome `(True, (message_id, inserted, digest))`;
* `("a", session_id, entries, now)`: retained updates; outcome `(True, first seq)`;
* a failed write: `(False, ("missing", session_id))` or `(False, ("error", message))`.

The writer runs the checkpoints of what it writes in a thread of its own (`Checkpointer`, as
the store in-process does) and exits at end of file: when the store closes, or when the
store's process dies and the kernel closes its end, after the batch in progress. A batch the
store sent and never heard back from stays as SQLite left it, committed or not, never half;
its callers are told that the outcome is unknown, and the next write starts a new writer.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import sqlite3
import struct
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.to_thread

from acp_once.storage.base import InsertOutcome, SessionMissing, StorageError
from acp_once.storage.sqlite.checkpoint import (
    CHECKPOINT_EVERY,
    CHECKPOINT_LAG_LIMIT,
    Checkpointer,
    truncate_checkpoint,
)
from acp_once.storage.sqlite.writes import Tails, append_rows, insert_user_row, write_together

if TYPE_CHECKING:
    from collections.abc import Callable

    from acp_once.support.sqlite import Connection, Synchronous

__all__ = ["WriterOp", "WriterProcess", "main"]

WriterOp = tuple[Any, ...]
"""One write sent to the writer (see the module docstring)."""

_HEADER: Final = struct.Struct("<I")
_READY: Final = b"ready"  # the writer's first frame: its connection is open
_START_TIMEOUT_S: Final = 30.0
# Beyond the busy timeout (a batch's longest wait for another connection's lock): the time a
# batch may take to write. Past it the writer is taken for hung, killed, and the batch's
# outcome reported unknown.
_REPLY_MARGIN_S: Final = 30.0
_UNKNOWN: Final = "the SQLite writer process failed: the write may or may not have been stored"


class WriterProcess:
    """The store's side of its writer process: starts it (again after a failure), sends it
    batches and stops it. One batch at a time: the caller serialises its writes."""

    def __init__(self, path: str, synchronous: Synchronous, busy_timeout_ms: int) -> None:
        self._path = path
        self._synchronous = synchronous
        self._busy_timeout_ms = busy_timeout_ms
        self._process: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._closed = False
        self._in_flight = False
        self._landed: anyio.Event | None = None  # what `aclose` waits on while a batch is out
        self.starts = 0
        """Writers started, for the tests."""

    @property
    def pid(self) -> int | None:
        """The running writer's process id, if one runs."""
        return None if self._process is None else self._process.pid

    async def start(self) -> None:
        """Start a writer if none runs.

        Raises:
            StorageError: the store is closed, or the writer did not start (its error, such
                as a database it cannot open, is on its standard error).
        """
        if self._closed:
            raise StorageError("the store is closed")
        if self._process is not None and self._process.poll() is None:
            return
        self._discard()
        self._process, self._sock = await anyio.to_thread.run_sync(self._spawn)
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

    async def write(self, ops: list[WriterOp]) -> list[tuple[bool, object]]:
        """Write `ops` in one transaction; return each one's outcome, `(True, result)` or
        `(False, StorageError)`, in order.

        Once the batch is sent its outcome is awaited even if the caller is cancelled (the
        cancellation is delivered afterwards), for at most the busy timeout and a margin.

        Raises:
            StorageError: the store is closed or no writer could be started (nothing was
                written); or the writer failed, or took too long and was killed, after the
                batch was sent: then the batch may or may not have been stored.
        """
        await self.start()
        sock = self._sock
        assert sock is not None
        payload = pickle.dumps(ops, protocol=pickle.HIGHEST_PROTOCOL)
        data = memoryview(_HEADER.pack(len(payload)) + payload)
        self._in_flight = True
        body: bytes | None = None
        try:
            with anyio.CancelScope(shield=True) as scope:
                scope.deadline = (
                    anyio.current_time() + self._busy_timeout_ms / 1000 + _REPLY_MARGIN_S
                )
                while data:
                    try:
                        data = data[sock.send(data) :]
                    except BlockingIOError:
                        await anyio.wait_writable(sock)
                size = _HEADER.unpack(await _receive(sock, _HEADER.size))[0]
                body = await _receive(sock, size)
        except OSError as exc:
            self._discard()
            raise StorageError(_UNKNOWN) from exc
        finally:
            self._in_flight = False
            if self._landed is not None:
                self._landed.set()
        if body is None:  # the deadline passed
            self._discard()
            raise StorageError(_UNKNOWN)
        wired: list[tuple[bool, Any]] = pickle.loads(body)
        return [(True, _result(value)) if ok else (False, _error(value)) for ok, value in wired]

    def _discard(self) -> None:
        """Forget the current writer, killing it if it still runs (it may be hung)."""
        sock, process = self._sock, self._process
        self._sock = self._process = None
        if sock is not None:
            sock.close()
        if process is not None:
            if process.poll() is None:
                process.kill()
            process.wait()  # killed, or already exited: no wait to speak of

    async def aclose(self) -> None:
        """Stop the writer after the batch in flight (if any); idempotent. The writer exits
        at the end of the socket; one that does not within 30 s is killed."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._in_flight:
                self._landed = anyio.Event()
                await self._landed.wait()  # bounded: `write` bounds a batch
            sock, process = self._sock, self._process
            self._sock = self._process = None
            if sock is not None:
                sock.close()
            if process is not None:
                await anyio.to_thread.run_sync(_reap, process)


def _reap(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(_START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def _receive(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except BlockingIOError:
            await anyio.wait_readable(sock)
            continue
        if not chunk:
            raise ConnectionResetError("the writer process closed its socket")
        data += chunk
    return bytes(data)


def _result(value: object) -> object:
    if isinstance(value, tuple):
        return InsertOutcome(*value)
    return value


def _error(value: tuple[str, str]) -> StorageError:
    kind, detail = value
    return SessionMissing(detail) if kind == "missing" else StorageError(detail)


# -- the writer process ------------------------------------------------------------------------


def _read_frame(sock: socket.socket) -> bytes | None:
    """The next frame's payload (blocking); None at end of file."""
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


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def serve(sock: socket.socket, path: str, synchronous: Synchronous, busy_timeout_ms: int) -> None:
    """Write the batches read from `sock` until its end (see the module docstring).

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
    try:
        _send_frame(sock, _READY)
        while (frame := _read_frame(sock)) is not None:
            ops: list[WriterOp] = pickle.loads(frame)
            works = [_work(op, tails) for op in ops]
            with checkpointer.restarting:  # a RESTART checkpoint holds writers off: wait here
                pass
            try:
                outcomes = write_together(conn, works, path, tails)
            except sqlite3.Error as exc:
                reply: list[tuple[bool, object]] = [(False, ("error", f"{path}: {exc}"))] * len(ops)
            else:
                reply = [_wire(ok, value) for ok, value in outcomes]
            _send_frame(sock, pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
            written, before = written + len(ops), written
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
    sock = socket.socket(fileno=int(fd))
    sock.setblocking(True)
    try:
        serve(sock, path, synchronous, int(busy))  # type: ignore[arg-type]
    except (sqlite3.Error, OSError) as exc:
        print(f"acp-once: the SQLite writer of {path} stopped: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        sock.close()
