"""Typed builders for the `session/update` kinds an agent sends, and the check behind strict mode.

    from acp_once.agent import updates as u

    await ctx.emit(u.agent_message_chunk("Hello", message_id=mid))
    await ctx.emit(u.tool_call_update(tool_id, status="completed"))

Each builder returns the generated pydantic model of its kind (`acp_once.protocol.schema`),
validated on construction, so a wrong field fails where it is written rather than in a client.
`TurnContext.emit` takes such a model or a plain dict. The kinds are the schema's own
`sessionUpdate` literals: v2 has no separate `tool_call` kind (a `tool_call_update` with an id
the client has not seen creates the call) and no `plan` kind (`plan_update` carries a plan id).
`state_update` is not here: `SessionAgent` reports the session's state itself.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from acp_once.agent.state import new_id
from acp_once.protocol import schema as s
from acp_once.protocol.vocabulary import (
    Extension,
    NoticeSeverity,
    PlanEntryPriority,
    PlanEntryStatus,
    ToolCallStatus,
    ToolKind,
    check_open_value,
)

__all__ = [
    "ContentLike",
    "agent_message",
    "agent_message_chunk",
    "agent_thought",
    "agent_thought_chunk",
    "check_update",
    "new_message_id",
    "notice",
    "plan",
    "plan_entry",
    "plan_removed",
    "selected_option",
    "session_info",
    "text",
    "tool_call",
    "tool_call_content_chunk",
    "tool_call_update",
    "tool_content",
    "update_kinds",
    "usage_update",
]

ContentLike = str | Mapping[str, Any] | BaseModel
"""A content block: a string (a text block), a wire dict or a content block model."""

_UNSET: Any = object()  # "not given": patch semantics make `None` (clear) a real value


def new_message_id() -> str:
    """A fresh message id, for the chunks of one message and the whole message after them.

    Returns:
        The id.
    """
    return new_id("msg_agent")


def text(value: str) -> dict[str, Any]:
    """A text content block.

    Args:
        value: the text.

    Returns:
        The block as a wire dict (`{"type": "text", "text": value}`).
    """
    return {"type": "text", "text": value}


def _block(content: ContentLike) -> Any:
    if isinstance(content, str):
        return text(content)
    return content


def _fields(**fields: Any) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not _UNSET}


def agent_message_chunk(
    content: ContentLike, *, message_id: str | None = None
) -> s.SessionUpdateAgentMessageChunk:
    """A streamed piece of the agent's message (appended to what the message holds).

    Args:
        content: the piece: a string (a text block) or a content block.
        message_id: the message it belongs to; every chunk of one message must share it
            (None: a fresh id, for a message of one chunk).

    Returns:
        The `agent_message_chunk` update.
    """
    return s.SessionUpdateAgentMessageChunk.model_validate(
        {
            "sessionUpdate": "agent_message_chunk",
            "messageId": message_id or new_id("msg_agent"),
            "content": _block(content),
        }
    )


def agent_message(
    content: ContentLike | Iterable[ContentLike], *, message_id: str | None = None
) -> s.SessionUpdateAgentMessage:
    """The agent's whole message (it replaces what earlier chunks of the same id sent).

    Args:
        content: a string, a content block, or a list of them.
        message_id: the message's id (None: a fresh one).

    Returns:
        The `agent_message` update.
    """
    return s.SessionUpdateAgentMessage.model_validate(
        {
            "sessionUpdate": "agent_message",
            "messageId": message_id or new_id("msg_agent"),
            "content": _blocks(content),
        }
    )


def agent_thought_chunk(
    content: ContentLike, *, message_id: str | None = None
) -> s.SessionUpdateAgentThoughtChunk:
    """A streamed piece of the agent's reasoning.

    Args:
        content: the piece: a string (a text block) or a content block.
        message_id: the thought it belongs to, shared by all its chunks (None: a fresh id).

    Returns:
        The `agent_thought_chunk` update.
    """
    return s.SessionUpdateAgentThoughtChunk.model_validate(
        {
            "sessionUpdate": "agent_thought_chunk",
            "messageId": message_id or new_id("msg_thought"),
            "content": _block(content),
        }
    )


def agent_thought(
    content: ContentLike | Iterable[ContentLike], *, message_id: str | None = None
) -> s.SessionUpdateAgentThought:
    """The agent's whole thought message.

    Args:
        content: a string, a content block, or a list of them.
        message_id: the thought's id (None: a fresh one).

    Returns:
        The `agent_thought` update.
    """
    return s.SessionUpdateAgentThought.model_validate(
        {
            "sessionUpdate": "agent_thought",
            "messageId": message_id or new_id("msg_thought"),
            "content": _blocks(content),
        }
    )


def _blocks(content: ContentLike | Iterable[ContentLike]) -> list[Any]:
    if isinstance(content, str | Mapping | BaseModel):
        return [_block(content)]
    return [_block(item) for item in content]


def tool_content(content: ContentLike) -> dict[str, Any]:
    """Tool-call content holding one content block (the common kind; diffs and terminals are
    given as wire dicts).

    Args:
        content: a string (a text block) or a content block.

    Returns:
        `{"type": "content", "content": block}`.
    """
    return {"type": "content", "content": _block(content)}


def _tool_contents(content: Iterable[Any] | None) -> Any:
    if content is None:
        return None
    return [tool_content(item) if isinstance(item, str) else item for item in content]


def tool_call(
    title: str,
    *,
    kind: ToolKind | Extension = "other",
    status: ToolCallStatus | Extension = "pending",
    tool_call_id: str | None = None,
    name: str | None = None,
    content: Iterable[Any] | None = None,
    locations: Iterable[Mapping[str, Any] | str] | None = None,
    raw_input: Any = _UNSET,
) -> s.SessionUpdateToolCallUpdate:
    """A new tool call: a `tool_call_update` with an id the client has not seen yet.

    Args:
        title: what the tool is doing, for the user.
        kind: read, edit, delete, move, search, execute, think, fetch, switch_mode or other.
        status: pending, in_progress, paused, completed, failed or cancelled.
        tool_call_id: its id (None: a fresh one; read it back as `.tool_call_id`).
        name: the tool's programmatic name.
        content: tool-call content items (a string becomes a text item).
        locations: files it touches: paths or `{"path": ..., "line": ...}` dicts.
        raw_input: the tool's input, as the model sent it.

    Returns:
        The `tool_call_update` update.
    """
    return tool_call_update(
        tool_call_id or new_id("tool"),
        title=title,
        kind=kind,
        status=status,
        name=name if name is not None else _UNSET,
        content=_tool_contents(content) if content is not None else _UNSET,
        locations=locations if locations is not None else _UNSET,
        raw_input=raw_input,
    )


def tool_call_update(
    tool_call_id: str,
    *,
    status: ToolCallStatus | Extension | None = _UNSET,
    title: str | None = _UNSET,
    kind: ToolKind | Extension | None = _UNSET,
    name: str | None = _UNSET,
    content: Iterable[Any] | None = _UNSET,
    locations: Iterable[Mapping[str, Any] | str] | None = _UNSET,
    raw_input: Any = _UNSET,
    raw_output: Any = _UNSET,
) -> s.SessionUpdateToolCallUpdate:
    """A change to a tool call. Fields not given are left unchanged; `None` clears one.

    Args:
        tool_call_id: the tool call's id.
        status: its new status (pending, in_progress, paused, completed, failed, cancelled).
        title: its new title.
        kind: its new kind.
        name: its new programmatic name.
        content: its whole new content (replaces the previous items; strings become text).
        locations: its new locations (paths or location dicts).
        raw_input: the tool's input.
        raw_output: the tool's output.

    Returns:
        The `tool_call_update` update.
    """
    if locations is not _UNSET and locations is not None:
        locations = [{"path": loc} if isinstance(loc, str) else loc for loc in locations]
    if content is not _UNSET:
        content = _tool_contents(content)
    return s.SessionUpdateToolCallUpdate.model_validate(
        {
            "sessionUpdate": "tool_call_update",
            "toolCallId": tool_call_id,
            **_fields(
                status=status,
                title=title,
                kind=kind,
                name=name,
                content=content,
                locations=locations,
                rawInput=raw_input,
                rawOutput=raw_output,
            ),
        }
    )


def tool_call_content_chunk(
    tool_call_id: str, content: ContentLike
) -> s.SessionUpdateToolCallContentChunk:
    """One more content item for a tool call (appended; `tool_call_update` replaces them all).

    Args:
        tool_call_id: the tool call's id.
        content: a string (a text item), or a tool-call content dict or model.

    Returns:
        The `tool_call_content_chunk` update.
    """
    item = tool_content(content) if isinstance(content, str) else content
    return s.SessionUpdateToolCallContentChunk.model_validate(
        {"sessionUpdate": "tool_call_content_chunk", "toolCallId": tool_call_id, "content": item}
    )


def plan_entry(
    content: str,
    *,
    status: PlanEntryStatus | Extension = "pending",
    priority: PlanEntryPriority | Extension = "medium",
) -> s.PlanEntry:
    """One task of a plan.

    Args:
        content: what the task does.
        status: pending, in_progress, completed or cancelled.
        priority: high, medium or low.

    Returns:
        The entry.
    """
    return s.PlanEntry(content=content, status=status, priority=priority)


def plan(
    entries: Iterable[s.PlanEntry | Mapping[str, Any] | str], *, plan_id: str = "plan"
) -> s.SessionUpdatePlanUpdate:
    """The whole current plan, as entries (the client replaces the plan with each update).

    Args:
        entries: the tasks: `plan_entry` results, wire dicts, or strings (pending, medium).
        plan_id: the plan's id (one plan per session by default).

    Returns:
        The `plan_update` update.
    """
    items = [plan_entry(entry) if isinstance(entry, str) else entry for entry in entries]
    return s.SessionUpdatePlanUpdate.model_validate(
        {
            "sessionUpdate": "plan_update",
            "plan": {"type": "items", "planId": plan_id, "entries": items},
        }
    )


def plan_removed(plan_id: str = "plan") -> s.SessionUpdatePlanRemoved:
    """The plan `plan_id` is gone.

    Args:
        plan_id: the plan's id.

    Returns:
        The `plan_removed` update.
    """
    return s.SessionUpdatePlanRemoved.model_validate(
        {"sessionUpdate": "plan_removed", "planId": plan_id}
    )


def usage_update(used: int, size: int, *, cost: Mapping[str, Any] | None = None) -> Any:
    """The context window's use (and optionally the session's cost so far).

    Args:
        used: tokens in context.
        size: the context window's size in tokens.
        cost: the cumulative cost (`{"amount": ..., "currency": "USD"}`).

    Returns:
        The `usage_update` update (`s.SessionUpdateUsageUpdate`).
    """
    fields: dict[str, Any] = {"sessionUpdate": "usage_update", "used": used, "size": size}
    if cost is not None:
        fields["cost"] = cost
    return s.SessionUpdateUsageUpdate.model_validate(fields)


def session_info(*, title: str | None = _UNSET) -> s.SessionUpdateSessionInfoUpdate:
    """A change to the session's metadata (not given: unchanged; `None`: cleared).

    Args:
        title: the session's new title.

    Returns:
        The `session_info_update` update.
    """
    return s.SessionUpdateSessionInfoUpdate.model_validate(
        {"sessionUpdate": "session_info_update", **_fields(title=title)}
    )


def notice(
    title: str, *, severity: NoticeSeverity | Extension = "info", description: str | None = None
) -> Any:
    """A fire-and-forget note for the user (not history: never retain it).

    Args:
        title: a non-empty plain-text title.
        severity: info, warning or error.
        description: more detail.

    Returns:
        The `notice` update (`s.SessionUpdateNotice`).
    """
    fields: dict[str, Any] = {"sessionUpdate": "notice", "title": title, "severity": severity}
    if description is not None:
        fields["description"] = description
    return s.SessionUpdateNotice.model_validate(fields)


def selected_option(response: s.RequestPermissionResponse) -> str | None:
    """The option the user chose in answer to `TurnContext.request_permission`.

    Args:
        response: the client's answer.

    Returns:
        The chosen option's id; None when the request was cancelled (not approved).
    """
    option_id = getattr(response.outcome, "option_id", None)
    return option_id if isinstance(option_id, str) else None


@functools.cache
def _kinds() -> dict[str, TypeAdapter[Any]]:
    """Per `sessionUpdate` literal of the schema, an adapter over the kinds that name it.
    Made on the first check, not at import: the unions' validators cost ~10 ms of every
    agent process's start, and only `check_update`'s callers need them."""
    members = typing.get_args(s.UpdateSessionNotification.model_fields["update"].annotation)
    by_tag: dict[str, list[Any]] = {}
    for kind in members:
        field = kind.model_fields.get("session_update")
        if field is None or typing.get_origin(field.annotation) is not typing.Literal:
            continue  # the catch-all (SessionUpdateOther): strict mode wants a known kind
        for tag in typing.get_args(field.annotation):
            by_tag.setdefault(tag, []).append(kind)
    adapters: dict[str, TypeAdapter[Any]] = {}
    for tag, kinds in by_tag.items():
        union: Any = kinds[0] if len(kinds) == 1 else typing.Union[tuple(kinds)]  # noqa: UP007
        adapters[tag] = TypeAdapter(union)
    return adapters


def update_kinds() -> list[str]:
    """Every `sessionUpdate` value the schema names, sorted.

    Returns:
        The kinds.
    """
    return sorted(_kinds())


def check_update(update: Mapping[str, Any]) -> None:
    """Validate a wire `update` dict against the schema model of its `sessionUpdate` kind.

    Args:
        update: the `update` object of a `session/update` notification.

    Raises:
        ValueError: an unknown kind (the message lists the valid ones), a field that does not
            fit the kind (the message names the field and says why), or a value of an open set
            (a tool call's kind or status, a stop reason, a plan entry's status or priority, a
            notice's severity) that is neither known nor an extension starting with `_`
            (`acp_once.protocol.vocabulary`).
    """
    kind = update.get("sessionUpdate")
    adapter = _kinds().get(kind) if isinstance(kind, str) else None
    if adapter is None:
        raise ValueError(
            f"invalid session update: unknown sessionUpdate {kind!r}; "
            f"valid kinds: {', '.join(update_kinds())}"
        )
    try:
        adapter.validate_python(update)
    except ValidationError as exc:
        # one line per field: a union (content blocks) fails once per member, and the first
        # member's complaint says enough
        problems: dict[str, str] = {}
        for error in exc.errors(include_url=False):
            field = str(error["loc"][0]) if error["loc"] else "update"
            problems.setdefault(field, error["msg"])
        detail = "; ".join(f"field {field!r}: {msg}" for field, msg in problems.items())
        raise ValueError(f"invalid {kind} update: {detail}") from None
    try:
        _check_open_values(str(kind), update)
    except ValueError as exc:
        raise ValueError(f"invalid {kind} update: {exc}") from None


def _check_open_values(kind: str, update: Mapping[str, Any]) -> None:
    """The open string sets of `update` hold a known value or an extension (`_name`)."""
    if kind == "tool_call_update":
        for field in ("kind", "status"):
            if update.get(field) is not None:
                check_open_value(field, update[field])
    elif kind == "state_update":
        if update.get("stopReason") is not None:
            check_open_value("stopReason", update["stopReason"])
    elif kind == "plan_update":
        for entry in update.get("plan", {}).get("entries", ()):
            check_open_value("planStatus", entry.get("status"))
            check_open_value("priority", entry.get("priority"))
    elif kind == "notice":
        check_open_value("severity", update.get("severity"))
