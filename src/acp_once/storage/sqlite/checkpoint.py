"""The SQLite store's checkpoints: copying the write-ahead log back into the database file,
in a thread of its own (`Checkpointer`), never on a caller's path."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from typing import TYPE_CHECKING, Final

from acp_once.support.sqlite import connect

if TYPE_CHECKING:
    from acp_once.support.sqlite import Connection, Synchronous

__all__ = [
    "CHECKPOINT_EVERY",
    "CHECKPOINT_LAG_LIMIT",
    "Checkpointer",
    "truncate_checkpoint",
]

_log = logging.getLogger(__name__)

# inline calls between two pokes; ~ SQLite's default of a checkpoint per 1000 WAL pages
CHECKPOINT_EVERY: Final = 250
# frames in the log after a passive checkpoint from which a restart is due...
_WAL_RESTART_PAGES: Final = 3000
# ... once this long after the previous one (each holds writers off for its fsyncs) ...
_RESTART_INTERVAL_S: Final = 0.4
# ... or at once from this many frames (64 MiB of log with 4 KiB pages)
_WAL_RESTART_CAP: Final = 16_000
# a passive checkpoint this long after the last poke, if no new one came
_IDLE_CHECKPOINT_S: Final = 0.2
# inline calls not yet checkpointed: then the calling store checkpoints and waits
CHECKPOINT_LAG_LIMIT: Final = 2 * CHECKPOINT_EVERY
# how long a restarting checkpoint waits for writers and readers
_CHECKPOINT_BUSY_MS: Final = 1000


def truncate_checkpoint(conn: Connection, *, lock: threading.Lock) -> None:
    # the lock: a checkpoint that finds another one running fails at once (SQLITE_BUSY,
    # no busy handler), so this one waits for the checkpoint thread's to finish instead
    with lock:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _restart_due(frames: int, since_last: float) -> bool:
    """Whether a log of `frames` frames after a passive checkpoint is restarted now, the last
    restart `since_last` seconds ago (see `Checkpointer`)."""
    if frames > _WAL_RESTART_CAP:
        return True
    return frames > _WAL_RESTART_PAGES and since_last >= _RESTART_INTERVAL_S


class Checkpointer:
    """Checkpoints the write-ahead log in a thread and on a connection of its own.

    Why not on the callers' path: with `synchronous=NORMAL` a checkpoint fsyncs the database
    file, which costs milliseconds on a disk; run every 250th inline call, it put ~30 us per
    turn (amortised) on the prompt path. Here `poke()` only sets an event. Should the thread
    fall behind by more than `CHECKPOINT_LAG_LIMIT` calls (a burst of writes with no pause),
    the calling store checkpoints on its own path once, so the log stays bounded anyway.

    Why a restart now and then: a passive checkpoint never blocks a writer, but under a steady
    write load it never finds the log fully copied either, and SQLite only rewinds the log
    when it is. When the log holds more than `_WAL_RESTART_PAGES` frames after a passive
    checkpoint, a RESTART checkpoint (which briefly holds writers off: an inline write that
    finds the database busy goes to the worker thread and waits there) copies the rest, so
    the next writer starts the log from its beginning (RESTART, not TRUNCATE: appending to
    an emptied file allocates blocks again, measurably slower than overwriting them).

    Why at most one restart every `_RESTART_INTERVAL_S` (unless the log passes
    `_WAL_RESTART_CAP` frames): a restart holds writers off for ~3 ms, mostly its two fsyncs,
    whatever the frames left to copy. At 20 busy WebSocket connections the log gains ~30,000
    frames a second: a restart every 3,000 frames held the writer off ~3% of the time, and
    spacing them out gave 1.4% and 3.9% more prompts a second (medians of two series of 8
    alternated pairs). A store writing fewer than `_WAL_RESTART_PAGES` frames in that time
    keeps its log that small.

    Why also one when the writes pause: a passive checkpoint that runs while nobody writes
    copies the whole log, and the next writer then rewinds it without any restart. So the
    thread runs one `_IDLE_CHECKPOINT_S` after the last poke when no other poke came (then
    waits for the next poke): a restart, which holds writers off for its fsync, is only
    needed in a burst of more than `_WAL_RESTART_PAGES` frames without such a pause. While it
    runs, the store sends calls to its worker thread, which waits on `restarting`.

    The thread is the store's: started by `open`, stopped and joined by `aclose`. A daemon
    thread, so a process that exits without closing the store is not held up by it.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._wake = threading.Event()
        self.lock = threading.Lock()  # held while a checkpoint runs, by this thread or a caller
        # held only while a RESTART checkpoint runs (it holds writers off): callers wait on it
        # instead of polling SQLite's write lock, whose busy handler sleeps 1, 2, 5, 10, ... ms
        self.restarting = threading.Lock()
        self._stopping = False
        self.checkpoints = 0  # completed, for the tests
        self._asked = 0
        self.done_for = 0  # the inline calls whose writes the last checkpoint covered
        self.checkpointed = threading.Event()  # set after each completed checkpoint
        self._thread = threading.Thread(
            target=self._run, name="acp-once-sqlite-checkpoint", daemon=True
        )
        self._thread.start()

    @classmethod
    def open(cls, path: str, synchronous: Synchronous) -> Checkpointer:
        """Open the checkpointing connection to `path` (auto-checkpoints off on it) and start
        the thread. Blocking.

        Raises:
            sqlite3.Error: the file cannot be opened.
        """
        conn = connect(path, synchronous, _CHECKPOINT_BUSY_MS)
        try:
            conn.execute("PRAGMA wal_autocheckpoint = 0")
        except BaseException:
            conn.close()
            raise
        return cls(conn)

    def poke(self, calls: int) -> None:
        """Ask for a checkpoint of what the first `calls` inline calls wrote; never blocks."""
        self._asked = calls
        self._wake.set()

    def close(self) -> None:
        """Stop the thread after the checkpoint in progress (if any); blocking, idempotent."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        idle_timeout: float | None = None
        last_restart = float("-inf")
        try:
            while True:
                poked = self._wake.wait(idle_timeout)
                self._wake.clear()
                if self._stopping:
                    return
                # after a poke, one more (passive) checkpoint when the writes pause
                idle_timeout = _IDLE_CHECKPOINT_S if poked else None
                asked = self._asked
                try:
                    with self.lock:
                        row: tuple[int, int, int] = self._conn.execute(
                            "PRAGMA wal_checkpoint(PASSIVE)"
                        ).fetchone()
                        if poked and _restart_due(row[1], time.monotonic() - last_restart):
                            with self.restarting:
                                self._conn.execute("PRAGMA wal_checkpoint(RESTART)")
                            last_restart = time.monotonic()
                    self.checkpoints += 1
                    if poked:
                        self.done_for = max(self.done_for, asked)
                    self.checkpointed.set()
                except sqlite3.Error as exc:
                    # not fatal: the log only grows until the next checkpoint succeeds
                    _log.debug("sqlite checkpoint failed: %s", exc)
        finally:
            self._conn.close()
