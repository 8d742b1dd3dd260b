"""The raw connection: starts the echo agent, sends one prompt, retries nothing."""

import sys

import anyio

from acp_once.client import Client, ClientSideConnection, StdioLauncher
from acp_once.protocol import schema as s


async def main() -> None:
    async with (
        StdioLauncher([sys.executable, "examples/echo_agent.py"]).connect() as frames,
        ClientSideConnection(Client(), frames) as conn,
    ):
        await conn.agent.initialize(
            s.InitializeRequest.model_validate(
                {"protocolVersion": 2, "info": {"name": "me", "version": "1"}}
            )
        )
        session = await conn.agent.new_session(s.NewSessionRequest(cwd="/tmp"))
        prompt = s.PromptRequest.model_validate(
            {"sessionId": session.session_id, "prompt": [{"type": "text", "text": "hi"}]}
        )
        print("inserted as", (await conn.agent.prompt(prompt)).message_id)


if __name__ == "__main__":
    anyio.run(main)
