"""What one agent-side connection holds of its own: the dispatch table and the params validators
are shared by every connection, and each call is routed to the agent's handler at call time."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.agent.connection import AgentSideConnection, CallContext, param_validators
from acp_once.agent.reference import ReferenceAgent
from acp_once.client import Client, ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.rpc.streams import memory_pair
from acp_once.storage import MemoryStore
from tests.helpers import initialize_request

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def served(agent: ReferenceAgent) -> Any:
    """An initialized client connection to `agent`, with the agent side's connection."""
    agent_end, client_end = memory_pair(64)
    async with (
        AgentSideConnection(agent, agent_end) as side,
        ClientSideConnection(Client(), client_end) as conn,
    ):
        with anyio.fail_after(10):
            await conn.agent.initialize(initialize_request("footprint"))
        yield side, conn


async def test_connections_share_one_validators_table_and_keep_no_route_table(
    tmp_path: Path,
) -> None:
    async with (
        MemoryStore() as store,
        ReferenceAgent(store, side_effects=tmp_path / "effects") as agent,
        served(agent) as (first, conn_a),
        served(agent) as (second, conn_b),
    ):
        assert first._validators is second._validators is param_validators()
        assert not hasattr(first, "_routes") and not hasattr(first, "_notification_routes")
        with anyio.fail_after(10):
            a = await conn_a.agent.new_session(s.NewSessionRequest(cwd="/a"))
            b = await conn_b.agent.new_session(s.NewSessionRequest(cwd="/b"))
        assert a.session_id != b.session_id


async def test_a_handler_set_on_the_agent_instance_is_the_one_called(tmp_path: Path) -> None:
    async with (
        MemoryStore() as store,
        ReferenceAgent(store, side_effects=tmp_path / "effects") as agent,
        served(agent) as (_side, conn),
    ):
        original = agent.list_sessions
        calls: list[s.ListSessionsRequest] = []

        async def list_sessions(params: s.ListSessionsRequest, ctx: CallContext) -> Any:
            calls.append(params)
            return await original(params, ctx)

        agent.list_sessions = list_sessions  # type: ignore[method-assign]
        with anyio.fail_after(10):
            await conn.agent.list_sessions(s.ListSessionsRequest())
        assert len(calls) == 1
