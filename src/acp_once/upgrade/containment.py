"""Keeping the v1 child, and everything it starts, inside the runtime's life.

A v1 agent may ignore the end of its stdin (Zed's codex-acp does) and start commands of its
own. Three things make sure none of it outlives the runtime:

- **its own process group**: the child is started through `launcher_command`, a small Python
  launcher started in a new session (so a new process group, led by the launcher); the agent
  runs in that group, as do the commands it starts (unless they leave it). Stopping the child
  signals the whole group: stdin closed, then SIGTERM, then SIGKILL (`acp_once.transports.stdio
  .spawn` with `process_group=True`).
- **the parent's death**: the launcher asks the kernel (Linux `prctl(PR_SET_PDEATHSIG)`) for
  SIGHUP when the runtime dies, even by SIGKILL, and then SIGKILLs its whole group. It checks
  its parent is still the runtime after asking, so a runtime that died in between is noticed.
- **a group file per store** (`GroupFile`): the runtime records the group of its current child
  (the process group id and a random token the child's environment carries) in a file it holds
  locked. A runtime started on the same store while no other holds the lock kills the recorded
  group, if any of its processes still carries the token, and waits (bounded) for it to be gone
  before it starts its own child. Where the kernel cannot signal a parent's death, this still
  keeps a restarted runtime from running a second child beside the first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "GROUP_TOKEN_VARIABLE",
    "GroupFile",
    "group_file_for",
    "group_members",
    "launcher_command",
]

logger = logging.getLogger("acp_once.upgrade")

GROUP_TOKEN_VARIABLE = "ACP_ONCE_V1_CHILD_GROUP"
"""The environment variable that marks the processes of one child's group (a random token)."""

# The launcher: run with `python -I -S -c`, so it starts in a few milliseconds and imports
# nothing of ours. argv: the runtime's pid, then the agent's command line.
_LAUNCHER = r"""
import os, signal, sys
parent = int(sys.argv[1])
def kill_group(*_):
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGHUP, kill_group)
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGHUP), 0, 0, 0)  # PR_SET_PDEATHSIG
except (ImportError, OSError, AttributeError):
    pass
if os.getppid() != parent:
    kill_group()
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group got it too: wait for the agent
defaults = [signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ]
try:
    pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ, setsigdef=defaults)
except OSError as exc:
    sys.stderr.write(f"the v1 agent could not be started: {exc}\n")
    os._exit(127)
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
os.dup2(null, 1)
while True:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        os._exit(1)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)
"""


def launcher_command(command: Sequence[str]) -> list[str]:
    """`command` run through the launcher (see the module docstring), as a child of this
    process, which must start it in a new session (`start_new_session=True`)."""
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), *command]


def group_members(pgid: int, token: str | None = None) -> list[int]:
    """The pids of the live (not zombie) processes in the process group `pgid`; with `token`,
    only those whose environment carries it in `GROUP_TOKEN_VARIABLE`. Read from /proc; where
    there is none, the group itself, if it exists (the token unchecked)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    marker = f"{GROUP_TOKEN_VARIABLE}={token}".encode() if token is not None else None
    members: list[int] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "stat").read_bytes()
            # after the command name, which may hold spaces and parentheses
            fields = status[status.rindex(b")") + 2 :].split()
            if fields[0] in (b"Z", b"X") or int(fields[2]) != pgid:
                continue
            if marker is not None and marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        members.append(int(entry.name))
    return members


def group_file_for(store_url: str) -> Path:
    """The group file of the runtimes on the store `store_url` (one per store and user; a
    SQLite path is made absolute first)."""
    if store_url.startswith("sqlite:"):
        store_url = "sqlite:" + str(Path(store_url.removeprefix("sqlite:")).resolve())
    digest = hashlib.sha256(store_url.encode()).hexdigest()[:24]
    directory = Path(tempfile.gettempdir()) / f"acp-once-{os.getuid()}"
    return directory / f"upgrade-{digest}.group"


class GroupFile:
    """The record of the current child's process group, for the next runtime on the same store
    (see the module docstring).

    Args:
        path: the file (its directory is created, private to the user).
        gone_timeout: seconds allowed for a recorded group to be gone after its SIGKILL.
    """

    def __init__(self, path: Path, *, gone_timeout: float = 5.0) -> None:
        self.path = path
        self.gone_timeout = gone_timeout
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Lock the file and kill the group it records, if it still runs. Blocks for at most
        `gone_timeout` seconds. False when another live runtime holds the lock, or the file's
        directory is not private to this user (nothing is killed then, and nothing will be
        recorded).

        Raises:
            OSError: the file cannot be created or opened.
        """
        directory = self.path.parent
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            # another user's directory (or a link to one): nothing of ours goes there
            logger.warning("%s is not a private directory: no group file is kept", directory)
            return False
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            logger.warning(
                "another runtime on the same store is running: its v1 agent is left alone"
            )
            return False
        self._fd = fd
        recorded = os.pread(fd, 256, 0).decode(errors="replace").split()
        if len(recorded) == 2 and recorded[0].isdigit():
            self._kill(int(recorded[0]), recorded[1])
        self._write(b"")
        return True

    def record(self, pgid: int, token: str) -> None:
        """Record the group of the child just started (nothing when the lock is not ours)."""
        if self._fd is not None:
            self._write(f"{pgid} {token}\n".encode())

    def clear(self) -> None:
        """The recorded group is stopped: record none."""
        if self._fd is not None:
            self._write(b"")

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # the lock goes with it

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def _kill(self, pgid: int, token: str) -> None:
        """SIGKILL the group `pgid` if a process of it carries `token` (a reused pgid is some
        other program's), and wait for its processes to be gone.

        A process still inside its exec shows no environment in /proc, so no token: a launcher
        whose runtime died, checked here before its exec ended, is not killed. It need not be:
        once it runs, its parent check finds that runtime gone and it kills its group, before
        it starts the agent."""
        if not group_members(pgid, token):
            return
        logger.warning("killing the v1 agent a previous runtime left running (group %d)", pgid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + self.gone_timeout
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the kernel's process table: there is nothing to wait on
        if group_members(pgid):
            logger.warning("the previous v1 agent (group %d) is still not gone", pgid)
