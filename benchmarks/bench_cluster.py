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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from rich.console import Console
from rich.table import Table

from acp_once.agent.reference import ReferenceAgent
from acp_once.client import Client, ClientSideConnection
from acp_once.cluster import PostgresCoordinator
from acp_once.protocol import schema as s
from acp_once.storage.postgres import PostgresStore
from acp_once.testing import connected
from acp_once.transports.websocket import connect_websocket

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


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=600, help="prompts per round")
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", default="1,2,3")
    parser.add_argument("--dsn", default=os.environ.get("ACP_ONCE_TEST_POSTGRES_DSN", DEFAULT_DSN))
    parser.add_argument("--in-process", action="store_true", help="one node, in this process")
    args = parser.parse_args()
    console = Console()
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
