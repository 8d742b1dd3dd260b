"""What crosses between the v2 face and the v1 child, as data: pure functions, no I/O.

- `UpdateTranslator` turns the child's v1 `session/update`s of one turn into v2 updates, each
  with what the runtime does with it (`Out.mode`): v1 message chunks carry no id, so the
  translator gives each run of chunks of one kind a message id, sends the chunks live under
  it, and when the run ends (another kind arrives, or the turn ends) hands back the whole
  message to store for replay. Tool calls and plans are sent and stored; the other kinds are
  live only. A v1 update that has no v2 counterpart (`current_mode_update`, the child's echo of
  the user's message) is dropped.
- `prompt_to_v1`, `permission_to_v2`, `permission_to_v1`: the prompt's content blocks
  (the same shapes in both versions), and a permission request and its answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from acp_once.agent.state import new_id
from acp_once.agent.updates import check_update

__all__ = [
    "CLIENT_CAPABILITIES",
    "Out",
    "UpdateTranslator",
    "permission_to_v1",
    "permission_to_v2",
    "prompt_to_v1",
    "stop_reason",
]

CLIENT_CAPABILITIES: dict[str, Any] = {
    "fs": {"readTextFile": False, "writeTextFile": False},
    "terminal": False,
}
"""What the child is told the client can do: nothing beyond the protocol itself. v2 has no
file system or terminal methods to forward them to, so the child uses its own."""

_STOP_REASONS = frozenset({"end_turn", "max_tokens", "max_turn_requests", "refusal", "cancelled"})
# v1 chunk kind -> the v2 chunk kind and the whole-message kind stored after the run
_CHUNKS = {
    "agent_message_chunk": ("agent_message_chunk", "agent_message"),
    "agent_thought_chunk": ("agent_thought_chunk", "agent_thought"),
}
_TOOL_FIELDS = ("title", "kind", "status", "content", "locations", "rawInput", "rawOutput")
_LIVE_KINDS = frozenset(
    {"available_commands_update", "session_info_update", "usage_update", "config_option_update"}
)
_DROPPED = frozenset({"user_message_chunk", "current_mode_update"})

Mode = Literal["live", "retain", "store"]


@dataclass(frozen=True, slots=True)
class Out:
    """One v2 update and what to do with it: `live` sent only, `retain` stored and sent,
    `store` stored only (a whole message whose chunks were sent already)."""

    update: dict[str, Any]
    mode: Mode


@dataclass(slots=True)
class _Run:
    kind: str  # the v1 chunk kind
    message_id: str
    blocks: list[dict[str, Any]] = field(default_factory=list)


class UpdateTranslator:
    """The v1 updates of one session's turn, as v2 updates (see the module docstring).

    Args:
        plan_id: the id of the session's one v2 plan (a v1 `plan` replaces the whole plan).
    """

    def __init__(self, plan_id: str) -> None:
        self.plan_id = plan_id
        self.dropped = 0
        """v1 updates that had no valid v2 counterpart."""
        self._run: _Run | None = None

    def translate(self, update: Any) -> list[Out]:
        """The v2 updates for the v1 `update` (a wire dict), in order; [] when it has none."""
        if not isinstance(update, dict):
            self.dropped += 1
            return []
        kind = update.get("sessionUpdate")
        chunk = _CHUNKS.get(kind) if isinstance(kind, str) else None
        out: list[Out] = []
        if chunk is not None:
            content = update.get("content")
            if not isinstance(content, dict):
                self.dropped += 1
                return []
            if self._run is None or self._run.kind != kind:
                out.extend(self.finish())
                self._run = _Run(str(kind), new_id("msg_agent"))
            run = self._run
            _append_block(run.blocks, content)
            out.append(
                Out(
                    {"sessionUpdate": chunk[0], "messageId": run.message_id, "content": content},
                    "live",
                )
            )
            return self._valid(out)
        if kind in _DROPPED:
            return []
        out.extend(self.finish())
        if kind in ("tool_call", "tool_call_update"):
            tool = _tool_call_update(update)
            if tool is not None:
                out.append(Out(tool, "retain"))
        elif kind == "plan":
            out.append(
                Out(
                    {
                        "sessionUpdate": "plan_update",
                        "plan": {
                            "type": "items",
                            "planId": self.plan_id,
                            "entries": _list(update.get("entries")),
                        },
                    },
                    "retain",
                )
            )
        elif kind in _LIVE_KINDS:
            out.append(Out(_without_nulls(update), "live"))
        else:
            self.dropped += 1
        return self._valid(out)

    def finish(self) -> list[Out]:
        """The whole message of the run of chunks in progress, to store (none: [])."""
        run, self._run = self._run, None
        if run is None or not run.blocks:
            return []
        whole_kind = _CHUNKS[run.kind][1]
        whole = {"sessionUpdate": whole_kind, "messageId": run.message_id, "content": run.blocks}
        return self._valid([Out(whole, "store")])

    def _valid(self, outs: Iterable[Out]) -> list[Out]:
        """Keep what v2 accepts: a child's malformed update is dropped, never forwarded."""
        kept: list[Out] = []
        for out in outs:
            try:
                check_update(out.update)
            except ValueError:
                self.dropped += 1
                continue
            kept.append(out)
        return kept


