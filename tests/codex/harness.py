"""Codex behind the upgrade runtime, for the tests of `tests/codex/` and the Codex benchmarks:
the install, a Codex home that talks to the scripted model only, and the processes to stop.

Codex (codex-acp 0.16.0) does not exit when its stdin closes. The upgrade runtime keeps it in a
process group of its own that is killed when the runtime stops or dies; `codex_pids` finds the
Codex processes of one test or run (by their `CODEX_HOME`, unique to it, and by being another
program than this Python: the runtime has the same `CODEX_HOME` in its environment, to pass
on), `wait_gone` waits for them to exit, and `stop_codex` ends any left over.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio

from tests.codex.model_server import codex_home

__all__ = [
    "INSTALL_SCRIPT",
    "Missing",
    "codex_env",
    "codex_pids",
    "install",
    "stop_codex",
    "wait_gone",
]

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = ROOT / "scripts" / "codex.py"


class Missing(Exception):
    """node or npm is not installed, so codex-acp cannot be."""


def install() -> str:
    """The path of the codex-acp executable, installed into `.tools/` by `scripts/codex.py`
    on first use.

    Raises:
        Missing: node or npm is absent.
        RuntimeError: the install failed (npm's output in the message).
    """
    done = subprocess.run(
        [sys.executable, str(INSTALL_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode == 2:
        raise Missing(done.stderr.strip())
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return done.stdout.strip()


def codex_env(home: Path, base_url: str, *, approval_policy: str = "never") -> dict[str, str]:
    """This process's environment plus a fresh Codex home in `home` that uses the model at
    `base_url` (see `codex_home`)."""
    return {**os.environ, **codex_home(home, base_url, approval_policy=approval_policy)}


def codex_pids(home: Path) -> list[int]:
    """The processes (Codex and what it runs) whose `CODEX_HOME` is `home`, other than Python
    interpreters (the runtime that started Codex carries the same variable)."""
    marker = f"CODEX_HOME={home}".encode()
    ours = os.path.realpath(sys.executable)
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            exe = os.path.realpath(entry / "exe")
        except OSError:
            continue  # gone, or not ours to read
        if marker in environ and exe != ours and "python" not in Path(exe).name:
            pids.append(int(entry.name))
    return pids


async def stop_codex(home: Path, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
    """Send `sig` to every process of `codex_pids(home)` and wait until each has exited.

    Raises:
        TimeoutError: one was still running after `timeout` seconds.
    """
    await wait_gone(codex_pids(home), timeout, sig)


async def wait_gone(pids: list[int], timeout: float, sig: int | None = None) -> None:
    """Wait until every process of `pids` has exited, sending each `sig` first if given.

    Raises:
        TimeoutError: one was still running after `timeout` seconds.
    """
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
            if sig is not None:
                os.kill(pid, sig)
        except ProcessLookupError:
            continue
    try:
        with anyio.fail_after(timeout):
            for fd in fds:
                await anyio.wait_readable(fd)  # a pidfd turns readable when its process exits
    finally:
        for fd in fds:
            os.close(fd)
