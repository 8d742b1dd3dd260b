"""A v1 agent written with the official Python SDK (agent-client-protocol 0.12.1, `import acp`),
with a side effect per prompt: the third-party peer behind `acp-once agent --runtime v1`.

Usage: `python sdk_v1_effects_agent.py --effects FILE [--load --state FILE] [--gates DIR]`.

- Every `session/prompt` it receives appends one line to `--effects` (`<session id> <text>`),
  before any work: the file counts how often the work was asked for.
- `--load` advertises `loadSession`; sessions and their history are kept in the JSON file
  `--state`, so a restarted process can load them (replaying the history as v1
  `user_message_chunk` / `agent_message_chunk` updates).

The prompt text drives the turn:
- `[wait:NAME]`: sends the chunk `waiting NAME`, then waits until the file `--gates`/NAME exists
  (the test creates it) or the turn is cancelled (then `stopReason: "cancelled"`);
- `[work:SECONDS]`: keeps the turn running that long, unless it is cancelled (for
  `acp-once check`'s slow prompt);
- `[permission]`: asks `session/request_permission` (allow_once / reject_once) and answers
  `permission: <optionId>` or `permission: cancelled`;
- `[tool]`: a `tool_call` (in progress), then a `tool_call_update` (completed);
- `[plan]`: a `plan` with two entries;
- `[fail]`: the prompt is answered with an internal error;
- `[die]`: the process exits at once (status 3), the prompt unanswered;
- `[fs]`: asks the client for `fs/read_text_file` (even though it was told the client has no
  `fs`) and answers `fs: error <code>` or `fs: read`;
- otherwise the text is echoed back in two `agent_message_chunk`s: `echo: ` and the text.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any, cast

import acp
from acp.schema import (
    AgentCapabilities,
    AllowedOutcome,
    DeniedOutcome,
    InitializeResponse,
    LoadSessionResponse,
    NewSessionResponse,
    PermissionOption,
    PromptResponse,
    ToolCallUpdate,
)

_WAIT = re.compile(r"\[wait:([A-Za-z0-9_-]+)\]")
_WORK = re.compile(r"\[work:(\d+(?:\.\d+)?)\]")


class EffectsAgent:
    """The agent (see the module docstring)."""

    def __init__(self, effects: Path, state: Path | None, gates: Path | None, load: bool) -> None:
        self.effects = effects
        self.state = state
        self.gates = gates
        self.load = load
        self.conn: Any = None
        self.cancelled: dict[str, asyncio.Event] = {}
        self.sessions: dict[str, list[list[str]]] = self._read_state()

    def on_connect(self, conn: Any) -> None:
        self.conn = conn

    def _read_state(self) -> dict[str, list[list[str]]]:
        if self.state is None or not self.state.exists():
            return {}
        loaded: dict[str, list[list[str]]] = json.loads(self.state.read_text())
        return loaded

    def _write_state(self) -> None:
        if self.state is not None:
            tmp = self.state.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.sessions))
            os.replace(tmp, self.state)

    async def initialize(
        self, protocol_version: int, client_capabilities: Any = None, **kwargs: Any
    ) -> InitializeResponse:
        return InitializeResponse(
            protocol_version=acp.PROTOCOL_VERSION,
            agent_capabilities=AgentCapabilities(load_session=self.load),
        )

    async def new_session(self, cwd: str, **kwargs: Any) -> NewSessionResponse:
        session_id = f"v1sess-{uuid.uuid4().hex}"
        self.sessions[session_id] = []
        self._write_state()
        return NewSessionResponse(session_id=session_id)

    async def load_session(
        self, cwd: str, session_id: str, **kwargs: Any
    ) -> LoadSessionResponse | None:
        if not self.load:
            raise acp.RequestError.method_not_found("session/load")
        history = self.sessions.get(session_id)
        if history is None:
            raise acp.RequestError.resource_not_found(session_id)
        for role, text in history:
            update = (
                acp.update_user_message_text(text)
                if role == "user"
                else acp.update_agent_message_text(text)
            )
            await self.conn.session_update(session_id=session_id, update=update)
        return LoadSessionResponse()

    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        text = " ".join(getattr(block, "text", "") for block in prompt)
        with open(self.effects, "a", encoding="utf-8") as log:  # noqa: ASYNC230 (one short line)
            log.write(f"{session_id} {text}\n")
        history = self.sessions.setdefault(session_id, [])
        history.append(["user", text])
        cancelled = self.cancelled[session_id] = asyncio.Event()
        say = self.conn.session_update
        if "[die]" in text:
            os._exit(3)
        if "[fs]" in text:
            try:
                await self.conn.read_text_file(session_id=session_id, path="/etc/hostname")
                text = "fs: read"
            except acp.RequestError as exc:
                text = f"fs: error {exc.code}"
        if "[fail]" in text:
            raise acp.RequestError.internal_error({"reason": "asked to fail"})
        if "[plan]" in text:
            entries = [acp.plan_entry("look"), acp.plan_entry("answer")]
            await say(session_id=session_id, update=acp.update_plan(entries))
        if "[tool]" in text:
            tool_id = f"tool-{uuid.uuid4().hex}"
            start = acp.start_tool_call(tool_id, "count", kind="edit", status="in_progress")
            await say(session_id=session_id, update=start)
            done = acp.update_tool_call(tool_id, status="completed")
            await say(session_id=session_id, update=done)
        if "[permission]" in text:
            options = [
                PermissionOption(option_id="allow_once", name="Allow", kind="allow_once"),
                PermissionOption(option_id="reject_once", name="Reject", kind="reject_once"),
            ]
            answer = await self.conn.request_permission(
                session_id=session_id,
                tool_call=ToolCallUpdate(tool_call_id=f"tool-{uuid.uuid4().hex}", title="write"),
                options=options,
            )
            outcome = answer.outcome
            if isinstance(outcome, AllowedOutcome):
                text = f"permission: {outcome.option_id}"
            else:
                assert isinstance(outcome, DeniedOutcome)
                text = "permission: cancelled"
        wait = _WAIT.search(text)
        if wait is not None:
            name = wait.group(1)
            await say(
                session_id=session_id, update=acp.update_agent_message_text(f"waiting {name}")
            )
            assert self.gates is not None, "[wait:...] needs --gates"
            gate = self.gates / name
            while not gate.exists():
                if cancelled.is_set():
                    return PromptResponse(stop_reason="cancelled")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cancelled.wait(), 0.02)
        work = _WORK.search(text)
        if work is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cancelled.wait(), float(work.group(1)))
            if cancelled.is_set():
                return PromptResponse(stop_reason="cancelled")
        await say(session_id=session_id, update=acp.update_agent_message_text("echo: "))
        await say(session_id=session_id, update=acp.update_agent_message_text(text))
        history.append(["agent", f"echo: {text}"])
        self._write_state()
        return PromptResponse(stop_reason="end_turn")

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        event = self.cancelled.get(session_id)
        if event is not None:
            event.set()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--effects", type=Path, required=True)
    parser.add_argument("--state", type=Path)
    parser.add_argument("--gates", type=Path)
    parser.add_argument("--load", action="store_true")
    args = parser.parse_args()
    agent = EffectsAgent(args.effects, args.state, args.gates, args.load)
    # the SDK's Agent protocol lists every method; this agent implements the ones it needs
    asyncio.run(acp.run_agent(cast(acp.Agent, agent)))


if __name__ == "__main__":
    main()
