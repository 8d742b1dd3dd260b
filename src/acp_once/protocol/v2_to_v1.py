"""ACP v2 -> v1 as pure functions: what an agent written for v2 sends, in the shape a v1 client
reads (the agent's "v1 face", `acp_once.agent.v1face`, does the I/O).

- `V2ToV1Updates` turns each v2 `session/update` object into the v1 updates that say the
  same thing (none when v1 has no such kind: `state_update`, terminals, `plan_removed`...).
- `v1_stop_reason_from_v2`, `initialize_response`, `permission_request`: the v1 form of a
  turn's stop reason, of an `initialize` result and of a permission request.

The other direction (a v1 agent's updates for a v2 client) is `acp_once.protocol.v1_to_v2`.

No I/O: everything here maps dicts (the wire form) to dicts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = [
    "V1_STOP_REASONS",
    "V2ToV1Updates",
    "initialize_response",
    "permission_request",
    "v1_stop_reason_from_v2",
]

V1_STOP_REASONS = frozenset({"end_turn", "max_tokens", "max_turn_requests", "refusal", "cancelled"})
"""The stop reasons a v1 `session/prompt` result may carry."""

_MESSAGE_KINDS = {
    "user_message": "user_message_chunk",
    "agent_message": "agent_message_chunk",
    "agent_thought": "agent_thought_chunk",
}
_CHUNK_KINDS = frozenset(_MESSAGE_KINDS.values())
# kinds whose v1 shape is the v2 shape (the Python SDK 0.12.1 client knows each of them)
_SAME_SHAPE = frozenset(
    {"available_commands_update", "config_option_update", "session_info_update", "usage_update"}
)
# v1 tool call statuses are pending, in_progress, completed, failed
_TOOL_STATUS = {"paused": "in_progress", "cancelled": "failed"}
_TOOL_FIELDS = (
    "name",
    "title",
    "kind",
    "status",
    "content",
    "locations",
    "rawInput",
    "rawOutput",
    "_meta",
)
_V = TypeVar("_V")
_REMEMBERED = 1024  # ids kept per translator: old tool calls and messages are done with


def v1_stop_reason_from_v2(reason: object) -> str:
    """The v1 stop reason for a v2 idle `stopReason`: the same where v1 has it, else
    `end_turn` (a missing reason, or an extension's own). `error` is not a stop reason in v1:
    the caller answers an error instead."""
    return reason if isinstance(reason, str) and reason in V1_STOP_REASONS else "end_turn"


def initialize_response(
    result: Mapping[str, Any], *, load_session: bool, session_methods: Iterable[str] = ()
) -> dict[str, Any]:
    """The v1 `InitializeResponse` for a v2 `initialize` result.

    Args:
        result: the v2 result (wire form): `info` becomes `agentInfo`, the advertised prompt
            content blocks become `promptCapabilities`; v2-only capabilities and `_meta`
            (acp-once's key marker: v1 has no keys) are left out.
        load_session: whether `session/load` is served (`agentCapabilities.loadSession`).
        session_methods: which of v1's optional session methods are served ("list",
            "delete", "resume", "close"): `agentCapabilities.sessionCapabilities`.
    """
    capabilities = result.get("capabilities") or {}
    session = capabilities.get("session") or {}
    prompt = session.get("prompt") or {}
    mcp = session.get("mcp") or {}
    agent_capabilities: dict[str, Any] = {
        "loadSession": load_session,
        "promptCapabilities": {
            name: prompt.get(name) is not None for name in ("image", "audio", "embeddedContext")
        },
        "mcpCapabilities": {"http": mcp.get("http") is not None, "sse": False},
        "sessionCapabilities": {name: {} for name in session_methods},
    }
    response: dict[str, Any] = {
        "protocolVersion": 1,
        "agentCapabilities": agent_capabilities,
        "authMethods": [],
    }
    info = result.get("info")
    if isinstance(info, Mapping):
        response["agentInfo"] = dict(info)
    return response


def permission_request(request: Mapping[str, Any], fallback_tool_call_id: str) -> dict[str, Any]:
    """The v1 `session/request_permission` params for a v2 one.

    v1 asks about a tool call: a v2 request about one (`subject.type == "tool_call"`) keeps its
    tool call; any other gets a tool call of id `fallback_tool_call_id`. The v2 `title` (and
    `description`) become the tool call's title where it has none. The options and the answer
    have the same shape in both versions.
    """
    subject = request.get("subject") or {}
    tool: dict[str, Any] = {}
    if subject.get("type") == "tool_call":
        tool = _tool_fields(subject.get("toolCall") or {})
        tool["toolCallId"] = (subject.get("toolCall") or {}).get("toolCallId")
    if not isinstance(tool.get("toolCallId"), str):
        tool["toolCallId"] = fallback_tool_call_id
    if not tool.get("title"):
        description = request.get("description")
        title = request.get("title", "")
        tool["title"] = f"{title}: {description}" if description else title
    params: dict[str, Any] = {
        "sessionId": request["sessionId"],
        "toolCall": tool,
        "options": list(request.get("options") or []),
    }
    if request.get("_meta") is not None:
        params["_meta"] = request["_meta"]
    return params


def _tool_fields(update: Mapping[str, Any]) -> dict[str, Any]:
    fields = {name: update[name] for name in _TOOL_FIELDS if update.get(name) is not None}
    status = fields.get("status")
    if status in _TOOL_STATUS:
        fields["status"] = _TOOL_STATUS[status]
    return fields


@dataclass(slots=True)
class _Tool:
    """A tool call's content as v2 built it, and how much of it the v1 client was sent."""

    content: list[Any] = field(default_factory=list)
    sent: int = 0  # items of `content` in the last v1 update that carried it


class V2ToV1Updates:
    """Translates the v2 updates of one session, in order, for one v1 client.

    v1 and v2 differ in ways that need memory: a v2 `tool_call_update` for an unseen id
    creates the tool call (v1: `tool_call` first, then `tool_call_update`); a whole v2 message
    (`agent_message`) may replace the chunks streamed under its id, which v1 cannot express (the
    streamed chunks stand, the whole is not sent again). It remembers the last 1,024 tool calls
    and messages.

    v2 `tool_call_content_chunk` appends to a tool call's content, while a v1 update's
    `content` replaces the whole (v1 has no append, so a delta alone would erase what came
    before it). Sending the whole at every chunk costs the square of the output on the wire;
    instead the whole goes out when it has doubled (in items) since it was last sent, and
    whatever is held back goes out with the tool call's next `tool_call_update` and at the
    next `state_update` (the turn's end): the v1 client sees all of the content, at most twice
    the output in bytes plus the final whole, and never more than half of it late.
    """

    __slots__ = ("_behind", "_streamed", "_tools")

    def __init__(self) -> None:
        self._tools: OrderedDict[str, _Tool] = OrderedDict()
        self._behind: dict[str, None] = {}  # tools whose content went out only in part
        self._streamed: OrderedDict[str, None] = OrderedDict()  # message ids sent as chunks

    def translate(self, update: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The v1 updates (in order, possibly none) that carry what `update` says."""
        kind = update.get("sessionUpdate")
        if kind in _MESSAGE_KINDS:
            return self._message(_MESSAGE_KINDS[kind], update)
        if kind in _CHUNK_KINDS:
            if "content" not in update:
                return []
            message_id = update.get("messageId")
            if isinstance(message_id, str):
                _remember(self._streamed, message_id, None)
            return [_chunk(kind, update["content"], message_id, update.get("_meta"))]
        if kind == "tool_call_update":
            return [self._tool_call(update)]
        if kind == "tool_call_content_chunk":
            return self._tool_content(update)
        if kind == "plan_update":
            plan = update.get("plan") or {}
            if plan.get("type") != "items":
                return []  # file and markdown plans have no v1 form
            return [{"sessionUpdate": "plan", "entries": list(plan.get("entries") or [])}]
        if kind in _SAME_SHAPE:
            return [dict(update)]
        if kind == "state_update":
            return self.flush()
        # terminals, plan_removed, notices, compaction, subagents, inter-session messages,
        # extensions: nothing a v1 client would understand
        return []

    def flush(self) -> list[dict[str, Any]]:
        """A `tool_call_update` with the whole content of each tool call whose content went
        out only in part (none: [])."""
        behind, self._behind = self._behind, {}
        out = []
        for tool_call_id in behind:
            tool = self._tools.get(tool_call_id)
            if tool is not None and tool.sent < len(tool.content):
                out.append(
                    {
                        "sessionUpdate": "tool_call_update",
                        "toolCallId": tool_call_id,
                        "content": self._send(tool_call_id, tool),
                    }
                )
        return out

    def _message(self, chunk_kind: str, update: Mapping[str, Any]) -> list[dict[str, Any]]:
        message_id = update.get("messageId")
        if isinstance(message_id, str) and message_id in self._streamed:
            return []  # its chunks went out already: v1 has no way to replace them
        content = update.get("content") or []
        return [_chunk(chunk_kind, block, message_id, update.get("_meta")) for block in content]

    def _send(self, tool_call_id: str, tool: _Tool) -> list[Any]:
        """The whole content to send now (a copy: the list grows on)."""
        tool.sent = len(tool.content)
        self._behind.pop(tool_call_id, None)
        return list(tool.content)

    def _tool_call(self, update: Mapping[str, Any]) -> dict[str, Any]:
        tool_call_id = update.get("toolCallId")
        fields = _tool_fields(update)
        known = tool_call_id in self._tools
        if isinstance(tool_call_id, str):
            tool = self._tools.get(tool_call_id) or _Tool()
            content = fields.get("content")
            if content:
                tool.content = list(content)
                tool.sent = len(tool.content)
                self._behind.pop(tool_call_id, None)
            elif tool.sent < len(tool.content):
                fields["content"] = self._send(tool_call_id, tool)
            _remember(self._tools, tool_call_id, tool)
        if known:
            return {"sessionUpdate": "tool_call_update", "toolCallId": tool_call_id, **fields}
        fields.setdefault("title", "")
        return {"sessionUpdate": "tool_call", "toolCallId": tool_call_id, **fields}

    def _tool_content(self, update: Mapping[str, Any]) -> list[dict[str, Any]]:
        tool_call_id = update.get("toolCallId")
        if not isinstance(tool_call_id, str) or "content" not in update:
            return []
        tool = self._tools.get(tool_call_id)
        known = tool is not None
        if tool is None:
            tool = _Tool()
        tool.content.append(update["content"])
        _remember(self._tools, tool_call_id, tool)
        if known and len(tool.content) < 2 * tool.sent:
            self._behind[tool_call_id] = None  # held back: see the class docstring
            return []
        content = self._send(tool_call_id, tool)
        if known:
            return [
                {
                    "sessionUpdate": "tool_call_update",
                    "toolCallId": tool_call_id,
                    "content": content,
                }
            ]
        return [
            {
                "sessionUpdate": "tool_call",
                "toolCallId": tool_call_id,
                "title": "",
                "content": content,
            }
        ]


def _chunk(kind: str, content: Any, message_id: Any, meta: Any) -> dict[str, Any]:
    chunk: dict[str, Any] = {"sessionUpdate": kind, "content": content}
    if isinstance(message_id, str):
        chunk["messageId"] = message_id
    if meta is not None:
        chunk["_meta"] = meta
    return chunk


def _remember(seen: OrderedDict[str, _V], key: str, value: _V) -> None:
    seen[key] = value
    seen.move_to_end(key)
    while len(seen) > _REMEMBERED:
        seen.popitem(last=False)
