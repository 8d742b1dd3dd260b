"""The README's client: a prompt to the README's agent, kept in an outbox until it is in."""

import sys

import anyio

from acp_once.client import AcpClient, StdioLauncher


async def main() -> None:
    agent = StdioLauncher([sys.executable, "examples/quickstart_agent.py"])
    async with AcpClient(agent, outbox="sqlite:outbox.db") as client:
        session = await client.new_session("/tmp")
        turn = session.prompt("hello")  # a fresh idempotency key, resent with it if need be
        print("inserted as", await turn, "then:", (await turn.finished()).text)


anyio.run(main)
