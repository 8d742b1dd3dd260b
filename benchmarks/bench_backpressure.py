"""The agent's memory when a peer sends many requests and never reads the answers.

Starts `acp-once agent --store memory` over real pipes, initializes it, then writes N
`session/list` requests without reading stdout, until all are written or the agent stops taking
them (its stdin pipe stays full for `--stall` seconds). It prints the agent's resident memory
before and at that point (and its peak, VmHWM), how many requests the agent took, then reads
every answer and checks that each request got exactly one, with its id.

    python3 dev.py run python benchmarks/bench_backpressure.py [N] [--stall SECONDS]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import orjson

INITIALIZE = (
    b'{"jsonrpc":"2.0","id":"init","method":"initialize",'
    b'"params":{"protocolVersion":2,"info":{"name":"bench","version":"1"}}}\n'
)


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


def _mb(kb: int) -> str:
    return f"{kb / 1024:.0f} MB"


def _read_line(fd: int, buffer: bytearray, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    while b"\n" not in buffer:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError("no answer")
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise EOFError("the agent closed stdout")
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", nargs="?", type=int, default=60_000, help="requests (60,000)")
    parser.add_argument(
        "--stall", type=float, default=3.0, help="seconds of a full pipe that count as stopped"
    )
    args = parser.parse_args()

    agent = subprocess.Popen(
        [sys.executable, "-m", "acp_once", "agent", "--store", "memory"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert agent.stdin is not None and agent.stdout is not None
    wfd, rfd = agent.stdin.fileno(), agent.stdout.fileno()
    pending = bytearray()
    try:
        os.write(wfd, INITIALIZE)
        assert orjson.loads(_read_line(rfd, pending, 30))["id"] == "init"
        before = _status_kb(agent.pid, "VmRSS")

        data = b"".join(
            b'{"jsonrpc":"2.0","id":%d,"method":"session/list","params":{}}\n' % i
            for i in range(args.n)
        )
        os.set_blocking(wfd, False)
        view = memoryview(data)
        started = time.monotonic()
        while view:
            if not select.select([], [wfd], [], args.stall)[1]:
                break  # the pipe stayed full: the agent stopped reading
            try:
                view = view[os.write(wfd, view) :]
            except BlockingIOError:
                continue
        written = len(data) - len(view)
        took = time.monotonic() - started
        taken = data[:written].count(b"\n")
        at_stop = _status_kb(agent.pid, "VmRSS")
        peak = _status_kb(agent.pid, "VmHWM")
        stopped = "stopped reading" if view else "took them all"
        print(f"requests offered      {args.n:,} ({len(data) / 1e6:.1f} MB)")
        print(f"agent                 {stopped} after {taken:,} ({written / 1e6:.1f} MB,", end="")
        print(f" {took:.1f} s)")
        print(f"agent RSS             {_mb(before)} before, {_mb(at_stop)} unread", end="")
        print(f" (peak {_mb(peak)})")

        # now read: every request must get exactly one answer with its id
        seen = bytearray(args.n)
        answered = 0
        started = time.monotonic()
        while answered < args.n:
            if view and select.select([], [wfd], [], 0)[1]:
                with contextlib.suppress(BlockingIOError):
                    view = view[os.write(wfd, view) :]
            answer = orjson.loads(_read_line(rfd, pending, 60))
            assert answer.get("result") == {"sessions": []}, answer
            assert seen[answer["id"]] == 0, f"a second answer to {answer['id']}"
            seen[answer["id"]] = 1
            answered += 1
        took = time.monotonic() - started
        print(f"answers               {answered:,}, one per id ({took:.1f} s)")
        print(f"agent RSS after       {_mb(_status_kb(agent.pid, 'VmRSS'))}")
    finally:
        agent.stdin.close()
        try:
            agent.wait(10)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()


if __name__ == "__main__":
    main()
