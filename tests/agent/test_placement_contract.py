"""The contract every `Placement` passes, seen from the wire through `SessionAgent`.

One suite, run against the local placement (on a memory and a SQLite store) and the
PostgreSQL coordinator (a node of a cluster on a fresh schema): a placement decides where held
prompts wait and who inserts them, so everything a client can observe about keys, held prompts,
withdrawals and recovery must be the same whichever one is plugged in.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import orjson
import psycopg
import pytest
from psycopg import sql

from acp_once.agent import Coordinator, LocalCoordinator
from acp_once.agent.placement import LocalPlacement, Placement
from acp_once.agent.reference import ReferenceAgent
from acp_once.agent.state import prompt_digest
from acp_once.client import ClientSideConnection
from acp_once.cluster import PostgresCoordinator
from acp_once.protocol import schema as s
from acp_once.protocol.errors import INVALID_PARAMS, REQUEST_CANCELLED, AcpError
from acp_once.storage import MemoryStore, SessionStore, SqliteStore
from acp_once.storage.postgres import PostgresStore
from acp_once.testing import connected
from tests.helpers import UpdateRecorder, initialize_request

pytestmark = pytest.mark.anyio

POSTGRES_DSN_VAR = "ACP_ONCE_TEST_POSTGRES_DSN"
TIMEOUT = 20

# An agent on the backend under test and the store beneath its coordinator: `agent()` opens
# one (a second call, after the first closed, is a restart on the same stored data).
AgentFactory = Callable[[], AbstractAsyncContextManager[tuple[ReferenceAgent, SessionStore]]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _postgres_dsn() -> str:
    dsn = os.environ.get(POSTGRES_DSN_VAR, "")
    if not dsn:
        reason = f"{POSTGRES_DSN_VAR} is not set; the PostgreSQL coordinator needs a server"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true requires the PostgreSQL coordinator's contract: {reason}")
        pytest.skip(reason)
    return dsn


@pytest.fixture(params=["local-memory", "local-sqlite", "postgres"])
def agent(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[AgentFactory]:
    kind: str = request.param
    effects = tmp_path / "effects"
    memory = MemoryStore()  # survives the agent: a restart on it finds the same sessions

    @asynccontextmanager
    async def local_memory() -> AsyncIterator[tuple[ReferenceAgent, SessionStore]]:
        async with ReferenceAgent(memory, side_effects=effects) as node:
            yield node, memory

    @asynccontextmanager
    async def local_sqlite() -> AsyncIterator[tuple[ReferenceAgent, SessionStore]]:
        async with SqliteStore.open(str(tmp_path / "sessions.db")) as store:
            node = ReferenceAgent(store, side_effects=effects)
            node.use_coordinator(LocalCoordinator())  # the default, given explicitly (deprecated)
            async with node:
                yield node, store

    schema = f"acp_once_coord_{uuid.uuid4().hex}"

    @asynccontextmanager
    async def postgres() -> AsyncIterator[tuple[ReferenceAgent, SessionStore]]:
        async with PostgresStore.open(_postgres_dsn(), schema=schema, max_size=4) as store:
            coordinator = PostgresCoordinator(store, lease_ttl=2.0, poll_interval=0.2)
            node = ReferenceAgent(store, side_effects=effects)
            node.use_coordinator(coordinator)
            async with node:
                yield node, store

    factories: dict[str, AgentFactory] = {
        "local-memory": local_memory,
        "local-sqlite": local_sqlite,
        "postgres": postgres,
    }
    yield factories[kind]
    if kind == "postgres":
        with psycopg.connect(_postgres_dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@asynccontextmanager
async def client(
    node: ReferenceAgent, recorder: UpdateRecorder | None = None
) -> AsyncIterator[ClientSideConnection]:
    async with connected(node, recorder) as conn:
        await conn.agent.initialize(initialize_request("contract"))
        yield conn


def params(sid: str, text: str, key: str | None) -> dict[str, Any]:
    p: dict[str, Any] = {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}
    if key is not None:
        p["idempotencyKey"] = key
    return p


async def prompt(conn: ClientSideConnection, sid: str, text: str, key: str | None) -> str:
    return str((await conn.rpc.request("session/prompt", params(sid, text, key)))["messageId"])


async def new_session(conn: ClientSideConnection) -> str:
    return (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id


async def resume(conn: ClientSideConnection, sid: str) -> None:
    await conn.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/w"))


async def user_messages(store: SessionStore, sid: str) -> list[str]:
    """The texts of the session's stored user messages, in timeline order."""
    texts: list[str] = []
    for entry in await store.read_timeline(sid, limit=1000):
        update = orjson.loads(entry.update)
        if update.get("sessionUpdate") == "user_message":
            texts.append(" ".join(b.get("text", "") for b in update["content"]))
    return texts


