"""The neutral load benchmark: a thin client in a process of its own (`benchmarks/load/client.mjs`,
Node, raw WebSocket / Streamable HTTP) drives `acp-once serve` (memory, SQLite, PostgreSQL
stores) and the TypeScript SDK 2.4.0 agent server (`benchmarks/ts_server/server.mjs`, keys in a
map) the same way, the servers alternating within one run.

    python3 dev.py run python benchmarks/bench_load.py [--servers memory sqlite postgres ts]
        [--transports ws http] [--connections 20 500 10000] [--warmup 2] [--duration 5]
        [--rounds 1] [--idle 10000] [--idle-servers memory ts] [--cluster-nodes 1 2]
        [--cluster-connections 20] [--skip throughput idle cluster]

Every connection opens its own session and sends keyed `session/prompt`s back to back (a fresh
`idempotencyKey` each); a prompt counts when its `{messageId}` and the turn's idle
`state_update` have both arrived. Servers are started as a user would (`acp-once serve --store
... --port P`), a fresh one per measurement, and stopped after it.

1. Throughput: per transport, connection count, round and server: prompts/s over the measured
   window (after the warm-up), p50/p99 latency, server CPU per prompt (its /proc CPU time over
   the window / prompts) and the part of it its main thread used (the event loop's: the
   bottleneck of a Python node; the rest is its worker and checkpoint threads), client CPU per
   prompt, the server's RSS at the end of the window.
2. Idle connections (`--idle N`): a server holds N idle connections, each with a session
   (another client process), while 20 active clients prompt beside them: RSS per idle
   connection ((RSS with them - RSS before) / N) and p99 of the 20 with and without them.
3. Cluster (`--cluster-nodes`): K `acp-once serve` nodes on one fresh PostgreSQL database, the
   client's connections spread over the nodes: CPU per prompt of the nodes and of PostgreSQL
   (its backends on that database plus its WAL writer, background writer and checkpointer, from
   /proc), transactions per prompt (`pg_stat_database.xact_commit`), round trips per prompt
   (Sync and simple Query messages the nodes send, counted by a small proxy in this process in
   front of PostgreSQL) and statements per prompt (its Execute and simple Query messages), so
   scaling past one machine can be projected.

Connections are spread over loopback source addresses (127.0.0.1, .2, ...; 400 per address),
below `serve`'s per-address connection caps, as clients of a service come from many addresses.
`--max-connections` is passed to `serve` above the largest connection count. This process
raises its soft file-descriptor limit to the hard one for the children.

Nothing is asserted: this prints figures. The machine's load average is printed with them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import secrets
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import psycopg
from _proc import main_thread_cpu_seconds, process_cpu_seconds
from anyio.streams.buffered import BufferedByteReceiveStream
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
LOAD_DIR = HERE / "load"
TS_DIR = HERE / "ts_server"
PG_ADMIN_DSN = os.environ.get(
    "ACP_ONCE_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)
SERVERS = ("memory", "sqlite", "sqlite-loop", "postgres", "ts")
LABELS = {
    "memory": "serve memory",
    "sqlite": "serve sqlite",
    "sqlite-loop": "serve sqlite, no writer",
    "postgres": "serve postgres",
    "ts": "TS SDK 2.4.0",
}

console = Console(width=None if sys.stdout.isatty() else 170)


# -- processes ---------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    """The resident set size of `pid` in MiB (0.0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def family(pid: int) -> list[int]:
    """`pid` and its child processes (as /proc lists them; none once it is gone)."""
    children: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                children += [int(child) for child in (task / "children").read_text().split()]
    except OSError:
        pass
    return [pid, *children]


def cpu(pid: int) -> float:
    seconds = process_cpu_seconds(pid)
    return 0.0 if seconds is None else seconds


def main_thread_cpu(pid: int) -> float:
    seconds = main_thread_cpu_seconds(pid)
    return 0.0 if seconds is None else seconds


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (children inherit it)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def prepare_node_project(directory: Path) -> None:
    """`npm ci` in `directory` when its node_modules is missing; SystemExit when it cannot."""
    if shutil.which("node") is None:
        raise SystemExit("node is not installed: the load client and the TypeScript server need it")
    if (directory / "node_modules").is_dir():
        return
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit(f"npm is not installed (needed once, to install {directory.name})")
    console.print(f"[dim]npm ci in {directory}[/dim]")
    done = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund", "--prefer-offline"],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"npm ci failed in {directory}: {done.stderr[-1000:]}")


def node_version() -> str:
    done = subprocess.run(["node", "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip()


class Lines:
    """The lines of a child's stream, read in a task; the last few kept for error messages."""

    def __init__(self, stream: anyio.abc.ByteReceiveStream) -> None:
        self._buffered = BufferedByteReceiveStream(stream)
        self.tail: deque[str] = deque(maxlen=20)

    async def next(self) -> str | None:
        """The next line, or None at the end of the stream."""
        try:
            line = await self._buffered.receive_until(b"\n", 1 << 20)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
            return None
        text = line.decode(errors="replace")
        self.tail.append(text)
        return text

    async def drain(self) -> None:
        while await self.next() is not None:
            pass


async def stop(process: anyio.abc.Process) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.terminate()
    with anyio.move_on_after(10):
        await process.wait()
        return
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    await process.wait()


Failure = (RuntimeError, TimeoutError, OSError, ExceptionGroup)
"""What a measurement may end with and the run goes on after (task groups wrap it in a group)."""


def describe(exc: BaseException) -> str:
    """One line for a failed measurement; re-raises what is not a `Failure` (a bug here)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(inner) for inner in exc.exceptions)
    if not isinstance(exc, (RuntimeError, TimeoutError, OSError)):
        raise exc
    return f"{type(exc).__name__}: {exc}"[:400]


# -- servers -----------------------------------------------------------------------------------


@dataclass
class Running:
    """A started server: its process ids (one per node) and base URLs without scheme."""

    pids: list[int]
    hosts: list[str]  # "127.0.0.1:PORT"
    store_url: str | None = None

    def urls(self, transport: str) -> list[str]:
        return [f"{transport}://{host}/acp" for host in self.hosts]

    def cpu(self) -> float:
        """The CPU time of the nodes and their child processes (the SQLite store's writer)."""
        return sum(cpu(pid) for node in self.pids for pid in family(node))

    def loop_cpu(self) -> float:
        """The CPU time of the nodes' main threads (their event loops)."""
        return sum(main_thread_cpu(pid) for pid in self.pids)

    def rss(self) -> float:
        return sum(rss_mib(pid) for node in self.pids for pid in family(node))


def acp_once_command() -> list[str]:
    """`acp-once` as installed beside this interpreter (else `python -m acp_once`)."""
    script = Path(sys.executable).parent / "acp-once"
    return [str(script)] if script.exists() else [sys.executable, "-m", "acp_once"]


@contextlib.asynccontextmanager
async def serve_node(
    store: str,
    workdir: Path,
    max_connections: int,
    node_id: str | None = None,
    extra: Sequence[str] = (),
) -> AsyncIterator[tuple[int, str]]:
    """`acp-once serve --store STORE --port P` until the block ends; yields (pid, host:port)
    once it logged its address. RuntimeError when it exits first."""
    port = free_port()
    command = [
        *acp_once_command(), "serve", "--store", store, "--port", str(port),
        "--max-connections", str(max_connections),
        "--side-effects", str(workdir / f"effects-{port}"),
    ]  # fmt: skip
    if node_id is not None:
        command += ["--node-id", node_id]
    command += extra
    process = await anyio.open_process(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert process.stderr is not None
    stderr = Lines(process.stderr)
    try:
        with anyio.fail_after(60):
            while True:
                line = await stderr.next()
                if line is None:
                    raise RuntimeError(f"acp-once serve exited: {''.join(stderr.tail)[-2000:]}")
                if "ACP over WebSocket at" in line:
                    break
        async with anyio.create_task_group() as tg:
            tg.start_soon(stderr.drain)
            try:
                yield process.pid, f"127.0.0.1:{port}"
            finally:
                await stop(process)
                tg.cancel_scope.cancel()
    finally:
        await stop(process)


@contextlib.asynccontextmanager
async def ts_server() -> AsyncIterator[tuple[int, str]]:
    """`node benchmarks/ts_server/server.mjs` until the block ends; yields (pid, host:port)."""
    node = shutil.which("node")
    assert node is not None
    process = await anyio.open_process(
        [node, str(TS_DIR / "server.mjs")],
        cwd=TS_DIR,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    stdout, stderr = Lines(process.stdout), Lines(process.stderr)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stderr.drain)
            with anyio.fail_after(30):
                line = await stdout.next()
            if line is None:
                raise RuntimeError(f"the TypeScript server exited: {''.join(stderr.tail)}")
            port = json.loads(line)["port"]
            tg.start_soon(stdout.drain)
            try:
                yield process.pid, f"127.0.0.1:{port}"
            finally:
                await stop(process)
                tg.cancel_scope.cancel()
    finally:
        await stop(process)


@contextlib.contextmanager
def fresh_database() -> Iterator[tuple[str, str]]:
    """A new, empty PostgreSQL database for one measurement, dropped afterwards; yields its
    name and URL."""
    name = f"acp_once_bench_{secrets.token_hex(4)}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_DSN.rsplit("/", 1)[0]
    try:
        yield name, f"{base}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def migrate(store_url: str) -> None:
    done = await anyio.run_process(
        [*acp_once_command(), "db", "migrate", "--store", store_url], check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"acp-once db migrate failed: {done.stderr.decode()[-1000:]}")


@contextlib.asynccontextmanager
async def server(kind: str, workdir: Path, max_connections: int) -> AsyncIterator[Running]:
    """One fresh server of `kind` (memory, sqlite, postgres, ts)."""
    if kind == "ts":
        async with ts_server() as (pid, host):
            yield Running([pid], [host])
        return
    if kind == "postgres":
        with fresh_database() as (_name, url):
            await migrate(url)
            async with serve_node(url, workdir, max_connections) as (pid, host):
                yield Running([pid], [host], url)
        return
    store = (
        "memory" if kind == "memory" else f"sqlite:{workdir / f'{secrets.token_hex(4)}.sqlite3'}"
    )
    extra = ["--no-sqlite-writer"] if kind == "sqlite-loop" else []
    if kind != "memory":
        await migrate(store)
    async with serve_node(store, workdir, max_connections, extra=extra) as (pid, host):
        yield Running([pid], [host])


# -- the load client ---------------------------------------------------------------------------


@dataclass
class ClientRun:
    """What one client process reported, with the server CPU read at its window's edges."""

    opened: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)
    server_cpu: float = 0.0  # seconds over the measured window
    server_loop_cpu: float = 0.0  # of which the main thread's (the event loop's)
    client_cpu: float = 0.0
    extra_cpu: float = 0.0  # e.g. PostgreSQL's, when a probe is given
    server_rss: float = 0.0  # MiB at the window's end


def client_command(
    transport: str, urls: Sequence[str], connections: int, args: argparse.Namespace, **extra: Any
) -> list[str]:
    node = shutil.which("node")
    assert node is not None
    command = [
        node, str(LOAD_DIR / "client.mjs"), "--transport", transport,
        "--connections", str(connections),
        "--warmup", str(args.warmup), "--duration", str(args.duration),
    ]  # fmt: skip
    for url in urls:
        command += ["--url", url]
    for name, value in extra.items():
        flag = "--" + name.replace("_", "-")
        command += [flag] if value is True else [flag, str(value)]
    return command


async def run_client(
    command: list[str],
    running: Running,
    extra_cpu: Callable[[], float] | None = None,
    timeout: float = 900,
) -> ClientRun:
    """Run the load client to its end; reads the server's CPU at the window's start and end
    (`extra_cpu()`, when given, is read there too)."""
    run = ClientRun()
    process = await anyio.open_process(
        command,
        cwd=LOAD_DIR,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    stdout, stderr = Lines(process.stdout), Lines(process.stderr)
    started_server = started_loop = started_client = started_extra = 0.0
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stderr.drain)
            with anyio.fail_after(timeout):
                while (line := await stdout.next()) is not None:
                    event = json.loads(line)
                    if "opened" in event:
                        run.opened = event["opened"]
                    elif event.get("window") == "start":
                        started_server, started_client = running.cpu(), cpu(process.pid)
                        started_loop = running.loop_cpu()
                        started_extra = extra_cpu() if extra_cpu else 0.0
                    elif event.get("window") == "end":
                        run.server_cpu = running.cpu() - started_server
                        run.server_loop_cpu = running.loop_cpu() - started_loop
                        run.client_cpu = cpu(process.pid) - started_client
                        run.extra_cpu = (extra_cpu() if extra_cpu else 0.0) - started_extra
                        run.server_rss = running.rss()
                    elif "result" in event:
                        run.result = event["result"]
                await process.wait()
    finally:
        await stop(process)
    if not run.result:
        raise RuntimeError(
            f"the load client ended without a result ({process.returncode}): "
            f"opened={run.opened} {''.join(stderr.tail)[-1500:]}"
        )
    return run


@contextlib.asynccontextmanager
async def holding_client(command: list[str], timeout: float) -> AsyncIterator[dict[str, Any]]:
    """A client that opens its connections (each with a session) and holds them idle until the
    block ends; yields its `opened` report."""
    process = await anyio.open_process(
        command, cwd=LOAD_DIR, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None and process.stderr is not None and process.stdin is not None
    stdout, stderr = Lines(process.stdout), Lines(process.stderr)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stderr.drain)
            opened: dict[str, Any] | None = None
            with anyio.fail_after(timeout):
                while opened is None:
                    line = await stdout.next()
                    if line is None:
                        raise RuntimeError(f"the idle client ended: {''.join(stderr.tail)[-1500:]}")
                    event = json.loads(line)
                    opened = event.get("opened")
            tg.start_soon(stdout.drain)
            try:
                yield opened
            finally:
                await process.stdin.aclose()  # the client exits when its stdin closes
                with anyio.move_on_after(30):
                    await process.wait()
                await stop(process)
                tg.cancel_scope.cancel()
    finally:
        await stop(process)


# -- PostgreSQL: CPU of its processes, transactions, round trips ------------------------------


class PgProbe:
    """Reads the CPU time of the PostgreSQL processes serving one database (its backends plus
    the WAL writer, background writer and checkpointer) and its committed transactions."""

    AUX = ("walwriter", "background writer", "checkpointer")

    def __init__(self, database: str) -> None:
        self.database = database
        self.conn = psycopg.connect(PG_ADMIN_DSN, autocommit=True)
        self.start: dict[int, float] = {}

    def pids(self) -> list[int]:
        rows = self.conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s OR backend_type = ANY(%s)",
            (self.database, list(self.AUX)),
        ).fetchall()
        return [int(row[0]) for row in rows]

    def cpu(self) -> float:
        """CPU seconds of the processes alive now, less what they had used at `mark()`."""
        return sum(cpu(pid) - self.start.get(pid, 0.0) for pid in self.pids())

    def mark(self) -> None:
        self.start = {pid: cpu(pid) for pid in self.pids()}

    def commits(self) -> int:
        row = self.conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            (self.database,),
        ).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        self.conn.close()


@dataclass
class WireCounts:
    """What the counting proxy saw the clients of PostgreSQL send."""

    syncs: int = 0
    queries: int = 0
    executes: int = 0
    connections: int = 0

    @property
    def round_trips(self) -> int:
        return self.syncs + self.queries

    @property
    def statements(self) -> int:
        """Statements run: an Execute each (BEGIN and COMMIT included), a simple Query each
        (which may hold several; ours hold one)."""
        return self.executes + self.queries


SSL_REQUEST, GSSENC_REQUEST = 80877103, 80877104


async def count_frontend(
    source: anyio.abc.ByteStream, sink: anyio.abc.ByteStream, counts: WireCounts
) -> None:
    """Forward a PostgreSQL client's bytes, counting its Sync ('S') and Query ('Q') messages
    (each is one round trip to the server) and its Execute ('E') messages (statements)."""
    buffer = bytearray()
    started = False  # after the untyped startup message(s)
    with contextlib.suppress(
        anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError
    ):
        while True:
            chunk = await source.receive(65536)
            await sink.send(chunk)
            buffer += chunk
            while True:
                if not started:
                    if len(buffer) < 8:
                        break
                    (length,) = struct.unpack_from("!i", buffer, 0)
                    if len(buffer) < length:
                        break
                    (code,) = struct.unpack_from("!i", buffer, 4)
                    started = code not in (SSL_REQUEST, GSSENC_REQUEST)
                    del buffer[:length]
                    continue
                if len(buffer) < 5:
                    break
                (length,) = struct.unpack_from("!i", buffer, 1)
                if len(buffer) < 1 + length:
                    break
                kind = buffer[0]
                if kind == ord("S"):
                    counts.syncs += 1
                elif kind == ord("Q"):
                    counts.queries += 1
                elif kind == ord("E"):
                    counts.executes += 1
                del buffer[: 1 + length]
    with contextlib.suppress(Exception):
        await sink.send_eof()


async def forward(source: anyio.abc.ByteStream, sink: anyio.abc.ByteStream) -> None:
    with contextlib.suppress(
        anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError
    ):
        while True:
            await sink.send(await source.receive(65536))
    with contextlib.suppress(Exception):
        await sink.send_eof()


@contextlib.asynccontextmanager
async def counting_proxy(upstream: tuple[str, int]) -> AsyncIterator[tuple[int, WireCounts]]:
    """A TCP proxy to PostgreSQL on a free loopback port; yields (port, the live counts)."""
    counts = WireCounts()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)

    async def serve(client: anyio.abc.SocketStream) -> None:
        counts.connections += 1
        async with (
            client,
            await anyio.connect_tcp(*upstream) as server_side,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(count_frontend, client, server_side, counts)
            tg.start_soon(forward, server_side, client)

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        try:
            yield port, counts
        finally:
            tg.cancel_scope.cancel()


class PgWindow:
    """Called at the measured window's start (marks the counters, returns 0.0) and at its end
    (returns PostgreSQL's CPU seconds since, and keeps the transactions and round trips)."""

    def __init__(self, probe: PgProbe, counts: WireCounts) -> None:
        self.probe, self.counts = probe, counts
        self.marked = False
        self.commits = self.round_trips = self.statements = 0

    def __call__(self) -> float:
        if not self.marked:
            self.marked = True
            self.probe.mark()
            self.commits, self.round_trips = self.probe.commits(), self.counts.round_trips
            self.statements = self.counts.statements
            return 0.0
        self.commits = self.probe.commits() - self.commits
        self.round_trips = self.counts.round_trips - self.round_trips
        self.statements = self.counts.statements - self.statements
        return self.probe.cpu()


# -- the sections ------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def ratio(by_round: Sequence[dict[str, float]], kind: str, base: str) -> str:
    """The median over the rounds of `kind`'s rate over `base`'s in the same round ("" for
    `base` itself, or when no round ran both)."""
    if kind == base:
        return ""
    found = median([r[kind] / r[base] for r in by_round if r.get(kind) and r.get(base)])
    return "" if found is None else f"{found:.2f}x"


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


async def throughput(args: argparse.Namespace, workdir: Path) -> None:
    for transport in args.transports:
        table = Table(
            title=f"Throughput, {transport.upper()} (median of {args.rounds} round(s); "
            f"{args.warmup:g} s warm-up, {args.duration:g} s measured)"
        )
        for column in (
            "connections", "server", "prompts/s", "vs TS", "vs memory", "p50 ms", "p99 ms",
            "server µs CPU/prompt", "of which loop thread", "client µs CPU/prompt",
            "server RSS MiB", "errors",
        ):  # fmt: skip
            table.add_column(column, justify="right" if column != "server" else "left")
        for connections in args.connections:
            runs: dict[str, list[ClientRun]] = {kind: [] for kind in args.servers}
            # each round's rate of each server, for the ratios of one round's runs
            by_round: list[dict[str, float]] = []
            failures: dict[str, str] = {}
            for round_ in range(args.rounds):
                by_round.append({})
                # every other round in the reverse order: a machine that drifts over a round
                # favours no server in the median of the rounds' ratios
                order = args.servers if round_ % 2 == 0 else args.servers[::-1]
                for kind in order:
                    if kind in failures:
                        continue
                    try:
                        async with server(kind, workdir, max(1000, 2 * connections)) as running:
                            command = client_command(
                                transport, running.urls(transport), connections, args
                            )
                            run = await run_client(command, running)
                            runs[kind].append(run)
                            by_round[-1][kind] = run.result["promptsPerSecond"]
                    except Failure as exc:
                        failures[kind] = describe(exc)
                        console.print(
                            f"[red]{LABELS[kind]} at {connections}: {failures[kind]}[/red]"
                        )
            rates = {
                kind: median([r.result["promptsPerSecond"] for r in runs[kind]])
                for kind in args.servers
            }
            for kind in args.servers:
                done = runs[kind]
                if not done:
                    table.add_row(
                        str(connections),
                        LABELS[kind],
                        "failed",
                        "",
                        "",
                        "",
                        "",
                        "",
                        "",
                        "",
                        "",
                        failures.get(kind, ""),
                    )
                    continue
                prompts = [max(1, r.result["prompts"]) for r in done]
                per_prompt = list(zip(done, prompts, strict=True))
                rate = rates[kind]
                table.add_row(
                    f"{connections:,}",
                    LABELS[kind],
                    fmt(rate),
                    ratio(by_round, kind, "ts"),
                    ratio(by_round, kind, "memory"),
                    fmt(median([r.result["p50Ms"] for r in done]), 1),
                    fmt(median([r.result["p99Ms"] for r in done]), 1),
                    fmt(
                        median([r.server_cpu / p * 1e6 for r, p in zip(done, prompts, strict=True)])
                    ),
                    fmt(median([r.server_loop_cpu / p * 1e6 for r, p in per_prompt])),
                    fmt(
                        median([r.client_cpu / p * 1e6 for r, p in zip(done, prompts, strict=True)])
                    ),
                    fmt(median([r.server_rss for r in done]), 1),
                    str(sum(r.result["errors"] + r.opened.get("failed", 0) for r in done)),
                )
            console.print(f"[dim]{transport} at {connections:,} done; {load_average()}[/dim]")
        console.print(table)


async def idle(args: argparse.Namespace, workdir: Path) -> None:
    table = Table(
        title=f"{args.idle:,} idle connections, each with a session, beside "
        f"{args.idle_active} active clients"
    )
    for column in (
        "server", "transport", "opened", "RSS before MiB", "RSS with idle MiB", "KiB per idle conn",
        "p99 ms without", "p99 ms beside", "ratio", "prompts/s without", "prompts/s beside",
    ):  # fmt: skip
        table.add_column(
            column, justify="right" if column not in ("server", "transport") else "left"
        )
    notes: list[str] = []
    for transport in args.transports:
        for kind in args.idle_servers:
            label = LABELS[kind]
            try:
                async with server(kind, workdir, 2 * args.idle + 1000) as running:
                    active = client_command(
                        transport, running.urls(transport), args.idle_active, args
                    )
                    await run_client(active, running)  # warms the server up; not counted
                    without = await run_client(active, running)
                    before = running.rss()
                    holder = client_command(
                        transport, running.urls(transport), args.idle, args,
                        active=0, wait_go=True,
                        http_connection_stream=args.idle_http_connection_stream,
                    )  # fmt: skip
                    async with holding_client(holder, timeout=900) as opened:
                        with_idle = running.rss()
                        beside = await run_client(active, running)
                    held = int(opened["connections"])
                    if opened.get("failed"):
                        notes.append(
                            f"{label} {transport}: {opened['failed']:,} of {args.idle:,} "
                            f"connections failed to open: {opened.get('errors')}"
                        )
                    p99_without, p99_beside = without.result["p99Ms"], beside.result["p99Ms"]
                    table.add_row(
                        label, transport, f"{held:,}", fmt(before, 1), fmt(with_idle, 1),
                        fmt((with_idle - before) * 1024 / held, 1) if held else "-",
                        fmt(p99_without, 1), fmt(p99_beside, 1),
                        f"{p99_beside / p99_without:.2f}x" if p99_without and p99_beside else "-",
                        fmt(without.result["promptsPerSecond"]),
                        fmt(beside.result["promptsPerSecond"]),
                    )  # fmt: skip
            except Failure as exc:
                notes.append(f"{label} {transport}: {describe(exc)}")
                table.add_row(label, transport, "failed", *[""] * 8)
            console.print(f"[dim]idle {label} {transport} done; {load_average()}[/dim]")
    console.print(table)
    for note in notes:
        console.print(f"[yellow]{note}[/yellow]")


async def cluster_row(
    args: argparse.Namespace, workdir: Path, nodes: int, connections: int
) -> list[str]:
    """One measurement of `nodes` nodes on a fresh database; the row of the cluster table."""
    with fresh_database() as (name, direct_url):
        await migrate(direct_url)
        async with counting_proxy(("127.0.0.1", 5432)) as (proxy_port, counts):
            url = f"postgresql://postgres@127.0.0.1:{proxy_port}/{name}?sslmode=disable"
            probe = PgProbe(name)
            try:
                async with contextlib.AsyncExitStack() as stack:
                    started = [
                        await stack.enter_async_context(
                            serve_node(url, workdir, 2 * connections + 1000, f"node{i}")
                        )
                        for i in range(nodes)
                    ]
                    running = Running([pid for pid, _ in started], [h for _, h in started])
                    window = PgWindow(probe, counts)
                    command = client_command("ws", running.urls("ws"), connections, args)
                    run = await run_client(command, running, extra_cpu=window)
            finally:
                probe.close()
    prompts = max(1, run.result["prompts"])
    return [
        str(nodes),
        f"{connections:,}",
        fmt(run.result["promptsPerSecond"]),
        fmt(run.result["p99Ms"], 1),
        fmt(run.server_cpu / prompts * 1e6),
        fmt(run.extra_cpu / prompts * 1e6),
        f"{window.commits / prompts:.2f}",
        f"{window.round_trips / prompts:.2f}",
        f"{window.statements / prompts:.2f}",
        str(counts.connections),
    ]


async def cluster(args: argparse.Namespace, workdir: Path) -> None:
    table = Table(
        title="Nodes on one PostgreSQL database (WebSocket; round trips counted by a proxy "
        "in front of PostgreSQL)"
    )
    for column in (
        "nodes", "connections", "prompts/s", "p99 ms", "node µs CPU/prompt (all nodes)",
        "PostgreSQL µs CPU/prompt", "transactions/prompt", "round trips/prompt",
        "statements/prompt", "PG connections",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for connections in args.cluster_connections:
        for nodes in args.cluster_nodes:
            try:
                table.add_row(*await cluster_row(args, workdir, nodes, connections))
            except Failure as exc:
                table.add_row(str(nodes), f"{connections:,}", "failed", *[""] * 7)
                console.print(f"[red]{nodes} node(s) at {connections}: {describe(exc)}[/red]")
            console.print(
                f"[dim]cluster {nodes} node(s) at {connections} done; {load_average()}[/dim]"
            )
    console.print(table)


async def main(args: argparse.Namespace) -> None:
    limit = raise_fd_limit()
    prepare_node_project(LOAD_DIR)
    if "ts" in args.servers or "ts" in args.idle_servers:
        prepare_node_project(TS_DIR)
    console.print(
        f"[bold]bench_load[/bold]: {os.cpu_count()} CPUs, file descriptors {limit:,}, "
        f"node {node_version()}, "
        f"{load_average()}"
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        workdir = Path(tmp)
        if "throughput" not in args.skip:
            await throughput(args, workdir)
        if "idle" not in args.skip and args.idle > 0:
            await idle(args, workdir)
        if "cluster" not in args.skip and args.cluster_nodes:
            await cluster(args, workdir)
    console.print(f"[dim]{time.perf_counter() - started:.0f} s in all; {load_average()}[/dim]")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--transports", nargs="+", choices=("ws", "http"), default=["ws", "http"])
    parser.add_argument("--connections", nargs="+", type=int, default=[20, 500, 10000])
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before the window")
    parser.add_argument("--duration", type=float, default=5.0, help="the measured window, seconds")
    parser.add_argument("--rounds", type=int, default=1, help="servers alternate round by round")
    parser.add_argument("--idle", type=int, default=10000, help="idle connections (0: skip)")
    parser.add_argument("--idle-active", type=int, default=20, help="active clients beside them")
    parser.add_argument("--idle-servers", nargs="+", choices=SERVERS, default=["memory", "ts"])
    parser.add_argument(
        "--idle-http-connection-stream",
        choices=("keep", "close"),
        default="close",
        help="idle HTTP clients keep their connection's SSE stream open beside the session's, "
        "or close it once the session exists (two streams per client for 10,000 clients pass "
        "a 20,000 file-descriptor limit)",
    )
    parser.add_argument("--cluster-nodes", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--cluster-connections", nargs="+", type=int, default=[20, 500])
    parser.add_argument("--skip", nargs="*", choices=("throughput", "idle", "cluster"), default=[])
    return parser.parse_args(argv)


if __name__ == "__main__":
    anyio.run(main, parse_args(sys.argv[1:]))
