"""The client side: the `Client` interface and its connection to an agent."""

from acp_once.client.connection import AgentPeer, ClientSideConnection
from acp_once.client.interface import Client

__all__ = ["AgentPeer", "Client", "ClientSideConnection"]