def test_both_placements_satisfy_the_interface() -> None:
    # structural: mypy checks the assignments; the runtime check keeps a rename from passing
    local: Placement = LocalPlacement(MemoryStore())
    assert callable(local.place) and callable(local.next)
    shared: Coordinator = LocalCoordinator()
    assert isinstance(shared.placement(MemoryStore()), LocalPlacement)
    for protocol, classes in (
        (Placement, (LocalPlacement, PostgresCoordinator)),
        (Coordinator, (LocalCoordinator, PostgresCoordinator)),
    ):
        for name, member in protocol.__dict__.items():
            if not name.startswith("_") and callable(member):  # `store` is an attribute
                for cls in classes:
                    assert hasattr(cls, name), (cls.__name__, name)


async def test_a_key_inserts_once_and_retries_get_its_id_on_any_connection(
    agent: AgentFactory,
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent() as (node, _), client(node) as a, client(node) as b:
            sid = await new_session(a)
            first = await prompt(a, sid, "deploy [tool]", "k1")
            assert await prompt(a, sid, "deploy [tool]", "k1") == first
            await resume(b, sid)
            assert await prompt(b, sid, "deploy [tool]", "k1") == first
            assert await node.store.count_user_messages(sid, idempotency_key="k1") == 1


async def test_concurrent_requests_with_one_new_key_insert_once(agent: AgentFactory) -> None:
    answers: list[str] = []
    with anyio.fail_after(TIMEOUT):
        async with agent() as (node, _), client(node) as conn:
            sid = await new_session(conn)

            async def one() -> None:
                answers.append(await prompt(conn, sid, "same", "k-same"))

            async with anyio.create_task_group() as tg:
                for _ in range(20):
                    tg.start_soon(one)
            assert len(answers) == 20 and len(set(answers)) == 1
            assert await node.store.count_user_messages(sid) == 1


async def test_a_recorded_key_sent_with_another_prompt_is_refused(agent: AgentFactory) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent() as (node, _), client(node) as conn:
            sid = await new_session(conn)
            await prompt(conn, sid, "one thing", "k-reused")
            with pytest.raises(AcpError) as info:
                await prompt(conn, sid, "another thing", "k-reused")
            assert info.value.code == INVALID_PARAMS
            assert "k-reused" not in str(info.value.message)
            assert await node.store.count_user_messages(sid) == 1


async def test_prompts_sent_during_a_turn_are_inserted_after_it_in_arrival_order(
    agent: AgentFactory,
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent() as (node, _), client(node) as conn:
            sid = await new_session(conn)
            await prompt(conn, sid, "busy [work:0.3]", None)
            second = await conn.rpc.start_request("session/prompt", params(sid, "second", "k2"))
            third = await conn.rpc.start_request("session/prompt", params(sid, "third", "k3"))
            ids = [(await second.result())["messageId"], (await third.result())["messageId"]]
            assert len(set(ids)) == 2
            assert await user_messages(node.store, sid) == ["busy [work:0.3]", "second", "third"]


async def test_a_withdrawn_held_prompt_leaves_its_key_unused_and_a_later_send_inserts(
    agent: AgentFactory,
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent() as (node, _), client(node) as a, client(node) as b:
            sid = await new_session(a)
            await resume(b, sid)
            await prompt(a, sid, "busy [work:30]", None)
            original = await a.rpc.start_request("session/prompt", params(sid, "held", "kw"))
            retry = await b.rpc.start_request("session/prompt", params(sid, "held", "kw"))
            await retry.cancel()
            # every request waiting for the key gets -32800, not just the cancelled one
            for call in (original, retry):
                with pytest.raises(AcpError) as info:
                    await call.result()
                assert info.value.code == REQUEST_CANCELLED
            assert await node.store.count_user_messages(sid, idempotency_key="kw") == 0
            await a.agent.cancel(s.CancelSessionNotification(session_id=sid))
            message_id = await prompt(a, sid, "held", "kw")
            assert await prompt(b, sid, "held", "kw") == message_id
            assert await node.store.count_user_messages(sid, idempotency_key="kw") == 1


async def test_session_cancel_withdraws_held_prompts_and_ends_the_turn_cancelled(
    agent: AgentFactory,
) -> None:
    recorder = UpdateRecorder()
    with anyio.fail_after(TIMEOUT):
        async with agent() as (node, _), client(node, recorder) as conn:
            sid = await new_session(conn)
            await prompt(conn, sid, "busy [work:30]", None)
            held = await conn.rpc.start_request("session/prompt", params(sid, "held", "kc"))
            await recorder.wait_for(lambda ups: any(u.get("state") == "running" for u in ups))
            await conn.agent.cancel(s.CancelSessionNotification(session_id=sid))
            with pytest.raises(AcpError) as info:
                await held.result()
            assert info.value.code == REQUEST_CANCELLED
            await recorder.wait_for(
                lambda ups: any(u.get("stopReason") == "cancelled" for u in ups)
            )
            assert await node.store.count_user_messages(sid, idempotency_key="kc") == 0


async def test_a_held_prompt_whose_connection_closes_is_withdrawn(agent: AgentFactory) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent() as (node, _):
            async with client(node) as a:
                sid = await new_session(a)
                await prompt(a, sid, "busy [work:0.5]", None)
                await a.rpc.start_request("session/prompt", params(sid, "held [tool]", "kd"))
            async with client(node) as b:
                await resume(b, sid)
                first = await prompt(b, sid, "held [tool]", "kd")
                assert await prompt(b, sid, "held [tool]", "kd") == first
            assert await node.store.count_user_messages(sid, idempotency_key="kd") == 1


async def test_a_restart_reports_a_turn_that_never_finished(agent: AgentFactory) -> None:
    recorder = UpdateRecorder()
    blocks = [{"type": "text", "text": "deploy"}]
    update = {"sessionUpdate": "user_message", "messageId": "msg_user_crash", "content": blocks}
    with anyio.fail_after(TIMEOUT):
        async with agent() as (node, _), client(node) as conn:
            sid = await new_session(conn)
        async with agent() as (node, raw), client(node, recorder) as conn:
            # what a process killed after its commit leaves: the message and its key, stored
            # together, and no marker saying its turn finished
            await raw.insert_user_message(
                sid,
                message_id="msg_user_crash",
                update=orjson.dumps(update),
                idempotency_key="kr",
                prompt_digest=prompt_digest(blocks),
            )
            await resume(conn, sid)
            states = [u for u in recorder.updates if u.get("sessionUpdate") == "state_update"]
            assert states[-1].get("stopReason") == "error"
            assert await prompt(conn, sid, "deploy", "kr") == "msg_user_crash"
            assert await node.store.count_user_messages(sid) == 1


async def test_status_lists_this_node(agent: AgentFactory) -> None:
    with anyio.fail_after(TIMEOUT):
        async with agent() as (node, _), client(node) as conn:
            await new_session(conn)
            status = await node.ops_status()
            assert status["nodes"] and all("node" in n for n in status["nodes"])
