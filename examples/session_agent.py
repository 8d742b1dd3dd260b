"""An agent with sessions, held prompts and idempotency keys: only the turn is yours."""
import uuid

import anyio

from acp_once.agent import SessionAgent, Turn, TurnContext, serve_stdio
from acp_once.storage import open_store


class MyAgent(SessionAgent):
    async def run_turn(self, turn: Turn, ctx: TurnContext) -> str:
        reply = {"type": "text", "text": f"you said: {turn.text}"}
        await ctx.emit({"sessionUpdate": "agent_message", "messageId": uuid.uuid4().hex, "content": [reply]}, retain=True)
        return "end_turn"


async def main() -> None:
    async with open_store("sqlite:sessions.db") as store, MyAgent(store) as agent:
        await serve_stdio(agent)


if __name__ == "__main__":
    anyio.run(main)
