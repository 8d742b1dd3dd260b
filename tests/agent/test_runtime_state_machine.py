"""Hypothesis drives random interleavings of prompts, retries, cancels, closes, resumes,
dropped connections and agent restarts against the session runtime, over the memory store and
over a SQLite file (calls run inline, or all in the store's worker thread, where a cancelled
caller waits for its transaction; with group commit, every write as a batch, or without
group commit), then checks the promise:

- at most one user message per (session, key) in the store;
- every successful answer for a key carries that key's recorded message id.

Turns block on gates the test opens, so held prompts happen deterministically; after each step
the test lets every task run until all are blocked (a scheduler settle point, not a sleep).
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import TaskGroup
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acp_once.agent import StopReason
from acp_once.agent.runtime import SessionAgent, Turn, TurnContext
from acp_once.client import ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.protocol.errors import AcpError
from acp_once.rpc.connection import PendingCall
from acp_once.rpc.errors import TransportError
from acp_once.storage import MemoryStore, SessionStore, SqliteStore
from acp_once.testing import connected
from tests.helpers import initialize_request
from tests.storage.conftest import batch_everything

pytestmark = pytest.mark.anyio

KEYS = ["k1", "k2", "K1", None]
N_CONNS = 2
N_SESSIONS = 2


class Gates:
    def __init__(self) -> None:
        self.events: dict[str, anyio.Event] = {}
        self.all_open = False

    def event(self, session_id: str) -> anyio.Event:
        return self.events.setdefault(session_id, anyio.Event())

    def release(self, session_id: str) -> None:
        self.event(session_id).set()
        self.events[session_id] = anyio.Event()

    def open_all(self) -> None:
        self.all_open = True
        for ev in self.events.values():
            ev.set()


class GatedAgent(SessionAgent):
    def __init__(self, store: SessionStore, gates: Gates, policy: Any) -> None:
        super().__init__(store, policy=policy)
        self.gates = gates

    async def run_turn(self, turn: Turn, emit: TurnContext) -> StopReason:
        if not self.gates.all_open:
            await self.gates.event(turn.session_id).wait()
        return "end_turn"


class Held:
    """An async context manager kept open in a task of its own, so that several can be closed
    in any order (task groups must be exited in the task, and order, that entered them)."""

    def __init__(self) -> None:
        self.stop = anyio.Event()
        self.done = anyio.Event()

    async def run(
        self, factory: Callable[[], AbstractAsyncContextManager[Any]], *, task_status: Any
    ) -> None:
        try:
            async with factory() as value:
                task_status.started(value)
                await self.stop.wait()
        finally:
            self.done.set()

    async def close(self) -> None:
        self.stop.set()
        await self.done.wait()


OpenStore = Callable[[], AbstractAsyncContextManager[SessionStore]]


@dataclass
class World:
    tg: TaskGroup
    open_store: OpenStore  # a restart opens the store again (a SQLite file: a new connection)
    gates: Gates
    policy: Any
    agent: GatedAgent | None = None
    agent_holder: Held | None = None
    store_holder: Held | None = None
    conns: list[ClientSideConnection | None] = field(default_factory=lambda: [None] * N_CONNS)
    holders: list[Held | None] = field(default_factory=lambda: [None] * N_CONNS)
    sessions: list[str] = field(default_factory=list)
    calls: list[tuple[str, str | None, PendingCall]] = field(default_factory=list)

    async def start_agent(self) -> None:
        self.store_holder = Held()
        store: SessionStore = await self.tg.start(self.store_holder.run, self.open_store)
        self.agent_holder = Held()
        self.agent = await self.tg.start(
            self.agent_holder.run, lambda: GatedAgent(store, self.gates, self.policy)
        )

    async def stop_agent(self) -> None:
        for i in range(N_CONNS):
            await self.drop(i)
        if self.agent_holder is not None:
            await self.agent_holder.close()
        self.agent = None
        if self.store_holder is not None:
            await self.store_holder.close()
        self.store_holder = None

    async def conn(self, i: int) -> ClientSideConnection:
        existing = self.conns[i]
        if existing is not None and not existing.closed:
            return existing
        await self.drop(i)
        agent = self.agent
        assert agent is not None
        holder = Held()
        conn: ClientSideConnection = await self.tg.start(holder.run, lambda: connected(agent))
        self.conns[i], self.holders[i] = conn, holder
        await conn.agent.initialize(initialize_request("sm"))
        for sid in self.sessions:  # a client resumes its sessions after reconnecting
            await conn.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/w"))
        return conn

    async def drop(self, i: int) -> None:
        holder = self.holders[i]
        self.conns[i], self.holders[i] = None, None
        if holder is not None:
            await holder.close()


op = st.one_of(
    st.tuples(
        st.just("prompt"),
        st.integers(0, N_SESSIONS - 1),
        st.integers(0, len(KEYS) - 1),
        st.integers(0, N_CONNS - 1),
    ),
    st.tuples(st.just("release"), st.integers(0, N_SESSIONS - 1)),
    st.tuples(st.just("cancel_request"), st.integers(0, 50)),
    st.tuples(
        st.just("session_cancel"), st.integers(0, N_SESSIONS - 1), st.integers(0, N_CONNS - 1)
    ),
    st.tuples(st.just("close"), st.integers(0, N_SESSIONS - 1), st.integers(0, N_CONNS - 1)),
    st.tuples(st.just("resume"), st.integers(0, N_SESSIONS - 1), st.integers(0, N_CONNS - 1)),
    st.tuples(st.just("drop"), st.integers(0, N_CONNS - 1)),
    st.tuples(st.just("restart")),
)


STORES = ["memory", "sqlite", "sqlite-threads", "sqlite-batched", "sqlite-single"]
"""SQLite with group commit (the default): calls inline, or all in the worker thread, or every
write through the path of a batch (one transaction of several writes); and without it."""


@asynccontextmanager
async def _batched(path: Path) -> AsyncIterator[SessionStore]:
    async with SqliteStore.open(path) as store:
        batch_everything(store)
        yield store


@asynccontextmanager
async def stores(kind: str) -> AsyncIterator[OpenStore]:
    """How to open the store of one run: the memory store lives as long as the run (a restart
    keeps it), a SQLite file is opened again by each restart."""
    if kind == "memory":
        async with MemoryStore() as memory:
            yield lambda: nullcontext(memory)
        return
    with tempfile.TemporaryDirectory(prefix="acp-sm-") as tmp:
        path = Path(tmp) / "sessions.sqlite3"
        if kind == "sqlite-batched":
            yield lambda: _batched(path)
        else:
            yield lambda: SqliteStore.open(
                path, inline=kind != "sqlite-threads", group_commit=kind != "sqlite-single"
            )


async def run_program(program: list[tuple[Any, ...]], policy: str, store_kind: str) -> None:
    async with stores(store_kind) as open_store, anyio.create_task_group() as tg:
        world = World(tg, open_store, Gates(), policy)
        await world.start_agent()
        first = await world.conn(0)
        for _ in range(N_SESSIONS):
            world.sessions.append(
                (await first.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
            )
        for sid in world.sessions:
            conn = await world.conn(1)
            await conn.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/w"))
        try:
            for step in program:
                await apply(world, step)
                await anyio.wait_all_tasks_blocked()
            world.gates.open_all()
            outcomes = await settle(world)
        finally:
            await world.stop_agent()
        async with open_store() as store:
            await check(store, world.sessions, outcomes)


async def apply(world: World, step: tuple[Any, ...]) -> None:
    kind = step[0]
    if kind == "prompt":
        _, si, ki, ci = step
        sid, key = world.sessions[si], KEYS[ki]
        params: dict[str, Any] = {
            "sessionId": sid,
            "prompt": [{"type": "text", "text": f"text for {key}"}],
        }
        if key is not None:
            params["idempotencyKey"] = key
        conn = await world.conn(ci)
        world.calls.append((sid, key, await conn.rpc.start_request("session/prompt", params)))
    elif kind == "release":
        world.gates.release(world.sessions[step[1]])
    elif kind == "cancel_request" and world.calls:
        _, _, call = world.calls[step[1] % len(world.calls)]
        await call.cancel()
    elif kind in ("session_cancel", "close", "resume"):
        _, si, ci = step
        conn = await world.conn(ci)
        sid = world.sessions[si]
        if kind == "session_cancel":
            await conn.agent.cancel(s.CancelSessionNotification(session_id=sid))
        elif kind == "close":
            await conn.agent.close_session(s.CloseSessionRequest(session_id=sid))
        else:
            await conn.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/w"))
    elif kind == "drop":
        await world.drop(step[1])
    elif kind == "restart":
        await world.stop_agent()
        await world.start_agent()


async def settle(world: World) -> list[tuple[str, str | None, str | None]]:
    """Wait for every outstanding call: (session, key, message id or None for an error)."""
    outcomes: list[tuple[str, str | None, str | None]] = []
    with anyio.fail_after(10):
        for sid, key, call in world.calls:
            try:
                result = await call.result()
                outcomes.append((sid, key, result["messageId"]))
            except (AcpError, TransportError):
                outcomes.append((sid, key, None))
    return outcomes


async def check(
    store: SessionStore, sessions: list[str], outcomes: list[tuple[str, str | None, str | None]]
) -> None:
    for sid in sessions:
        for key in KEYS:
            if key is None:
                continue
            assert await store.count_user_messages(sid, idempotency_key=key) <= 1
    for sid, key, message_id in outcomes:
        if key is None or message_id is None:
            continue
        record = await store.find_key(sid, key)
        assert record is not None, "a success was answered for a key that is not recorded"
        assert record.message_id == message_id


@pytest.mark.parametrize("store_kind", STORES)
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(program=st.lists(op, max_size=25), policy=st.sampled_from(["hold", "steer"]))
async def test_keys_hold_under_any_interleaving(
    program: list[tuple[Any, ...]], policy: str, store_kind: str
) -> None:
    await run_program(program, policy, store_kind)
