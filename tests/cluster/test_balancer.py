"""Three `acp-once serve` nodes on one PostgreSQL behind a real HAProxy (examples/haproxy.cfg:
round-robin without stickiness, health checks on /healthz, Streamable HTTP routed by the node
id that begins `Acp-Connection-Id`), each node killed in turn (SIGKILL, then restarted) while
several `AcpClient`s send keyed prompts through the balancer, over WebSocket and over HTTP.

At the end, compared with what the store holds: every submission was answered (0 lost), its
key has one user message (0 duplicated), and that message's id is the one every answer for it
carried (0 wrong ids); no user message exists that no submission asked for.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import anyio
import pytest

from acp_once.client import AcpClient, HttpLauncher, WebSocketLauncher
from acp_once.protocol.keys import new_key
from acp_once.rpc.streams import FrameStream
from acp_once.storage.postgres import PostgresStore
from acp_once.support.backoff import Backoff
from tests.cluster.balancer import Balancer, balancer, connection_node, haproxy_binary
from tests.cluster.harness import ServeNode, serve_nodes, until

pytestmark = [pytest.mark.anyio, pytest.mark.postgres, pytest.mark.slow]

CLIENTS = 4
SESSIONS_PER_CLIENT = 2
STEP = 12
"""Prompts answered between two chaos steps (before a kill, while the node is down)."""
LEASE_TTL = "1.5"
"""Seconds before a killed node's sessions are taken over (the default, 10, is for real use)."""


class _Recording:
    """Notes the `Acp-Connection-Id` of every connection its launcher opened."""

    ids: list[str]

    def note(self, current: object) -> None:
        connection_id = getattr(current, "connection_id", None)
        if connection_id:
            self.ids.append(connection_id)


class RecordingWs(WebSocketLauncher, _Recording):
    def __init__(self, url: str) -> None:
        super().__init__(url, open_timeout=5)
        self.ids = []

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[FrameStream]:
        async with super().connect() as frames:
            try:
                yield frames
            finally:
                self.note(self.current)


class RecordingHttp(HttpLauncher, _Recording):
    def __init__(self, url: str) -> None:
        super().__init__(url, timeout=5)
        self.ids = []

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[FrameStream]:
        async with super().connect() as frames:
            try:
                yield frames
            finally:
                self.note(self.current)


@dataclass
class Load:
    """What the clients were answered: (session, key, messageId) per submission."""

    answered: list[tuple[str, str, str]] = field(default_factory=list)
    stop: anyio.Event = field(default_factory=anyio.Event)


async def drive(client: AcpClient, load: Load, tag: str) -> None:
    """Keyed prompts back to back on new sessions until `load.stop`; every few is slow, so
    prompts also arrive while a turn runs and wait in the cluster's queue."""
    sessions = [await client.new_session("/lb") for _ in range(SESSIONS_PER_CLIENT)]

    async def one(session_index: int) -> None:
        session = sessions[session_index]
        i = 0
        while not load.stop.is_set():
            text = f"{tag}.{session_index} #{i}" + (" [work:0.3]" if i % 4 == 3 else "")
            key = new_key()
            message_id = await session.prompt(text, idempotency_key=key)
            load.answered.append((session.session_id, key, message_id))
            i += 1

    async with anyio.create_task_group() as tg:
        for k in range(SESSIONS_PER_CLIENT):
            tg.start_soon(one, k)


async def progress(load: Load) -> None:
    """Wait until STEP more prompts were answered (bounded by the caller's fail_after)."""
    target = len(load.answered) + STEP
    await until(lambda: len(load.answered) >= target)


async def kill_in_turn(nodes: list[ServeNode], lb: Balancer, load: Load) -> None:
    """For each node: let STEP prompts be answered, SIGKILL it, let STEP more be answered by the
    others, start it again and wait until haproxy sees it UP."""
    for node in nodes:
        await progress(load)
        await node.kill()
        await progress(load)
        await node.start()
        await node.ready()
        await lb.until(node.name, "UP")


@pytest.mark.parametrize("transport", ["ws", "http"])
async def test_nodes_killed_in_turn_behind_haproxy_lose_and_duplicate_nothing(
    postgres_dsn: str, schema: str, tmp_path: Path, transport: Literal["ws", "http"]
) -> None:
    haproxy_binary()  # fails under CI=true when missing, before anything starts
    extra = ("--lease-ttl", LEASE_TTL)
    load = Load()
    with anyio.fail_after(120):
        async with (
            serve_nodes(tmp_path, postgres_dsn, schema, 3, *extra) as nodes,
            balancer(tmp_path, [n.port for n in nodes]) as lb,
            AsyncExitStack() as stack,
        ):
            launchers: list[RecordingWs | RecordingHttp] = [
                RecordingWs(lb.ws) if transport == "ws" else RecordingHttp(lb.http)
                for _ in range(CLIENTS)
            ]
            clients = [
                await stack.enter_async_context(
                    AcpClient(launcher, backoff=Backoff(base=0.05, factor=2.0, cap=0.5))
                )
                for launcher in launchers
            ]
            async with anyio.create_task_group() as tg:
                for c, client in enumerate(clients):
                    tg.start_soon(drive, client, load, f"c{c}")
                # before any kill, every client kept its first connection: over HTTP each
                # POST and GET of a connection reached the node holding it
                await progress(load)
                assert [client.reconnects for client in clients] == [0] * CLIENTS
                await kill_in_turn(nodes, lb, load)
                load.stop.set()
            reconnects = sum(client.reconnects for client in clients)

    assert [n.starts for n in nodes] == [2, 2, 2]
    assert reconnects > 0  # the kills reached the clients
    ids = [cid for launcher in launchers for cid in launcher.ids]
    served = {connection_node(cid) for cid in ids}
    assert None not in served, ids
    assert served == {"n1", "n2", "n3"}  # round-robin: new connections landed on every node

    async with PostgresStore.open(postgres_dsn, schema=schema, migrate=False) as store:
        by_session: dict[str, int] = {}
        wrong, duplicated = [], []
        for session_id, key, message_id in load.answered:
            by_session[session_id] = by_session.get(session_id, 0) + 1
            found = await store.find_key(session_id, key)
            if found is None or found.message_id != message_id:
                wrong.append((session_id, message_id, found))
            if await store.count_user_messages(session_id, idempotency_key=key) != 1:
                duplicated.append((session_id, message_id))
        stored = {sid: await store.count_user_messages(sid) for sid in by_session}
    assert len(by_session) == CLIENTS * SESSIONS_PER_CLIENT
    assert wrong == [] and duplicated == []
    # nothing inserted that no client was answered for, nothing answered twice
    assert stored == by_session
    assert len({(sid, mid) for sid, _, mid in load.answered}) == len(load.answered)
