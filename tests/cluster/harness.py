"""Cluster nodes for tests: in-process (`node`), each with its own pool, and helpers."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx

from acp_once.agent.reference import ReferenceAgent
from acp_once.agent.runtime import HeldPolicy
from acp_once.client.connection import ClientSideConnection
from acp_once.cluster import PostgresCoordinator
from acp_once.protocol import schema as s
from acp_once.storage.postgres import PostgresStore
from tests.helpers import initialize_request


@dataclass
class Node:
    name: str
    store: PostgresStore
    coordinator: PostgresCoordinator
    agent: ReferenceAgent


@asynccontextmanager
async def node(
    dsn: str,
    schema: str,
    name: str,
    effects: Path,
    *,
    lease_ttl: float = 2.0,
    lease_grace: float | None = None,
    poll_interval: float = 0.2,
    max_size: int = 4,
    policy: HeldPolicy = "hold",
) -> AsyncIterator[Node]:
    """The reference agent as one cluster node on `schema`, with a pool of its own."""
    async with PostgresStore.open(dsn, schema=schema, max_size=max_size) as store:
        coordinator = PostgresCoordinator(
            store,
            node_id=name,
            lease_ttl=lease_ttl,
            lease_grace=lease_grace,
            poll_interval=poll_interval,
        )
        agent = ReferenceAgent(store, side_effects=effects, policy=policy)
        agent.use_coordinator(coordinator)
        async with agent:
            yield Node(name, store, coordinator, agent)


async def initialize(conn: ClientSideConnection) -> None:
    await conn.agent.initialize(initialize_request("t"))


def prompt_params(sid: str, text: str, key: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}
    if key is not None:
        params["idempotencyKey"] = key
    return params


async def prompt(conn: ClientSideConnection, sid: str, text: str, key: str | None) -> str:
    result = await conn.rpc.request("session/prompt", prompt_params(sid, text, key))
    return str(result["messageId"])


async def resume(conn: ClientSideConnection, sid: str) -> None:
    await conn.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/w"))


async def new_session(conn: ClientSideConnection) -> str:
    return (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id


def store_url(dsn: str, schema: str) -> str:
    return f"{dsn}{'&' if '?' in dsn else '?'}schema={schema}"


class ServeNode:
    """`acp-once serve --store postgresql://...?schema=X --node-id NAME` as a real subprocess,
    on a listening socket the harness keeps across restarts (`--fd`): `kill()` sends SIGKILL,
    `start()` starts a new instance of the node on the same port."""

    def __init__(
        self, tmp: Path, dsn: str, schema: str, name: str, effects: Path, *extra: str
    ) -> None:
        self.tmp = tmp
        self.url = store_url(dsn, schema)
        self.name = name
        self.effects = effects
        self.extra = extra
        self.sock = listening_socket()
        self.port: int = self.sock.getsockname()[1]
        self.process: anyio.abc.Process | None = None
        self.starts = 0

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/acp"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        assert self.process is None or self.process.returncode is not None
        fd = self.sock.fileno()
        command = [
            sys.executable, "-m", "acp_once", "serve", "--store", self.url,
            "--node-id", self.name, "--side-effects", str(self.effects), "--fd", str(fd),
            "--log-level", "info", *self.extra,
        ]  # fmt: skip
        with open(self.tmp / f"{self.name}.stderr", "ab") as log:  # noqa: ASYNC230
            self.process = await anyio.open_process(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(fd,)
            )
        self.starts += 1

    async def kill(self) -> None:
        """SIGKILL the node and wait until it has exited."""
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()

    async def ready(self) -> None:
        """Poll `/healthz` until it answers (bound it with the caller's fail_after)."""
        async with httpx.AsyncClient() as http:
            while True:
                try:
                    if (await http.get(f"{self.http}/healthz", timeout=2)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await anyio.sleep(0.05)

    def log(self) -> str:
        path = self.tmp / f"{self.name}.stderr"
        return path.read_text(errors="replace") if path.exists() else ""

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.kill()
        self.sock.close()


@asynccontextmanager
async def serve_nodes(
    tmp: Path, dsn: str, schema: str, count: int, *extra: str
) -> AsyncIterator[list[ServeNode]]:
    """`count` nodes `n1`...`nN` sharing `schema` and one side-effect directory, ready."""
    effects = tmp / "effects"
    nodes = [ServeNode(tmp, dsn, schema, f"n{i + 1}", effects, *extra) for i in range(count)]
    try:
        # the first node migrates the schema; the others start once it answers
        await nodes[0].start()
        await nodes[0].ready()
        for n in nodes[1:]:
            await n.start()
        for n in nodes[1:]:
            await n.ready()
        yield nodes
    except BaseException:
        # a failing test reports what each node did: pytest deletes old temporary directories,
        # and with them the logs (an interrupted turn never run again: 3 of 24 runs, 2026-12-03)
        for n in nodes:
            print(f"--- node {n.name}, end of its log ---\n{n.log()[-20_000:]}", file=sys.stderr)
        raise
    finally:
        for n in nodes:
            await n.close()


def listening_socket() -> socket.socket:
    """A TCP socket listening on a free port of 127.0.0.1."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def until(predicate: Callable[[], bool], interval: float = 0.02) -> None:
    """Poll `predicate` until it holds (state in another node or process; bounded by the
    caller's fail_after)."""
    while True:
        if predicate():
            return
        await anyio.sleep(interval)


async def until_async(predicate: Callable[[], Awaitable[bool]], interval: float = 0.05) -> None:
    """`until` for a predicate that asks the database."""
    while True:
        if await predicate():
            return
        await anyio.sleep(interval)