def _append_block(blocks: list[dict[str, Any]], block: dict[str, Any]) -> None:
    """Add a chunk's block to a whole message: adjacent text joins into one text block."""
    if (
        blocks
        and block.get("type") == "text"
        and blocks[-1].get("type") == "text"
        and isinstance(block.get("text"), str)
        and set(block) <= {"type", "text"}
        and set(blocks[-1]) <= {"type", "text"}
    ):
        blocks[-1] = {"type": "text", "text": blocks[-1]["text"] + block["text"]}
    else:
        blocks.append(dict(block))


def _tool_call_update(update: dict[str, Any]) -> dict[str, Any] | None:
    tool_call_id = update.get("toolCallId")
    if not isinstance(tool_call_id, str):
        return None
    out: dict[str, Any] = {"sessionUpdate": "tool_call_update", "toolCallId": tool_call_id}
    for name in _TOOL_FIELDS:
        value = update.get(name)
        if value is not None:
            out[name] = value
    return out


def _without_nulls(update: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in update.items() if value is not None}


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


def stop_reason(result: Any) -> str:
    """The v2 stop reason of a v1 `session/prompt` result (an unknown one: `end_turn`, as the
    turn did end)."""
    reason = result.get("stopReason") if isinstance(result, dict) else None
    return reason if isinstance(reason, str) and reason in _STOP_REASONS else "end_turn"


def prompt_to_v1(blocks: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A v2 prompt's content blocks (wire dicts) for the child's v1 `session/prompt`: text,
    image, audio, resource links and embedded resources have the same shapes in v1."""
    return [dict(block) for block in blocks]


def permission_to_v2(params: dict[str, Any], session_id: str) -> dict[str, Any]:
    """The v2 `session/request_permission` params for the child's v1 request `params`, in the
    v2 session `session_id`: the tool call's title becomes the request's title, the tool call
    its subject.

    Raises:
        ValueError: `params` has no options or no tool call id.
    """
    tool = params.get("toolCall")
    options = params.get("options")
    if not isinstance(tool, dict) or not isinstance(tool.get("toolCallId"), str):
        raise ValueError("the permission request names no tool call")
    if not isinstance(options, list) or not options:
        raise ValueError("the permission request offers no options")
    title = tool.get("title")
    return {
        "sessionId": session_id,
        "title": title if isinstance(title, str) and title else "Permission requested",
        "options": [_without_nulls(o) if isinstance(o, dict) else o for o in options],
        "subject": {"type": "tool_call", "toolCall": {"toolCallId": tool["toolCallId"]}},
    }


def permission_tool_call(params: dict[str, Any]) -> dict[str, Any] | None:
    """The v2 `tool_call_update` announcing the tool call a v1 permission request is about (it
    may not have been reported before), or None."""
    tool = params.get("toolCall")
    return _tool_call_update(tool) if isinstance(tool, dict) else None


def permission_to_v1(answer: dict[str, Any]) -> dict[str, Any]:
    """The v1 answer for the v2 client's `answer` (the outcomes have the same shapes); anything
    but a selected option is `cancelled`."""
    outcome = answer.get("outcome")
    if (
        isinstance(outcome, dict)
        and outcome.get("outcome") == "selected"
        and isinstance(outcome.get("optionId"), str)
    ):
        return {"outcome": {"outcome": "selected", "optionId": outcome["optionId"]}}
    return {"outcome": {"outcome": "cancelled"}}
