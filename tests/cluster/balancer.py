"""HAProxy in front of `acp-once serve` nodes, for tests and benchmarks: a real `haproxy`
process (Debian's package) run with the documented configuration, examples/haproxy.cfg, whose
addresses are replaced by the test's (the frontend's inherited listening socket, the nodes'
ports) and to which a stats socket is added (`Balancer.servers` reads it).

Also the keyed load through it (`drive`: `AcpClient`s sending prompts back to back), the node
kills in turn (`kill_in_turn`) and the comparison of what the clients were answered with what
the store holds (`outcomes`), shared by tests/cluster/test_balancer.py and
benchmarks/bench_cluster.py."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest

from acp_once.client import AcpClient, HttpLauncher, WebSocketLauncher
from acp_once.protocol.keys import new_key
from acp_once.rpc.streams import FrameStream
from acp_once.storage import open_store
from acp_once.storage.base import SessionStore
from acp_once.storage.sharded import shard_of
from tests.cluster.harness import ServeNode, until, until_async

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "haproxy.cfg"
FRONT = "127.0.0.1:8700"
"""The frontend address in examples/haproxy.cfg."""
NODES = {"n1": "127.0.0.1:8701", "n2": "127.0.0.1:8702", "n3": "127.0.0.1:8703"}
"""The nodes in examples/haproxy.cfg: node id -> address."""


def haproxy_binary() -> str:
    """The `haproxy` executable; skips without one, and fails instead when CI is "true" (.ci/run
    installs Debian's package)."""
    found = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)),
        None,
    )
    if found is None:
        reason = "haproxy is not installed (apt-get install haproxy)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true requires the load balancer tests: {reason}")
        pytest.skip(reason)
    return found


def render(front_fd: int, ports: Sequence[int], stats: Path) -> str:
    """examples/haproxy.cfg with the frontend on the inherited socket `front_fd`, node nK on
    127.0.0.1:`ports[K-1]` and an admin stats socket at `stats`; nothing else changes."""
    if len(ports) != len(NODES):
        raise ValueError(f"the example configures {len(NODES)} nodes")
    config = EXAMPLE.read_text(encoding="utf-8")
    replacements = {f"bind {FRONT}\n": f"bind fd@{front_fd}\n"}
    for (name, address), port in zip(NODES.items(), ports, strict=True):
        replacements[f"server {name} {address}\n"] = f"server {name} 127.0.0.1:{port}\n"
    replacements["global\n"] = f"global\n    stats socket {stats} mode 600 level admin\n"
    for old, new in replacements.items():
        if config.count(old) != 1:
            raise ValueError(f"examples/haproxy.cfg: expected {old!r} once")
        config = config.replace(old, new)
    return config


class Balancer:
    """A running haproxy (see `balancer`)."""

    def __init__(self, port: int, stats: Path, pid: int) -> None:
        self.port = port
        self.stats = stats
        self.pid = pid

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/acp"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}/acp"

    async def servers(self) -> dict[str, str]:
        """Each server's state as haproxy sees it now ("UP", "DOWN", ...), by name."""
        stream = await anyio.connect_unix(str(self.stats))
        async with stream:
            await stream.send(b"show stat\n")
            chunks = []
            with anyio.fail_after(5):
                while True:
                    try:
                        chunks.append(await stream.receive())
                    except anyio.EndOfStream:
                        break
        lines = b"".join(chunks).decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        name, status = header.index("svname"), header.index("status")
        return {
            row[name]: row[status].split()[0]
            for row in (line.split(",") for line in lines[1:] if line)
            if row[0] == "nodes" and row[name] not in ("FRONTEND", "BACKEND")
        }

    async def until(self, name: str, state: str) -> None:
        """Wait until haproxy sees server `name` in `state` (bound it with fail_after): its
        health checks on /healthz decide."""

        async def seen() -> bool:
            return (await self.servers()).get(name) == state

        await until_async(seen)


