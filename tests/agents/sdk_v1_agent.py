"""An ACP v1 echo agent written with the official Python SDK (`agent-client-protocol` 0.12.1,
import `acp`): the v1 peer of the client tests. acp-once code is not used here.

    python tests/agents/sdk_v1_agent.py [--log FILE] [--state FILE] [--no-load] [--echo-version]
        [--bare-initialize]

Its turn streams "echo: " and the prompt's text as two agent message chunks and ends with
`end_turn`. In the prompt text:
- "[tool]" reports a tool call (started, then completed) between the two chunks;
- "[plan]" reports a two-step plan first;
- "[thought]" streams a thought chunk first;
- "[permission]" asks the client for permission first and echoes the option chosen;
- "[wait]" keeps the turn running until the client cancels it (stop reason `cancelled`);
- "[die]" exits the process at once, the prompt unanswered;
- "[die-once]" does that only the first time the state file sees it (needs `--state`).

`--log FILE` appends every JSON-RPC message the agent receives, one JSON line each (the tests
read what the client sent from the agent's side), and a `{"turn": TEXT}` line when a turn
starts (the side effect a duplicated prompt would repeat). `--no-load` does not advertise
`loadSession`. `--state FILE` keeps the sessions and their history in a JSON file, so a
restarted agent can still load them. `--echo-version` answers `initialize` with the client's
protocol version instead of 1 (an agent that copies the version but answers in v1's shape).
`--bare-initialize` answers `initialize` as the SDK's simple echo examples do: the client's
protocol version and nothing else (`{"protocolVersion": 2}` to a v2 client).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import uuid
from pathlib import Path
from typing import Any

import acp
from acp import schema
from acp.connection import StreamEvent


class EchoAgent:
    def __init__(
        self, *, load: bool, echo_version: bool, log: Path | None, state: Path | None
    ) -> None:
        self._load = load
        self._echo_version = echo_version
        self.bare_initialize = False
        self._log = log
        self._state = state
        self._client: Any = None
        self._history: dict[str, list[list[str]]] = {}
        self._died: list[str] = []
        if state is not None and state.exists():
            saved = json.loads(state.read_text(encoding="utf-8"))
            self._history, self._died = saved["sessions"], saved["died"]
        self._cancelled: dict[str, asyncio.Event] = {}

    def save(self) -> None:
        if self._state is not None:
            data = {"sessions": self._history, "died": self._died}
            self._state.write_text(json.dumps(data), encoding="utf-8")

    def on_connect(self, conn: Any) -> None:
        self._client = conn

    def record(self, entry: dict[str, Any]) -> None:
        if self._log is not None:
            with self._log.open("a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")

    async def observe(self, event: StreamEvent) -> None:
        if event.direction.value == "incoming":
            self.record(event.message)

    async def initialize(self, protocol_version: int, **kwargs: Any) -> schema.InitializeResponse:
        if self.bare_initialize:
            return schema.InitializeResponse(protocol_version=protocol_version)
        return schema.InitializeResponse(
            protocol_version=protocol_version if self._echo_version else acp.PROTOCOL_VERSION,
            agent_capabilities=schema.AgentCapabilities(load_session=self._load),
            agent_info=schema.Implementation(name="sdk-v1-echo", version="0.12.1"),
        )

    async def new_session(self, cwd: str, **kwargs: Any) -> schema.NewSessionResponse:
        session_id = f"sdk_{uuid.uuid4().hex}"
        self._history[session_id] = []
        self.save()
        return schema.NewSessionResponse(session_id=session_id)

    async def load_session(
        self, cwd: str, session_id: str, **kwargs: Any
    ) -> schema.LoadSessionResponse | None:
        if not self._load or session_id not in self._history:
            raise acp.RequestError.resource_not_found(session_id)
        for role, text in self._history[session_id]:
            update = (
                acp.update_user_message_text(text)
                if role == "user"
                else acp.update_agent_message_text(text)
            )
            await self._client.session_update(session_id=session_id, update=update)
        return schema.LoadSessionResponse()

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        event = self._cancelled.get(session_id)
        if event is not None:
            event.set()

    async def prompt(
        self, session_id: str, prompt: list[Any], **kwargs: Any
    ) -> schema.PromptResponse:
        if session_id not in self._history:
            raise acp.RequestError.resource_not_found(session_id)
        text = "".join(getattr(block, "text", "") for block in prompt)
        self.record({"turn": text})
        if "[die]" in text:
            os._exit(3)
        if "[die-once]" in text and text not in self._died:
            self._died.append(text)
            self.save()
            os._exit(3)
        self._history[session_id].append(["user", text])
        self.save()
        say = self._say(session_id)
        if "[plan]" in text:
            entries = [acp.plan_entry("look"), acp.plan_entry("answer", priority="high")]
            await say(acp.update_plan(entries))
        if "[thought]" in text:
            await say(acp.update_agent_thought_text("thinking"))
        reply = text
        if "[permission]" in text:
            answer = await self._client.request_permission(
                session_id=session_id,
                tool_call=schema.ToolCallUpdate(tool_call_id="perm1", title="Run the tests?"),
                options=[
                    schema.PermissionOption(option_id="yes", name="Yes", kind="allow_once"),
                    schema.PermissionOption(option_id="no", name="No", kind="reject_once"),
                ],
            )
            outcome = answer.outcome
            reply = getattr(outcome, "option_id", None) or outcome.outcome
        await say(acp.update_agent_message_text("echo: "))
        if "[tool]" in text:
            await say(acp.start_tool_call("tool1", "Read the file", kind="read", status="pending"))
            await say(acp.update_tool_call("tool1", status="completed"))
        if "[wait]" in text:
            cancelled = self._cancelled[session_id] = asyncio.Event()
            await cancelled.wait()
            return schema.PromptResponse(stop_reason="cancelled")
        await say(acp.update_agent_message_text(reply))
        self._history[session_id].append(["agent", f"echo: {reply}"])
        self.save()
        return schema.PromptResponse(stop_reason="end_turn")

    def _say(self, session_id: str) -> Any:
        async def say(update: Any) -> None:
            await self._client.session_update(session_id=session_id, update=update)

        return say


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", type=Path)
    parser.add_argument("--no-load", action="store_true")
    parser.add_argument("--echo-version", action="store_true")
    parser.add_argument("--bare-initialize", action="store_true")
    parser.add_argument("--state", type=Path)
    args = parser.parse_args()
    agent = EchoAgent(
        load=not args.no_load, echo_version=args.echo_version, log=args.log, state=args.state
    )
    agent.bare_initialize = args.bare_initialize
    await acp.run_agent(agent, observers=[agent.observe])  # type: ignore[arg-type]


if __name__ == "__main__":
    asyncio.run(main())
