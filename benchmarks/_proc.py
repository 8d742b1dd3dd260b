"""What /proc says of a process, for the benchmarks' CPU figures (Linux only)."""

from __future__ import annotations

import os
from pathlib import Path


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time process `pid` has used so far, all threads (None off Linux)."""
    return _stat_cpu_seconds(f"/proc/{pid}/stat")


def main_thread_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process `pid`'s main thread alone (None off Linux): the
    event loop's thread of a Python server, the JavaScript thread of a Node one."""
    return _stat_cpu_seconds(f"/proc/{pid}/task/{pid}/stat")


def _stat_cpu_seconds(path: str) -> float | None:
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
