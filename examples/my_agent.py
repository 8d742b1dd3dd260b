"""The docs' quickstart agent: `acp-once agent examples/my_agent.py:EchoAgent` runs it on stdio,
`acp-once serve examples/my_agent.py:EchoAgent` over WebSocket and HTTP."""

from acp_once.agent import SessionAgent, StopReason, Turn, TurnContext
from acp_once.agent.updates import agent_message


class EchoAgent(SessionAgent):
    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason:
        await ctx.emit(agent_message(f"you said: {turn.text}"), retain=True)
        return "end_turn"
