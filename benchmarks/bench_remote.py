"""Prompts per second over the network: `acp-once serve` (a real subprocess, SQLite store) with
N concurrent clients, over WebSocket and over Streamable HTTP, with and without keys.

    python3 dev.py run python benchmarks/bench_remote.py [--clients N ...] [--prompts P]
                                                        [--rounds R] [--store memory|sqlite]

Each client is an `AcpClient` (`WebSocketLauncher` or `HttpLauncher`) with its own session; it
submits P prompts one after the other (each awaits its `{messageId}`), all N clients at once.
"keys" is the client's default (a fresh key per submission, kept in its in-memory outbox);
"no keys" sends none (`use_keys=False`). The figure is submissions per second over the whole
wave (from the first connect to the last answer), the median of R rounds; the configurations
alternate round by round, so drift on a busy machine hits all of them alike. Also shown: the
CPU time per prompt of the server (from /proc) and of this process (all the clients), and the
server's resident set size after the run. `--clients 10 50` (the default) runs both counts.

Nothing is asserted: this prints figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import anyio
import anyio.abc
from _proc import process_cpu_seconds

from acp_once.client import AcpClient, HttpLauncher, WebSocketLauncher
from acp_once.support.backoff import Backoff

Transport = Literal["ws", "http"]
CONFIGS: list[tuple[Transport, bool]] = [
    ("ws", True),
    ("ws", False),
    ("http", True),
    ("http", False),
]


class Server:
    """`acp-once serve` on a socket bound here (`--fd`)."""

    def __init__(self, workdir: Path, store: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.port: int = self.sock.getsockname()[1]
        url = "memory:" if store == "memory" else f"sqlite:{workdir / 'serve.sqlite3'}"
        self.command = [
            sys.executable, "-m", "acp_once", "serve", "--store", url,
            "--side-effects", str(workdir / "effects"), "--fd", str(self.sock.fileno()),
            "--max-connections", "10000",
        ]  # fmt: skip
        self.process: anyio.abc.Process | None = None

    async def __aenter__(self) -> Server:
        self.process = await anyio.open_process(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(self.sock.fileno(),),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.terminate()
        with anyio.move_on_after(10):
            await self.process.wait()
            self.sock.close()
            return
        self.process.kill()
        await self.process.wait()
        self.sock.close()

    def cpu_seconds(self) -> float:
        assert self.process is not None
        seconds = process_cpu_seconds(self.process.pid)
        assert seconds is not None, "the CPU figures need Linux /proc"
        return seconds

    def rss_mib(self) -> float:
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0


@dataclass
class Figures:
    rates: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    client_cpu_us: list[float] = field(default_factory=list)


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def wave(
    server: Server, transport: Transport, keys: bool, clients: int, prompts: int
) -> float:
    """Run `clients` clients at once, `prompts` each; returns prompts per second."""
    ready = anyio.Event()
    connected = 0
    url = f"{transport}://127.0.0.1:{server.port}/acp"

    async def client(i: int) -> None:
        launcher = WebSocketLauncher(url) if transport == "ws" else HttpLauncher(url)
        backoff = Backoff(base=0.05, factor=2.0, cap=0.5)
        async with AcpClient(launcher, backoff=backoff, use_keys=keys) as acp:
            session = await acp.new_session("/bench")
            nonlocal connected
            connected += 1
            if connected == clients:
                ready.set()
            await ready.wait()
            for j in range(prompts):
                await session.prompt(f"client {i} prompt {j}")

    async with anyio.create_task_group() as tg:
        for i in range(clients):
            tg.start_soon(client, i)
        await ready.wait()  # the clock starts once every client is connected with its session
        started = time.perf_counter()
    return clients * prompts / (time.perf_counter() - started)


async def main(args: argparse.Namespace) -> None:
    print(f"python {platform.python_version()}, {os.cpu_count()} cores, load {os.getloadavg()}")
    print(
        f"clients {args.clients} x {args.prompts} prompts each, {args.rounds} rounds, "
        f"store {args.store}"
    )
    results = {(n, *config): Figures() for n in args.clients for config in CONFIGS}
    rss = 0.0
    with tempfile.TemporaryDirectory(prefix="acp-once-bench-remote-") as tmp:
        async with Server(Path(tmp), args.store) as server:
            await wave(server, "ws", True, 2, 2)  # warm up (imports, first connections)
            for _ in range(args.rounds):
                for n, transport, keys in results:
                    cpu, own = server.cpu_seconds(), own_cpu_seconds()
                    rate = await wave(server, transport, keys, n, args.prompts)
                    prompts = n * args.prompts
                    figures = results[(n, transport, keys)]
                    figures.rates.append(rate)
                    figures.cpu_us.append((server.cpu_seconds() - cpu) * 1e6 / prompts)
                    figures.client_cpu_us.append((own_cpu_seconds() - own) * 1e6 / prompts)
            rss = server.rss_mib()
    print()
    print(
        "| clients | transport | keys | prompts/s | server CPU us/prompt | clients CPU us/prompt |"
    )
    print("| -: | - | - | -: | -: | -: |")
    for (n, transport, keys), figures in results.items():
        rate = statistics.median(figures.rates)
        cpu = statistics.median(figures.cpu_us)
        own = statistics.median(figures.client_cpu_us)
        key = "fresh key" if keys else "none"
        print(f"| {n} | {transport} | {key} | {rate:,.0f} | {cpu:,.0f} | {own:,.0f} |")
    print(f"\nserver RSS after the run: {rss:.0f} MiB; load {os.getloadavg()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--store", choices=["memory", "sqlite"], default="sqlite")
    anyio.run(main, parser.parse_args())
