"""The reference agent behind `acp-once agent`: a scripted turn anyone can drive every trace with.

The turn, for each inserted user message:
- echoes the prompt text as an `agent_message` (retained);
- `[work:SECONDS]` in the text keeps the turn running that long (a prompt sent meanwhile is
  held, or inserted at once under the steer policy);
- `[tool]` runs a tool call whose side effect appends one line to the session's side-effect log
  (`<side-effects dir>/<session id>.log`), so repeated work can be counted;
- a text starting with `/` is a locally handled command: echoed live, not retained, its key kept
  in memory while the session is active.

Fault injection for tests: with `ACP_ONCE_CRASH=after-insert` in the environment the process
kills itself with SIGKILL right after committing a user message, before anyone is answered
(`acp_once.agent.faults` reads the variables that say how often).

Interrupted work after a restart (the agent died after inserting a message and before its turn
ended): by default its end record is stored as `idle` with `stopReason: "error"` and the
message "The agent restarted before the turn finished", replayed by every later resume; with
`--interrupted continue` the turn runs again instead, once (its tool is idempotent per
message). Its tool call and the tool call's updates are retained, so a replay shows them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from acp_once.agent.faults import CRASH_ENV, CRASH_MARKER_ENV, CRASH_RATE_ENV, CrashAfterInsert
from acp_once.agent.runtime import HeldPolicy, SessionAgent, Turn
from acp_once.agent.state import new_id
from acp_once.protocol.vocabulary import Extension, StopReason

if TYPE_CHECKING:
    from acp_once.agent.runtime import TurnContext
    from acp_once.storage.base import SessionStore

__all__ = ["CRASH_ENV", "CRASH_MARKER_ENV", "CRASH_RATE_ENV", "ReferenceAgent"]

_WORK = re.compile(r"\[work:(\d+(?:\.\d+)?)\]")


class ReferenceAgent(SessionAgent):
    """The scripted reference agent (see the module docstring)."""

    def __init__(
        self,
        store: SessionStore,
        *,
        side_effects: Path,
        policy: HeldPolicy = "hold",
        compare_prompts: bool = True,
        resume_interrupted: bool = False,
    ) -> None:
        super().__init__(
            store,
            policy=policy,
            compare_prompts=compare_prompts,
            resume_interrupted=resume_interrupted,
            name="acp-once-reference",
        )
        self.side_effects = side_effects
        self._crash = CrashAfterInsert.from_env()

    def agent_capabilities(self) -> dict[str, Any]:
        # every content block kind of the schema: the reference agent stores and echoes them all
        capabilities = super().agent_capabilities()
        capabilities["session"] = {
            **capabilities.get("session", {}),
            "prompt": {"image": {}, "audio": {}, "embeddedContext": {}},
        }
        return capabilities

    async def after_insert(self, session_id: str, message_id: str) -> None:
        if self._crash is not None:
            self._crash.maybe_crash(message_id)

    async def run_turn(self, turn: Turn, emit: TurnContext) -> StopReason | Extension:
        text = turn.text
        if turn.live_only:
            await emit.emit(
                {
                    "sessionUpdate": "agent_message",
                    "messageId": new_id("msg_agent"),
                    "content": [{"type": "text", "text": f"command {text.split()[0]} done"}],
                }
            )
            return "end_turn"
        if "[tool]" in text:
            tool_id = new_id("tool")
            await emit.emit(
                {
                    "sessionUpdate": "tool_call_update",
                    "toolCallId": tool_id,
                    "title": "append to the side-effect log",
                    "kind": "edit",
                    "status": "in_progress",
                }
            )
            await anyio.to_thread.run_sync(self._side_effect, turn.session_id, turn.message_id)
            await emit.emit(
                {"sessionUpdate": "tool_call_update", "toolCallId": tool_id, "status": "completed"}
            )
        work = _WORK.search(text)
        if work:
            await anyio.sleep(float(work.group(1)))
        await emit.emit(
            {
                "sessionUpdate": "agent_message",
                "messageId": new_id("msg_agent"),
                "content": [{"type": "text", "text": text}],
            },
            retain=True,
            final=True,  # stored with the turn's closing marker: one write, not two
        )
        return "end_turn"

    def _side_effect(self, session_id: str, message_id: str) -> None:
        # The tool is idempotent per message: a turn run again after a crash (with
        # --interrupted continue) must not repeat its effect.
        self.side_effects.mkdir(parents=True, exist_ok=True)
        path = self.side_effects / f"{session_id}.log"
        if path.exists() and message_id in path.read_text(encoding="utf-8").split():
            return
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{message_id}\n")
            log.flush()
            os.fsync(log.fileno())
