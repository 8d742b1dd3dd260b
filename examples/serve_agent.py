"""Your own agent over WebSocket and HTTP: `python examples/serve_agent.py [PORT]`, or
`acp-once serve examples/serve_agent.py:EchoAgent` (stdio: `acp-once agent ...` the same)."""

import functools
import logging
import sys

import anyio

from acp_once.agent import SessionAgent, StopReason, Turn, TurnContext
from acp_once.agent.updates import agent_message
from acp_once.server import serve_agent


class EchoAgent(SessionAgent):
    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason:
        await ctx.emit(agent_message(f"you said: {turn.text}"), retain=True)
        return "end_turn"


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # shows the URL it listens at
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8765
    anyio.run(functools.partial(serve_agent, EchoAgent, port=port, store="sqlite:sessions.db"))
