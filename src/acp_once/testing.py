"""A test kit for people building on acp-once: agents and clients connected in memory.

    async with connected(agent, client) as conn:      # conn: ClientSideConnection
        await conn.agent.initialize(...)

Each `connected(...)` is a new connection to the same agent object, so several can be open at
once (a session active on two connections, a retry on a new connection after a drop). Leaving
the block ends the connection as a dropped transport would: the agent sees it close.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from acp_once.agent.connection import AgentSideConnection
from acp_once.agent.interface import Agent
from acp_once.client.connection import ClientSideConnection
from acp_once.client.interface import Client
from acp_once.rpc.streams import memory_pair

__all__ = ["connected"]


@asynccontextmanager
async def connected(
    agent: Agent, client: Client | None = None, *, buffer: int = 64, tenant: str | None = None
) -> AsyncIterator[ClientSideConnection]:
    """Connect `client` (default: a plain `Client`) to `agent` over in-memory frame streams,
    as `tenant` (what a server sets from the token that matched; None: no tenant)."""
    agent_end, client_end = memory_pair(buffer)
    async with (
        AgentSideConnection(agent, agent_end, tenant=tenant),
        ClientSideConnection(client or Client(), client_end) as conn,
    ):
        yield conn
