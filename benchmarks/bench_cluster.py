"""Several `acp-once serve` nodes on one PostgreSQL: prompts accepted per second, keyed or not.

    python3 dev.py run python benchmarks/bench_cluster.py [N] [--sessions S] [--rounds R]
                                                          [--nodes 1,2,3] [--dsn DSN]

For one, two and three nodes (`acp-once serve --store postgresql://...?schema=X --node-id nK`,
real processes on loopback ports, a fresh schema per configuration), S client connections over
WebSocket, one session each, spread round-robin over the nodes, send N prompts in all: each
connection sends its next `session/prompt` as soon as the previous one is answered with its
`{messageId}` (so a prompt often arrives while the previous turn still runs and is queued in
PostgreSQL, the cluster's held-prompt path). Keyed prompts carry a fresh uuid4 key; unkeyed
ones none. Every figure is the median of R rounds; keyed and unkeyed rounds alternate. The
client runs in this process, on the same 2 cores as the nodes and PostgreSQL, so the figures
say what one machine does, not how a real cluster scales. Nothing is asserted.

`--in-process`: instead, one `ReferenceAgent` in this process on PostgreSQL, without and with a
`PostgresCoordinator` (one node), S sessions over in-memory connections, keyed prompts back to
back, rounds alternating between the two; it also counts the statements (COMMIT included) the
node sends per prompt, each one a round trip to PostgreSQL. That isolates what coordination
costs a node from the transports and processes.

`--balancer`: instead, three nodes (`n1`..`n3`, real `acp-once serve` processes) behind a real
HAProxy started with the documented configuration (examples/haproxy.cfg: round-robin, health
checks on /healthz, Streamable HTTP routed by the node id its connection ids begin with):

1. Steady load, per round, transport (ws, http) and route (through HAProxy, or straight to
   the nodes, the client spreading its connections over them), alternating: the neutral load
   client of bench_load.py (`benchmarks/load/client.mjs`, a Node process: `--connections`
   connections, one session each, keyed prompts back to back, `--warmup` then `--duration`
   seconds): prompts/s, p99, and per prompt the CPU of the three nodes, of HAProxy and of
   PostgreSQL (its processes on the database, from /proc), transactions
   (`pg_stat_database`) and round trips (Sync and Query messages, counted by bench_load.py's
   proxy in front of each PostgreSQL). Medians of `--rounds`.
2. Kills, per transport: `--kill-clients` `AcpClient`s in this process (two sessions each,
   keyed prompts back to back, resend and reconnect on their own) while each node in turn is
   SIGKILLed after `--kill-step` answered prompts and started again (the next kill waits for
   `--kill-step` more and another node UP, not for the restart: `balancer.kill_in_turn`); then
   what the clients were answered is compared with the store (sharded over the `--store`
   URLs when several are given; each client then has a session on each shard): lost,
   duplicated, wrong ids (tests/cluster/balancer.py's `outcomes`).

The store: a fresh database on `--dsn`'s server, or `--store URL` (repeatable; each one is
passed to every node as a `--store` option and gets a counting proxy of its own). Nodes run
with `--lease-ttl` (2 s by default: how long a killed node's sessions wait for a takeover).

DSN: `--dsn`, else `ACP_ONCE_TEST_POSTGRES_DSN`, else postgresql://postgres@127.0.0.1:5432/postgres.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.abc
import httpx
import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from rich.console import Console
from rich.table import Table

from acp_once.agent.reference import ReferenceAgent
from acp_once.client import AcpClient, Client, ClientSideConnection
from acp_once.cluster import PostgresCoordinator
from acp_once.protocol import schema as s
from acp_once.storage import open_store
from acp_once.storage.postgres import PostgresStore
from acp_once.support.backoff import Backoff
from acp_once.testing import connected
from acp_once.transports.websocket import connect_websocket

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/cluster/balancer.py
import bench_load

from tests.cluster import balancer
from tests.cluster.harness import until

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


def _listening() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    sock.setblocking(False)
    return sock


@asynccontextmanager
async def cluster(dsn: str, count: int, tmp: Path) -> AsyncIterator[list[str]]:
    """`count` serve processes on a fresh schema; yields their ws:// URLs; drops the schema."""
    schema = f"acp_once_bench_{uuid.uuid4().hex[:12]}"
    url = f"{dsn}{'&' if '?' in dsn else '?'}schema={schema}"
    socks = [_listening() for _ in range(count)]
    procs: list[anyio.abc.Process] = []
    try:
        for i, sock in enumerate(socks):
            fd = sock.fileno()
            command = [
                sys.executable, "-m", "acp_once", "serve", "--store", url,
                "--node-id", f"n{i + 1}", "--side-effects", str(tmp / "effects"),
                "--fd", str(fd),
            ]  # fmt: skip
            procs.append(
                await anyio.open_process(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    pass_fds=(fd,),
                )
            )
            port = sock.getsockname()[1]
            async with httpx.AsyncClient() as http:
                with anyio.fail_after(60):
                    while True:  # poll until the node answers (it migrates on the first run)
                        try:
                            if (await http.get(f"http://127.0.0.1:{port}/healthz")).is_success:
                                break
                        except httpx.HTTPError:
                            pass
                        await anyio.sleep(0.05)
        yield [f"ws://127.0.0.1:{sock.getsockname()[1]}/acp" for sock in socks]
    finally:
        for proc in procs:
            proc.terminate()
        with anyio.CancelScope(shield=True):
            for proc in procs:
                with anyio.move_on_after(15):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        for sock in socks:
            sock.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@asynccontextmanager
