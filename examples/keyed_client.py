"""A client that sends a keyed prompt, waits for the end of its turn, and survives an agent
restart: the reference agent (`acp-once agent`) over stdio, everything in a temporary directory."""

import sys
import tempfile

import anyio

from acp_once.client import AcpClient, StdioLauncher


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, anyio.fail_after(60):
        agent = StdioLauncher(
            [sys.executable, "-m", "acp_once", "agent", "--store", f"sqlite:{tmp}/agent.db"]
        )
        async with AcpClient(agent, outbox=f"sqlite:{tmp}/outbox.db") as client:
            session = await client.new_session(tmp)

            # The key is written to the outbox before the prompt is sent; a lost answer is
            # resent with it.
            turn = session.prompt("Summarise the release notes", idempotency_key="release-notes-1")
            print("inserted as", await turn)
            result = await turn.finished()
            print(f"turn ended: {result.stop_reason}: {result.text}")

            # The agent dies in the middle of a turn: the client starts it again and resumes
            # the session.
            turn = session.prompt("A long job [work:30]")
            async for update in turn.updates():
                if getattr(update, "state", None) == "running" and agent.current is not None:
                    agent.current.process.kill()
                    break
            result = await turn.finished()
            print(f"interrupted turn ended: {result.stop_reason}")

            # Sent again with its key, the first prompt is not inserted twice: same message id.
            again = await session.prompt(
                "Summarise the release notes", idempotency_key="release-notes-1"
            )
            print("the same key again:", again)
            print(f"after the restart: {(await session.prompt('Still there?').finished()).text}")


if __name__ == "__main__":
    anyio.run(main)
