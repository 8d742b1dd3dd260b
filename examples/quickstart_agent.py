"""The README's agent: sessions, held prompts and idempotency keys; only the turn is yours."""

import anyio

from acp_once.agent import SessionAgent, StopReason, Turn, TurnContext, serve_stdio
from acp_once.agent.updates import agent_message
from acp_once.storage import open_store


class EchoAgent(SessionAgent):
    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason:
        await anyio.sleep(0.5)  # the work: a prompt sent meanwhile is held until it ends
        await ctx.emit(agent_message(f"you said: {turn.text}"), retain=True)
        return "end_turn"


async def main() -> None:
    async with open_store("sqlite:sessions.db") as store, EchoAgent(store) as agent:
        await serve_stdio(agent)


anyio.run(main)