async def clients(urls: list[str], sessions: int) -> AsyncIterator[list[tuple[Any, str]]]:
    """One initialized connection per session, round-robin over the nodes."""
    async with anyio.create_task_group() as tg:
        ready: list[tuple[Any, str]] = []
        stop = anyio.Event()
        started = anyio.Event()

        async def one(url: str) -> None:
            async with (
                connect_websocket(url, ping_interval=None) as frames,
                ClientSideConnection(Client(), frames) as conn,
            ):
                await conn.agent.initialize(
                    s.InitializeRequest.model_validate(
                        {"protocolVersion": 2, "info": {"name": "bench", "version": "1"}}
                    )
                )
                sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/b"))).session_id
                ready.append((conn, sid))
                if len(ready) == sessions:
                    started.set()
                await stop.wait()

        for i in range(sessions):
            tg.start_soon(one, urls[i % len(urls)])
        with anyio.fail_after(60):
            await started.wait()
        try:
            yield ready
        finally:
            stop.set()


async def run_round(conns: list[tuple[Any, str]], total: int, keyed: bool) -> float:
    """Send `total` prompts over the connections (each sequential); return prompts/s."""
    per = max(1, total // len(conns))

    async def drive(conn: Any, sid: str) -> None:
        for i in range(per):
            params: dict[str, Any] = {
                "sessionId": sid,
                "prompt": [{"type": "text", "text": f"bench {i}"}],
            }
            if keyed:
                params["idempotencyKey"] = uuid.uuid4().hex
            await conn.rpc.request("session/prompt", params)

    start = time.perf_counter()
    with anyio.fail_after(600):
        async with anyio.create_task_group() as tg:
            for conn, sid in conns:
                tg.start_soon(drive, conn, sid)
    return per * len(conns) / (time.perf_counter() - start)


class StatementCounter:
    """Counts the statements and COMMITs psycopg sends (each one a round trip; a COMMIT on an
    autocommit connection with no transaction open sends nothing and is not counted)."""

    def __init__(self) -> None:
        self.count = 0
        self._execute = psycopg.AsyncCursor.execute
        self._commit = psycopg.AsyncConnection.commit

    def __enter__(self) -> StatementCounter:
        counter = self
        execute, commit = self._execute, self._commit

        async def counted_execute(cur: Any, *args: Any, **kwargs: Any) -> Any:
            counter.count += 1
            return await execute(cur, *args, **kwargs)

        async def counted_commit(conn: Any) -> None:
            if conn.info.transaction_status != TransactionStatus.IDLE:  # else sends nothing
                counter.count += 1
            await commit(conn)

        psycopg.AsyncCursor.execute = counted_execute  # type: ignore[method-assign,assignment]
        psycopg.AsyncConnection.commit = counted_commit  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        psycopg.AsyncCursor.execute = self._execute  # type: ignore[method-assign]
        psycopg.AsyncConnection.commit = self._commit  # type: ignore[method-assign]


@asynccontextmanager
async def one_node(dsn: str, clustered: bool, tmp: Path) -> AsyncIterator[ReferenceAgent]:
    """The reference agent in this process on a fresh schema, with or without coordination."""
    schema = f"acp_once_bench_{uuid.uuid4().hex[:12]}"
    try:
        async with PostgresStore.open(dsn, schema=schema) as store:
            agent = ReferenceAgent(store, side_effects=tmp / "effects")
            if clustered:
                agent.use_coordinator(PostgresCoordinator(store, node_id="bench"))
            async with agent:
                yield agent
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@asynccontextmanager
async def in_memory_clients(
    agent: ReferenceAgent, sessions: int
) -> AsyncIterator[list[tuple[Any, str]]]:
    async with contextlib.AsyncExitStack() as stack:
        ready: list[tuple[Any, str]] = []
        for _ in range(sessions):
            conn = await stack.enter_async_context(connected(agent))
            await conn.agent.initialize(
                s.InitializeRequest.model_validate(
                    {"protocolVersion": 2, "info": {"name": "bench", "version": "1"}}
                )
            )
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/b"))).session_id
            ready.append((conn, sid))
        yield ready


async def in_process(args: argparse.Namespace, console: Console) -> None:
    """One node in this process, without and with coordination (see the module docstring)."""
    rates: dict[bool, list[float]] = {False: [], True: []}
    trips: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="acp-once-bench-") as tmp:
        async with (
            one_node(args.dsn, False, Path(tmp)) as local,
            one_node(args.dsn, True, Path(tmp)) as clustered,
            in_memory_clients(local, args.sessions) as local_conns,
            in_memory_clients(clustered, args.sessions) as cluster_conns,
        ):
            for conns in (local_conns, cluster_conns):  # warm up
                await run_round(conns, max(args.sessions, args.n // 5), keyed=True)
            for _ in range(args.rounds):
                for mode, conns in ((False, local_conns), (True, cluster_conns)):
                    with StatementCounter() as counter:
                        rates[mode].append(await run_round(conns, args.n, keyed=True))
                    trips[mode].append(counter.count / args.n)
    table = Table(title="one node in-process, keyed prompts back to back")
    for column in ("coordination", "prompts/s", "round trips/prompt"):
        table.add_column(column, justify="right")
    for mode, label in ((False, "none"), (True, "PostgresCoordinator")):
        table.add_row(
            label, f"{statistics.median(rates[mode]):.0f}", f"{statistics.median(trips[mode]):.1f}"
        )
        console.print(f"{label}: {[round(r) for r in rates[mode]]} prompts/s")
    console.print(table)


# -- three nodes behind HAProxy ------------------------------------------------------------


class ShardProbe(bench_load.PgProbe):
    """bench_load's `PgProbe` on the PostgreSQL server of `url` (its database: `url`'s)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.database = parts.path.lstrip("/") or "postgres"
        admin = urlunsplit(parts._replace(path="/postgres", query=""))
        self.conn = psycopg.connect(admin, autocommit=True)
        self.start: dict[int, float] = {}


class Window:
    """`run_client`'s `extra_cpu`: at the measured window's start marks PostgreSQL's counters
    (every shard's) and HAProxy's CPU; at its end returns PostgreSQL's CPU seconds and keeps
    the transactions, round trips and HAProxy CPU seconds of the window."""

    def __init__(
        self, probes: list[ShardProbe], counts: list[bench_load.WireCounts], haproxy: int
    ) -> None:
        self.windows = [bench_load.PgWindow(p, c) for p, c in zip(probes, counts, strict=True)]
        self.haproxy_pid = haproxy
        self.haproxy = 0.0
        self.marked = False

    def __call__(self) -> float:
        pg = sum(window() for window in self.windows)
        now = bench_load.cpu(self.haproxy_pid)
        self.haproxy = now - self.haproxy if self.marked else now
        self.marked = True
        return pg

    @property
    def commits(self) -> int:
        return sum(w.commits for w in self.windows)

    @property
    def round_trips(self) -> int:
        return sum(w.round_trips for w in self.windows)


def proxied(url: str, port: int) -> str:
    """`url` through the counting proxy on 127.0.0.1:`port` (no TLS: the proxy reads it)."""
    parts = urlsplit(url)
    netloc = f"{parts.username}@127.0.0.1:{port}" if parts.username else f"127.0.0.1:{port}"
    query = "&".join(q for q in (parts.query, "sslmode=disable") if q)
    return urlunsplit(parts._replace(netloc=netloc, query=query))


@contextlib.contextmanager
def fresh_databases(dsn: str, given: list[str]) -> Iterator[list[str]]:
    """`given`, or a new database on `dsn`'s server (dropped afterwards)."""
    if given:
        yield given
        return
    name = f"acp_once_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield [urlunsplit(urlsplit(dsn)._replace(path=f"/{name}", query=""))]
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


async def migrate_all(stores: list[str]) -> None:
    """`acp-once db migrate` with every store URL as a `--store` option."""
    command = [*bench_load.acp_once_command(), "db", "migrate"]
    command += [arg for url in stores for arg in ("--store", url)]
    done = await anyio.run_process(command, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"acp-once db migrate failed: {done.stderr.decode()[-1000:]}")


async def kill_phase(
    transport: str, nodes: list[Any], lb: Any, stores: list[str], args: argparse.Namespace
) -> list[str]:
    """`--kill-clients` AcpClients through HAProxy while each node is killed in turn; the row
    of the kills table. The answers are compared with the store `stores` (several URLs: the
    store sharded over them, as the nodes open it)."""
    launcher = balancer.RecordingWs if transport == "ws" else balancer.RecordingHttp
    url = lb.ws if transport == "ws" else lb.http
    load = balancer.Load()
    started = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                AcpClient(launcher(url), backoff=Backoff(base=0.05, factor=2.0, cap=0.5))
            )
            for _ in range(args.kill_clients)
        ]
        async with anyio.create_task_group() as tg:
            for c, client in enumerate(clients):
                tg.start_soon(balancer.drive, client, load, f"{transport}{c}", 2, len(stores))
            with anyio.fail_after(600):
                await load.ready(len(clients))
                await balancer.kill_in_turn(nodes, lb, load, args.kill_step)
            load.stop.set()
            with anyio.move_on_after(60):  # what is still unanswered then counts as lost
                await until(lambda: not load.pending)
            tg.cancel_scope.cancel()
        reconnects = sum(client.reconnects for client in clients)
    seconds = time.perf_counter() - started
    async with open_store(stores, migrate=False) as store:
        found = await balancer.outcomes(store, load)
    return [
        transport,
        str(args.kill_clients),
        str(len(nodes)),
        f"{seconds:.1f}",
        str(found.answered),
        f"{found.answered / seconds:.0f}",
        str(reconnects),
        str(found.lost),
        str(found.duplicated),
        str(found.wrong),
        str(found.unasked),
    ]


async def behind_balancer(args: argparse.Namespace, console: Console) -> None:
    """Three nodes behind HAProxy: steady load, then kills (see the module docstring)."""
    balancer.haproxy_binary()
    bench_load.raise_fd_limit()
    bench_load.prepare_node_project(bench_load.LOAD_DIR)
    console.print(f"[bold]three nodes behind HAProxy[/bold]; {bench_load.load_average()}")
    steady: dict[tuple[str, str], list[list[float]]] = {
        (transport, route): [] for transport in ("ws", "http") for route in ("haproxy", "direct")
    }
    kills: list[list[str]] = []
    with (
        tempfile.TemporaryDirectory(prefix="acp-once-bench-") as tmp,
        fresh_databases(args.dsn, args.store) as stores,
    ):
        workdir = Path(tmp)
        await migrate_all(stores)
        async with contextlib.AsyncExitStack() as stack:
            urls, probes, counts = [], [], []
            for url in stores:
                parts = urlsplit(url)
                upstream = (parts.hostname or "127.0.0.1", parts.port or 5432)
                port, count = await stack.enter_async_context(bench_load.counting_proxy(upstream))
                urls.append(proxied(url, port))
                counts.append(count)
                probe = ShardProbe(url)
                stack.callback(probe.close)
                probes.append(probe)
            extra = (
                "--lease-ttl", str(args.lease_ttl), "--log-level", "warning",
                "--max-connections", str(4 * args.connections + 1000),
                "--forwarded-allow-ips", "127.0.0.1",
            )  # fmt: skip
            nodes = [
                balancer.StoreNode(workdir, urls, f"n{i + 1}", workdir / "effects", *extra)
                for i in range(3)
            ]
            for node in nodes:
                stack.push_async_callback(node.close)
            with anyio.fail_after(120):
                for node in nodes:
                    await node.start()
                for node in nodes:
                    await node.ready()
            lb = await stack.enter_async_context(
                balancer.balancer(workdir, [n.port for n in nodes])
            )
            for _ in range(args.rounds):
                for transport in ("ws", "http"):
                    for route in ("haproxy", "direct"):
                        pids = [n.process.pid for n in nodes if n.process is not None]
                        hosts = (
                            [f"127.0.0.1:{lb.port}"]
                            if route == "haproxy"
                            else [f"127.0.0.1:{n.port}" for n in nodes]
                        )
                        running = bench_load.Running(pids, hosts)
                        window = Window(probes, counts, lb.pid)
                        command = bench_load.client_command(
                            transport, running.urls(transport), args.connections, args
                        )
                        run = await bench_load.run_client(command, running, extra_cpu=window)
                        prompts = max(1, run.result["prompts"])
                        steady[transport, route].append(
                            [
                                run.result["promptsPerSecond"],
                                run.result["p99Ms"],
                                run.server_cpu / prompts * 1e6,
                                window.haproxy / prompts * 1e6,
                                run.extra_cpu / prompts * 1e6,
                                window.commits / prompts,
                                window.round_trips / prompts,
                            ]
                        )
                        console.print(
                            f"[dim]{transport} {route}: {run.result['promptsPerSecond']:.0f} "
                            f"prompts/s; {bench_load.load_average()}[/dim]"
                        )
            for transport in ("ws", "http"):
                kills.append(await kill_phase(transport, nodes, lb, stores, args))
                console.print(
                    f"[dim]kills over {transport} done; {bench_load.load_average()}[/dim]"
                )
    table = Table(
        title=f"three nodes behind HAProxy, {args.connections} connections, steady "
        f"(medians of {args.rounds} rounds; CPU in µs per prompt)"
    )
    for column in (
        "transport", "route", "prompts/s", "p99 ms", "nodes CPU", "HAProxy CPU",
        "PostgreSQL CPU", "transactions", "round trips",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for (transport, route), rows in steady.items():
        medians = [statistics.median(column) for column in zip(*rows, strict=True)]
        table.add_row(
            transport,
            route,
            f"{medians[0]:.0f}",
            f"{medians[1]:.1f}",
            f"{medians[2]:.0f}",
            f"{medians[3]:.0f}",
            f"{medians[4]:.0f}",
            f"{medians[5]:.2f}",
            f"{medians[6]:.2f}",
        )
    console.print(table)
    table = Table(title="each node SIGKILLed and restarted in turn under keyed AcpClient load")
    for column in (
        "transport", "clients", "kills", "seconds", "answered", "prompts/s", "reconnects",
        "lost", "duplicated", "wrong ids", "unasked",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for row in kills:
        table.add_row(*row)
    console.print(table)
    console.print(f"load average at end: {bench_load.load_average()}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=600, help="prompts per round")
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", default="1,2,3")
    parser.add_argument("--dsn", default=os.environ.get("ACP_ONCE_TEST_POSTGRES_DSN", DEFAULT_DSN))
    parser.add_argument("--in-process", action="store_true", help="one node, in this process")
    parser.add_argument("--balancer", action="store_true", help="three nodes behind HAProxy")
    parser.add_argument(
        "--store",
        action="append",
        default=[],
        help="with --balancer: a store URL passed to every node (repeatable; default: a fresh "
        "database on --dsn's server)",
    )
    parser.add_argument("--connections", type=int, default=20, help="with --balancer")
    parser.add_argument("--warmup", type=float, default=2.0, help="with --balancer, seconds")
    parser.add_argument("--duration", type=float, default=5.0, help="with --balancer, seconds")
    parser.add_argument("--lease-ttl", type=float, default=2.0, help="with --balancer")
    parser.add_argument("--kill-clients", type=int, default=8, help="with --balancer")
    parser.add_argument("--kill-step", type=int, default=40, help="with --balancer")
    args = parser.parse_args()
    console = Console()
    if args.balancer:
        await behind_balancer(args, Console(width=None if sys.stdout.isatty() else 170))
        return
    if args.in_process:
        console.print(f"load average at start: {os.getloadavg()[0]:.2f}")
        await in_process(args, console)
        console.print(f"load average at end: {os.getloadavg()[0]:.2f}")
        return
    console.print(
        f"{args.n} prompts per round over {args.sessions} sessions, median of {args.rounds}"
        f" rounds; load average at start: {os.getloadavg()[0]:.2f}"
    )
    table = Table(title="prompts accepted per second (one PostgreSQL, WebSocket clients)")
    for column in ("nodes", "unkeyed /s", "keyed /s", "keyed vs unkeyed"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory(prefix="acp-once-bench-") as tmp:
        for count in (int(x) for x in args.nodes.split(",")):
            async with (
                cluster(args.dsn, count, Path(tmp)) as urls,
                clients(urls, args.sessions) as conns,
            ):
                await run_round(conns, max(args.sessions, args.n // 5), keyed=True)  # warm up
                rates: dict[bool, list[float]] = {False: [], True: []}
                for _ in range(args.rounds):
                    for keyed in (False, True):
                        rates[keyed].append(await run_round(conns, args.n, keyed))
            unkeyed = statistics.median(rates[False])
            keyed_rate = statistics.median(rates[True])
            table.add_row(
                str(count),
                f"{unkeyed:.0f}",
                f"{keyed_rate:.0f}",
                f"{(keyed_rate / unkeyed - 1) * 100:+.1f}%",
            )
            console.print(f"{count} node(s): unkeyed {rates[False]}, keyed {rates[True]}")
    console.print(table)
    console.print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    anyio.run(main)
