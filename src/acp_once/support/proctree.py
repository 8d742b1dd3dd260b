"""A process and the processes it started, from `/proc` (Linux; elsewhere none are found).

The fault injectors of the demo and the benchmarks kill a whole upgraded agent as a crashed
host would: the runtime and the v1 agent it runs, with whatever that agent runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

__all__ = ["descendants", "kill_tree", "with_environment"]


def descendants(pid: int) -> list[int]:
    """The processes started by `pid`, by its children and so on (read from `/proc`: empty
    where there is none), parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def kill_tree(pid: int, *, include_root: bool = True) -> int:
    """SIGKILL `pid` (unless `include_root` is False) and every process it started; returns
    how many were signalled. Descendants are found first, while the parent links still hold."""
    pids = descendants(pid)
    if include_root:
        pids.insert(0, pid)
    killed = 0
    for target in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, signal.SIGKILL)
            killed += 1
    return killed


def with_environment(name: str, value: str) -> list[int]:
    """The processes (readable by us) whose environment holds `name=value`: whatever a run
    started, marked so, even those whose parent died before them."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone, or not ours
        if wanted in environ:
            found.append(int(entry.name))
    return found
