"""Entry points that put an `Agent` on a transport."""

from __future__ import annotations

from acp_once.agent.connection import AgentSideConnection
from acp_once.agent.interface import Agent
from acp_once.protocol.framing import DEFAULT_MAX_FRAME
from acp_once.rpc.streams import FrameStream
from acp_once.transports.stdio import stdio_frames

__all__ = ["serve", "serve_stdio"]


async def serve(agent: Agent, stream: FrameStream) -> None:
    """Serve `agent` on `stream` until the client goes away."""
    async with AgentSideConnection(agent, stream) as conn:
        await conn.wait_closed()


async def serve_stdio(agent: Agent, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
    """Serve `agent` on this process's stdin/stdout until stdin closes.

    From here on nothing but ACP frames reaches stdout: `print()` goes to stderr.
    """
    await serve(agent, stdio_frames(max_frame))
