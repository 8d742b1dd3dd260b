"""Nodes of a cluster whose sessions are sharded over two PostgreSQL servers: every node
serves every shard, each session's lease, queue and keys live on its own shard, and
`session/list` shows the sessions of both."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import psycopg
import pytest

from acp_once.agent.reference import ReferenceAgent
from acp_once.client import Client, ClientSideConnection
from acp_once.cluster import ShardedCoordinator
from acp_once.storage.postgres import parse_postgres_url
from acp_once.storage.postgres.shards import open_shards
from acp_once.storage.sharded import ShardedStore, shard_of
from acp_once.testing import connected
from acp_once.transports.websocket import connect_websocket
from tests.cluster.harness import (
    ServeNode,
    initialize,
    new_session,
    prompt,
    resume,
    until,
)
from tests.helpers import UpdateRecorder
from tests.sharding import postgres_dsn2, shard_urls

__all__ = ["postgres_dsn2", "shard_urls"]  # fixtures of tests.sharding, used here

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT = 30


@dataclass
class ShardedNode:
    name: str
    store: ShardedStore
    coordinator: ShardedCoordinator
    agent: ReferenceAgent


@asynccontextmanager
async def sharded_node(urls: list[str], name: str, effects: Path) -> AsyncIterator[ShardedNode]:
    """The reference agent as one node of the sharded cluster, with pools of its own."""
    async with open_shards(urls, max_size=3) as store:
        coordinator = ShardedCoordinator(store, node_id=name, lease_ttl=2.0, poll_interval=0.2)
        agent = ReferenceAgent(store, side_effects=effects)
        agent.use_coordinator(coordinator)
        async with agent:
            yield ShardedNode(name, store, coordinator, agent)


async def one_session_per_shard(
    conn: ClientSideConnection, made: list[str] | None = None
) -> list[str]:
    """New sessions until one lives on each of the two shards: [on shard 0, on shard 1]
    (every session made is appended to `made`)."""
    found: dict[int, str] = {}
    for _ in range(64):  # a miss on either shard 64 times in a row: 2**-63
        sid = await new_session(conn)
        if made is not None:
            made.append(sid)
        found.setdefault(shard_of(sid, 2), sid)
        if len(found) == 2:
            return [found[0], found[1]]
    raise AssertionError("64 new sessions, all on one shard")


async def send(
    results: dict[str, str],
    conn: ClientSideConnection,
    sid: str,
    label: str,
    text: str,
    key: str,
) -> None:
    results[label] = await prompt(conn, sid, text, key)


def saw(recorder: UpdateRecorder, sid: str, text: str) -> bool:
    """Whether `recorder` got an agent message `text` on session `sid`."""
    return any(
        n["sessionId"] == sid
        and n["update"]["sessionUpdate"] == "agent_message"
        and n["update"]["content"][0]["text"] == text
        for n in recorder.notifications
    )


def leases_in(url: str) -> set[str]:
    """The sessions with a lease row in the shard `url` (its own database)."""
    dsn, schema = parse_postgres_url(url)
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            psycopg.sql.SQL("SELECT session_id FROM {}").format(
                psycopg.sql.Identifier(schema, "session_leases")
            )
        ).fetchall()
    return {row[0] for row in rows}


async def test_two_nodes_serve_sessions_on_both_shards(
    shard_urls: Callable[[], list[str]], tmp_path: Path
) -> None:
    urls = shard_urls()
    recorder_b = UpdateRecorder()
    with anyio.fail_after(TIMEOUT):
        async with (
            sharded_node(urls, "a", tmp_path / "fx") as a,
            sharded_node(urls, "b", tmp_path / "fx") as b,
            connected(a.agent) as conn_a,
            connected(b.agent, recorder_b) as conn_b,
        ):
            await initialize(conn_a)
            await initialize(conn_b)
            sessions = await one_session_per_shard(conn_a)
            for index, sid in enumerate(sessions):
                await resume(conn_b, sid)
                first = await prompt(conn_a, sid, "[work:1] first", "k1")
                # A holds the lease on this session's shard, and on that shard only
                assert sid in a.coordinator.coordinators[index].leases
                assert sid not in a.coordinator.coordinators[1 - index].leases
                results: dict[str, str] = {}
                shard = a.coordinator.coordinators[index]
                on_b = functools.partial(saw, recorder_b, sid, "third")

                async with anyio.create_task_group() as tg:
                    tg.start_soon(send, results, conn_a, sid, "second@a", "second", "k2")
                    # held behind A's turn, queued in this shard's prompt queue
                    await until(functools.partial(bool, shard._waiting))
                    tg.start_soon(send, results, conn_b, sid, "second@b", "second", "k2")
                    tg.start_soon(send, results, conn_b, sid, "third@b", "third", "k3")
                assert results["second@a"] == results["second@b"]
                assert len(set(results.values()) | {first}) == 3
                # a keyed retry on the other node answers the recorded id
                assert await prompt(conn_b, sid, "[work:1] first", "k1") == first
                assert await a.store.count_user_messages(sid) == 3
                for key in ("k1", "k2", "k3"):
                    assert await b.store.count_user_messages(sid, idempotency_key=key) == 1
                # B's client saw A's turns on this session
                await recorder_b.wait_for(lambda _: on_b())  # noqa: B023 - awaited right here
            # each lease row is in its own session's shard, never in the other
            assert leases_in(urls[0]) == {sessions[0]}
            assert leases_in(urls[1]) == {sessions[1]}
            # the same key in both sessions, on two shards: two messages
            assert await b.store.find_key(sessions[0], "k1") != await b.store.find_key(
                sessions[1], "k1"
            )
            for n in recorder_b.notifications:  # keys never travel in updates
                assert "idempotencyKey" not in json.dumps(n)
            status = await a.coordinator.status({})
            assert {(row["node"], row["shard"]) for row in status["nodes"]} == {
                ("a", 1), ("a", 2), ("b", 1), ("b", 2),
            }  # fmt: skip


async def test_session_list_on_any_node_merges_the_shards(
    shard_urls: Callable[[], list[str]], tmp_path: Path
) -> None:
    urls = shard_urls()
    with anyio.fail_after(TIMEOUT):
        async with (
            sharded_node(urls, "a", tmp_path / "fx") as a,
            sharded_node(urls, "b", tmp_path / "fx") as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            await initialize(conn_a)
            await initialize(conn_b)
            made: list[str] = []
            await one_session_per_shard(conn_a, made)
            made += [await new_session(conn_a) for _ in range(5)]
            listed: list[str] = []
            cursor: str | None = None
            while True:
                params: dict[str, object] = {"cwd": "/w"}
                if cursor is not None:
                    params["cursor"] = cursor
                answer = await conn_b.rpc.request("session/list", params)
                listed.extend(entry["sessionId"] for entry in answer["sessions"])
                cursor = answer.get("nextCursor")
                if cursor is None:
                    break
            assert sorted(listed) == sorted(made)
            assert len(listed) == len(set(listed))


@asynccontextmanager
async def ws(node: ServeNode, sid: str | None = None) -> AsyncIterator[ClientSideConnection]:
    async with (
        connect_websocket(node.ws, open_timeout=2, ping_interval=None) as frames,
        ClientSideConnection(Client(), frames) as conn,
    ):
        await initialize(conn)
        if sid is not None:
            await resume(conn, sid)
        yield conn


@pytest.mark.slow
async def test_serve_with_two_stores_is_a_sharded_cluster(
    shard_urls: Callable[[], list[str]], postgres_dsn: str, tmp_path: Path
) -> None:
    """`acp-once serve --store URL1 --store URL2`, two real processes: sessions on both
    shards, a keyed prompt sent to one node and retried on the other is inserted once."""
    urls = shard_urls()
    dsn, schema = parse_postgres_url(urls[0])
    effects = tmp_path / "effects"
    nodes = [
        ServeNode(tmp_path, dsn, schema, name, effects, "--store", urls[1]) for name in ("n1", "n2")
    ]
    try:
        with anyio.fail_after(TIMEOUT):
            await nodes[0].start()
            await nodes[0].ready()
            await nodes[1].start()
            await nodes[1].ready()
            async with ws(nodes[0]) as conn:
                sessions = await one_session_per_shard(conn)
            for sid in sessions:
                async with ws(nodes[0], sid) as one, ws(nodes[1], sid) as two:
                    first = await prompt(one, sid, "hello", "key-1")
                    assert await prompt(two, sid, "hello", "key-1") == first
                    second = await prompt(two, sid, "again", "key-2")
                    assert second != first
                    assert await prompt(one, sid, "again", "key-2") == second
            async with open_shards(urls, migrate=False) as store:
                for index, sid in enumerate(sessions):
                    assert store.shard(sid) is store.shards[index]
                    assert await store.count_user_messages(sid) == 2
                    assert await store.count_user_messages(sid, idempotency_key="key-1") == 1
    except BaseException:
        for n in nodes:
            print(f"--- node {n.name} ---\n{n.log()[-20_000:]}")
        raise
    finally:
        for n in nodes:
            await n.close()