@asynccontextmanager
async def balancer(tmp: Path, ports: Sequence[int]) -> AsyncIterator[Balancer]:
    """haproxy with the documented configuration in front of nodes n1..n3 on `ports`, once it
    answers and sees every node UP; stopped (SIGKILL) on exit."""
    binary = haproxy_binary()
    front = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    front.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    front.bind(("127.0.0.1", 0))
    front.listen(512)
    stats = tmp / "haproxy.sock"
    short: Path | None = None
    if len(str(stats)) > 100:  # a UNIX socket's path has at most 107 bytes
        short = Path(tempfile.mkdtemp(prefix="acp-lb-"))
        stats = short / "haproxy.sock"
    config = tmp / "haproxy.cfg"
    config.write_text(render(front.fileno(), ports, stats), encoding="utf-8")
    log = tmp / "haproxy.log"
    process: anyio.abc.Process | None = None
    try:
        with open(log, "ab") as out:  # noqa: ASYNC230
            # -db: in the foreground, not as a daemon (its exit ends the test's fixture)
            process = await anyio.open_process(
                [binary, "-db", "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                pass_fds=(front.fileno(),),
            )
        lb = Balancer(front.getsockname()[1], stats, process.pid)
        with anyio.fail_after(30):
            while not stats.exists():
                if process.returncode is not None:
                    raise RuntimeError(f"haproxy exited: {log.read_text(errors='replace')}")
                await anyio.sleep(0.05)
            for name in NODES:
                await lb.until(name, "UP")
            async with httpx.AsyncClient() as http:

                async def answers() -> bool:
                    response = await http.get(f"http://127.0.0.1:{lb.port}/healthz")
                    return response.status_code == 200

                await until_async(answers)
        yield lb
    finally:
        front.close()
        if process is not None:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                await process.wait()
        if short is not None:
            shutil.rmtree(short, ignore_errors=True)


class StoreNode(ServeNode):
    """A `ServeNode` on the store URL(s) given as they are: `stores[0]` as its `--store`, and
    each further one as one more `--store` option (sessions sharded over several databases)."""

    def __init__(
        self, tmp: Path, stores: Sequence[str], name: str, effects: Path, *extra: str
    ) -> None:
        more = [arg for url in stores[1:] for arg in ("--store", url)]
        super().__init__(tmp, stores[0], "unused", name, effects, *more, *extra)
        self.url = stores[0]


@asynccontextmanager
async def started_nodes(
    tmp: Path, stores: Sequence[str], count: int, *extra: str
) -> AsyncIterator[list[ServeNode]]:
    """`count` nodes `n1`...`nN` on the store URLs `stores` (several: sessions sharded over
    them; migrated here first, so the nodes start at once rather than one after the other as
    `harness.serve_nodes` does), ready."""
    async with open_store(list(stores)):
        pass
    effects = tmp / "effects"
    nodes: list[ServeNode] = [
        StoreNode(tmp, stores, f"n{i + 1}", effects, *extra) for i in range(count)
    ]
    try:
        for node in nodes:
            await node.start()
        for node in nodes:
            await node.ready()
        yield nodes
    except BaseException:
        for node in nodes:  # what each node did, before pytest deletes the directory
            print(f"--- node {node.name} ---\n{node.log()[-20_000:]}", file=sys.stderr)
        raise
    finally:
        for node in nodes:
            await node.close()


def connection_node(connection_id: str) -> str | None:
    """The node id an `Acp-Connection-Id` begins with (`n1.…` -> "n1"), or None."""
    match = re.fullmatch(r"([A-Za-z0-9_-]+)\.[0-9a-f]{32}", connection_id)
    return match.group(1) if match else None


# -- keyed load through the balancer, node kills, outcomes -------------------------------------


class RecordingWs(WebSocketLauncher):
    """A `WebSocketLauncher` noting the `Acp-Connection-Id` of every connection it opened."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.ids: list[str] = []

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[FrameStream]:
        async with super().connect() as frames:
            try:
                yield frames
            finally:
                if self.current is not None and self.current.connection_id:
                    self.ids.append(self.current.connection_id)


class RecordingHttp(HttpLauncher):
    """An `HttpLauncher` noting the `Acp-Connection-Id` of every connection it opened."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.ids: list[str] = []

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[FrameStream]:
        async with super().connect() as frames:
            try:
                yield frames
            finally:
                if self.current is not None and self.current.connection_id:
                    self.ids.append(self.current.connection_id)


@dataclass
class Load:
    """What the clients sent and were answered."""

    answered: list[tuple[str, str, str]] = field(default_factory=list)
    """(session, key, messageId) per answered submission."""
    pending: dict[str, str] = field(default_factory=dict)
    """key -> session of each submission sent and not answered yet."""
    stop: anyio.Event = field(default_factory=anyio.Event)
    clients_ready: int = 0
    """Clients that have opened all their sessions (`drive`): `session/new` is not resent
    after a lost answer, so nodes are killed only once every client is past it."""

    async def ready(self, clients: int) -> None:
        """Wait until `clients` clients opened their sessions (bound it with fail_after)."""
        await until(lambda: self.clients_ready >= clients)

    async def progress(self, step: int) -> None:
        """Wait until `step` more prompts were answered (bound it with fail_after)."""
        target = len(self.answered) + step
        await until(lambda: len(self.answered) >= target)


async def drive(client: AcpClient, load: Load, tag: str, sessions: int, shards: int = 1) -> None:
    """Keyed prompts back to back on `sessions` new sessions of `client` until `load.stop`;
    every fourth is slow (`[work:0.3]`), so prompts also arrive while a turn runs and wait in
    the cluster's queue. With `shards` > 1, session k is one placed on shard k % `shards`
    (`shard_of`): new sessions are opened until one lands there, the others stay unused, so
    the load reaches every shard whatever ids the nodes draw."""
    opened = []
    for k in range(sessions):
        while True:
            session = await client.new_session("/lb")
            if shard_of(session.session_id, shards) == k % shards:
                break
        opened.append(session)
    load.clients_ready += 1

    async def one(index: int) -> None:
        session = opened[index]
        i = 0
        while not load.stop.is_set():
            text = f"{tag}.{index} #{i}" + (" [work:0.3]" if i % 4 == 3 else "")
            key = new_key()
            load.pending[key] = session.session_id
            message_id = await session.prompt(text, idempotency_key=key)
            del load.pending[key]
            load.answered.append((session.session_id, key, message_id))
            i += 1

    async with anyio.create_task_group() as tg:
        for k in range(sessions):
            tg.start_soon(one, k)


async def kill_in_turn(nodes: Sequence[ServeNode], lb: Balancer, load: Load, step: int) -> None:
    """For each node in turn: once haproxy sees another node UP, let `step` prompts be
    answered, SIGKILL it, wait until haproxy sees it DOWN, start it again and let `step` more
    be answered (by the others, while it starts). At the end, wait until every node answers
    and haproxy sees it UP.

    A restarting node is not waited for before the next kill: a start takes seconds on a
    loaded machine, and the others serve meanwhile; so two nodes may be down at once, never
    all of them."""
    for node in nodes:

        async def other_up(killed: ServeNode = node) -> bool:
            seen = await lb.servers()
            return any(seen.get(n.name) == "UP" for n in nodes if n is not killed)

        await until_async(other_up)
        await load.progress(step)
        await node.kill()
        # once haproxy saw it down, new connections and resends go to the other nodes
        await lb.until(node.name, "DOWN")
        await node.start()  # starting takes a while: the others serve meanwhile
        await load.progress(step)
    for node in nodes:
        await node.ready()
        await lb.until(node.name, "UP")


@dataclass
class Outcomes:
    """What the clients were answered, compared with what the store holds."""

    answered: int
    sessions: int
    lost: int
    """Submissions never answered, or answered with an id the store does not hold for the key."""
    duplicated: int
    """Extra user messages beyond one per key."""
    wrong: int
    """Answers whose messageId is not the one stored for their key."""
    unasked: int
    """User messages in the sessions beyond the answered and pending submissions."""


async def outcomes(store: SessionStore, load: Load) -> Outcomes:
    """Compare `load` with `store` (see `Outcomes`)."""
    per_session: dict[str, int] = {}
    lost = duplicated = wrong = 0
    for session_id, key, message_id in load.answered:
        per_session[session_id] = per_session.get(session_id, 0) + 1
        found = await store.find_key(session_id, key)
        if found is None:
            lost += 1
        elif found.message_id != message_id:
            wrong += 1
        duplicated += max(0, await store.count_user_messages(session_id, idempotency_key=key) - 1)
    for key, session_id in load.pending.items():
        lost += 1
        per_session[session_id] = per_session.get(session_id, 0)
        found = await store.find_key(session_id, key)
        if found is not None:  # inserted, its answer never came: not asked for twice
            per_session[session_id] += 1
    unasked = 0
    for session_id, expected in per_session.items():
        unasked += max(0, await store.count_user_messages(session_id) - expected)
    unique = len({(sid, mid) for sid, _, mid in load.answered})
    return Outcomes(
        answered=len(load.answered),
        sessions=len(per_session),
        lost=lost,
        duplicated=duplicated + len(load.answered) - unique,
        wrong=wrong,
        unasked=unasked,
    )
