"""An agent with sessions, held prompts and idempotency keys: only the turn is yours."""

import os
import sys
import tempfile
import uuid

import anyio

from acp_once.agent import SessionAgent, StopReason, Turn, TurnContext, serve_stdio
from acp_once.storage import open_store


class MyAgent(SessionAgent):
    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason:
        reply = {"type": "text", "text": f"you said: {turn.text}"}
        await ctx.emit(
            {"sessionUpdate": "agent_message", "messageId": uuid.uuid4().hex, "content": [reply]},
            retain=True,
        )
        return "end_turn"


async def main(store_url: str) -> None:
    async with open_store(store_url) as store, MyAgent(store) as agent:
        await serve_stdio(agent)


if __name__ == "__main__":
    # where sessions live: the URL given, else a file in the temporary directory
    default = "sqlite:" + os.path.join(tempfile.gettempdir(), "acp-once-sessions.db")
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else default)
