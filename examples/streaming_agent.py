"""An agent that streams its answer, runs a tool call after asking permission, and ends the turn."""

import anyio

from acp_once.agent import SessionAgent, StopReason, Turn, TurnContext, serve_stdio, updates
from acp_once.storage import open_store


class StreamingAgent(SessionAgent):
    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason:
        # three live chunks of one message (not stored: the whole message replaces them),
        # then the whole of it, retained for replay
        message_id = updates.new_message_id()
        parts = ["Let me ", "look at ", "that file."]
        for part in parts:
            await ctx.emit(updates.agent_message_chunk(part, message_id=message_id), retain=False)
        await ctx.emit(updates.agent_message("".join(parts), message_id=message_id))

        tool_id = await ctx.start_tool_call("Read notes.txt", kind="read", locations=["notes.txt"])
        answer = await ctx.request_permission(title="Read notes.txt?", tool_call_id=tool_id)
        if updates.selected_option(answer) != "allow_once":
            await ctx.update_tool_call(tool_id, status="cancelled")
            return "end_turn"
        await ctx.update_tool_call(tool_id, status="in_progress")
        await ctx.update_tool_call(tool_id, status="completed", content=["3 lines read"])
        return "end_turn"


async def main() -> None:
    async with open_store("memory:") as store, StreamingAgent(store) as agent:
        await serve_stdio(agent)


if __name__ == "__main__":
    anyio.run(main)
