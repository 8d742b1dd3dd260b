"""The agent side: the `Agent` interface, its connection, and entry points."""

from acp_once.agent.connection import AgentSideConnection, CallContext, ClientPeer
from acp_once.agent.interface import Agent
from acp_once.agent.serve import serve, serve_stdio

__all__ = ["Agent", "AgentSideConnection", "CallContext", "ClientPeer", "serve", "serve_stdio"]
