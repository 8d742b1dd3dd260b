"""A keyed prompt whose connection closes while its write waits in group commit still ends.

The trace (issue 28, bug 1): another write holds the group-commit writer (it waits for a
SQLite write lock or a PostgreSQL row lock that a third connection holds); a keyed prompt on
connection A is registered by its key, enters the insert, and its write queues behind that
writer; connection A closes, which cancels its handler. The client's resend of the same key on
connection B must then be answered with the one message id once the lock is released, and the
message stored once. Before the fix the cancelled handler withdrew its queued write and left
the prompt registered by its key with no outcome: the resend joined it and waited forever.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg import sql

from acp_once.agent.connection import AgentSideConnection
from acp_once.agent.runtime import SessionAgent
from acp_once.client import Client, ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.rpc.streams import memory_pair
from acp_once.storage import SqliteStore
from acp_once.storage.postgres import PostgresStore
from tests.cluster.harness import until
from tests.helpers import initialize_request

pytestmark = pytest.mark.anyio

TIMEOUT = 20
KEY = "resend-me"


@asynccontextmanager
async def client_of(agent: SessionAgent) -> AsyncIterator[ClientSideConnection]:
    agent_end, client_end = memory_pair(64)
    async with (
        AgentSideConnection(agent, agent_end),
        ClientSideConnection(Client(), client_end) as conn,
    ):
        await conn.agent.initialize(initialize_request("t"))
        yield conn


def prompt(sid: str, text: str, key: str | None = None) -> dict[str, Any]:
    p: dict[str, Any] = {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}
    if key is not None:
        p["idempotencyKey"] = key
    return p


class Locker:
    """Holds the write lock (SQLite) or the session row's lock (PostgreSQL) that the blocking
    write waits for, from a connection of its own."""

    def __init__(self, take: Callable[[str], None], release: Callable[[], None]) -> None:
        self.take = take
        self.release = release


async def play_trace(store: SqliteStore | PostgresStore, locker: Locker) -> None:
    group = store._group
    assert group is not None, "the stores write through group commit by default"
    async with (
        SessionAgent(store) as agent,
        anyio.create_task_group() as tg,
        client_of(agent) as c,
        client_of(agent) as b,
    ):
        other = (await c.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
        a_ready, go_a, close_a = anyio.Event(), anyio.Event(), anyio.Event()
        sid = ""

        async def first_attempt() -> None:
            nonlocal sid
            async with client_of(agent) as a:
                sid = (await a.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
                a_ready.set()
                await go_a.wait()
                await a.rpc.start_request("session/prompt", prompt(sid, "deploy", KEY))
                await close_a.wait()
            # leaving the block drops the connection: the agent cancels A's handler

        tg.start_soon(first_attempt)
        await a_ready.wait()
        # the client's other connection, ready for the resend (resuming writes nothing later)
        await b.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/w"))

        # connection C's prompt on the other session becomes the writer and waits for the lock
        locker.take(other)
        blocker = await c.rpc.start_request("session/prompt", prompt(other, "hold the writer"))
        await until(lambda: group._writing, interval=0.005)
        # connection A: the keyed prompt is registered by its key and its write queues
        go_a.set()
        await until(lambda: any(w.session_id == sid for w in group._queue), interval=0.005)
        close_a.set()
        # every task is waiting again: A's handler has taken its cancellation
        await anyio.wait_all_tasks_blocked()

        # connection B: the client's resend of the same key
        resend = await b.rpc.start_request("session/prompt", prompt(sid, "deploy", KEY))
        locker.release()
        with anyio.fail_after(1 + TIMEOUT / 4):  # within a second, on an idle machine
            answer = await resend.result()
        with anyio.fail_after(TIMEOUT):
            await blocker.result()
        found = await store.find_key(sid, KEY)
        assert found is not None
        assert answer["messageId"] == found.message_id
        assert await store.count_user_messages(sid) == 1


async def test_sqlite_a_resend_after_the_first_attempt_was_cancelled_in_group_commit(
    tmp_path: Path,
) -> None:
    import sqlite3

    path = tmp_path / "s.db"
    holder: list[sqlite3.Connection] = []

    def take(_sid: str) -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")  # the write lock, until released
        holder.append(conn)

    def release() -> None:
        holder[0].execute("ROLLBACK")
        holder[0].close()

    with anyio.fail_after(TIMEOUT * 2):
        async with SqliteStore.open(path, busy_timeout_ms=int(TIMEOUT * 1000)) as store:
            await play_trace(store, Locker(take, release))


@pytest.mark.postgres
async def test_postgres_a_resend_after_the_first_attempt_was_cancelled_in_group_commit(
    postgres_dsn: str, new_schema: Callable[[], str]
) -> None:
    schema = new_schema()
    holder: list[psycopg.Connection[Any]] = []

    def take(sid: str) -> None:
        conn = psycopg.connect(postgres_dsn)  # a transaction left open: the row stays locked
        query = sql.SQL("SELECT 1 FROM {}.sessions WHERE session_id = %s FOR UPDATE")
        conn.execute(query.format(sql.Identifier(schema)), (sid,))
        holder.append(conn)

    def release() -> None:
        holder[0].rollback()
        holder[0].close()

    opening: AbstractAsyncContextManager[PostgresStore] = PostgresStore.open(
        postgres_dsn, schema=schema
    )
    with anyio.fail_after(TIMEOUT * 2):
        async with opening as store:
            await play_trace(store, Locker(take, release))


@pytest.mark.postgres
async def test_cluster_a_resend_after_the_first_attempt_was_cancelled_in_admission(
    postgres_dsn: str, new_schema: Callable[[], str], tmp_path: Path
) -> None:
    """The same on a cluster node, one step earlier: the keyed prompt is registered by its
    key and its admission waits for the database (the key lookup a node makes before it takes
    the lease) when its connection closes. The resend on another connection of the node must
    not join a prompt that nobody will ever insert."""
    from acp_once.storage.base import KeyRecord
    from acp_once.testing import connected
    from tests.cluster.harness import node

    reached, go = anyio.Event(), anyio.Event()
    with anyio.fail_after(TIMEOUT):
        async with node(postgres_dsn, new_schema(), "a", tmp_path / "fx") as a:
            original = a.store.find_key

            async def held_lookup(session_id: str, key: str) -> KeyRecord | None:
                if key == KEY and not reached.is_set():
                    reached.set()
                    await go.wait()  # cancelled here when the connection closes
                return await original(session_id, key)

            a.store.find_key = held_lookup  # type: ignore[method-assign]
            async with connected(a.agent) as b:
                await b.agent.initialize(initialize_request("t"))
                async with connected(a.agent) as first:
                    await first.agent.initialize(initialize_request("t"))
                    sid = (await first.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
                    await b.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/w"))
                    await first.rpc.start_request("session/prompt", prompt(sid, "deploy", KEY))
                    await reached.wait()
                # the first connection is gone, its handler cancelled in the lookup
                with anyio.fail_after(TIMEOUT / 4):
                    answer = await b.rpc.request("session/prompt", prompt(sid, "deploy", KEY))
            found = await a.store.find_key(sid, KEY)
            assert found is not None and answer["messageId"] == found.message_id
            assert await a.store.count_user_messages(sid) == 1


@pytest.mark.postgres
async def test_cluster_a_lease_taken_by_a_prompt_cancelled_in_its_insert_is_released(
    postgres_dsn: str, new_schema: Callable[[], str], tmp_path: Path
) -> None:
    """A node takes a free lease for a keyed prompt; its insert waits; the connection closes
    and the prompt is withdrawn. The node must still start the session's worker, which lets
    the lease go: a lease held by a node with no worker is renewed for ever, and prompts other
    nodes queue behind it wait on a wake-up NOTIFY alone (one lost, they wait for ever)."""
    from acp_once.storage.base import InsertOutcome
    from acp_once.testing import connected
    from tests.cluster.harness import node

    reached = anyio.Event()
    with anyio.fail_after(TIMEOUT):
        async with node(postgres_dsn, new_schema(), "a", tmp_path / "fx") as a:
            original = a.store.insert_user_message

            async def held_insert(session_id: str, **fields: Any) -> InsertOutcome:
                if fields.get("idempotency_key") == KEY:
                    reached.set()
                    await anyio.sleep_forever()  # a write that waits: cancelled with its request
                return await original(session_id, **fields)

            a.store.insert_user_message = held_insert  # type: ignore[method-assign]
            async with connected(a.agent) as first:
                await first.agent.initialize(initialize_request("t"))
                sid = (await first.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
                await first.rpc.start_request("session/prompt", prompt(sid, "deploy", KEY))
                await reached.wait()
                assert sid in a.coordinator.leases  # taken for this prompt
            # the connection is gone and the prompt withdrawn: the lease is let go
            with anyio.fail_after(10):
                await until(lambda: sid not in a.coordinator.leases, interval=0.01)
            assert await a.store.count_user_messages(sid) == 0
