"""ACP v1 -> v2 as pure functions: what a v1 agent sends, in the shape a v2 client reads. The
one translation of v1 updates, used by both places that meet a v1 agent: the client's v1 face
(`acp_once.client.faces.V1Face`) and the upgrade runtime (`acp_once.upgrade.translate`, which
adds what to store). The other direction is `acp_once.protocol.v2_to_v1`. No I/O.

v1 and v2 name most updates alike, but v2 gives every message an id and a place in the
session's timeline, and v1 does not:

- v1 message chunks (`user_message_chunk`, `agent_message_chunk`, `agent_thought_chunk`) carry
  no `messageId`. The translator gives each run of chunks of one kind a message id: a chunk
  continues the current message of its kind until something else takes a place in the
  timeline (a chunk of another kind of message, or a new tool call), and then starts a new
  one. A v2 message's place is fixed by its first update, so text the agent streams after a
  tool call must be a new message to be shown after it, as a v1 client shows it. Thought
  chunks and agent message chunks may interleave without splitting each other (v2 lets chunks
  of different messages interleave).
- v1 `tool_call` (creation) and `tool_call_update` both become v2 `tool_call_update` (an
  upsert: the first update of an unseen id creates it).
- v1 `plan` (the whole plan, replacing the previous one) becomes v2 `plan_update` of an
  `items` plan with one id per translator (v1 has one plan per session).
- v1 `current_mode_update` has no v2 counterpart (v2 replaced modes by config options): it is
  kept as a generic update (`SessionUpdateOther`) with its v1 fields, which v2 clients
  preserve or ignore. So is any update whose v1 fields do not validate as the v2 kind of the
  same name.
- v2 tags each available command (`type: "command"`) and its input (`type: "text"`); the
  translator adds the tags.
- The other kinds (`available_commands_update`, `config_option_update`,
  `session_info_update`, `usage_update`, `notice`, `compaction_update`,
  `compaction_summary_chunk`) keep their name and fields.

v1 has no `state_update`: the end of a v1 turn is the answer to its `session/prompt`
(`{stopReason}`), which `idle_update` turns into the v2 idle state. v1 has no insertion
acknowledgement either: `user_message` makes the v2 update a v2 agent sends when it inserts a
prompt, for a caller that gives the prompt a message id of its own.

`v2_stop_reason_from_v1` reads the stop reason of a v1 `session/prompt` answer;
`answer_version` and `not_acp_reason` say which protocol an `initialize` answer speaks, or why
it speaks neither.

`V1ToV2Messages` reads what a v1 agent sends a client (its `session/update` notifications and
permission requests) as the v2 models, with one `V1ToV2Updates` per session.

`V1ToV2Updates` keeps the little state the message ids need, per session; everything else is
a function of its arguments. Ids come from `new_id` (random UUIDs unless the caller passes its
own, e.g. ids it stores).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import ValidationError

from acp_once.protocol import schema as s
from acp_once.protocol.initialization import PROTOCOL_VERSION
from acp_once.protocol.updates import validate_update_notification
from acp_once.protocol.v2_to_v1 import V1_STOP_REASONS
from acp_once.protocol.vocabulary import StopReason

if TYPE_CHECKING:
    from acp_once.protocol import v1

__all__ = [
    "V1ToV2Messages",
    "V1ToV2Updates",
    "answer_version",
    "idle_update",
    "not_acp_reason",
    "permission_request_to_v2",
    "running_update",
    "user_message",
    "v2_stop_reason_from_v1",
]

_Kind = Literal["user", "agent", "thought"]

_CHUNK_KIND: dict[str, _Kind] = {
    "user_message_chunk": "user",
    "agent_message_chunk": "agent",
    "agent_thought_chunk": "thought",
}

#: v1 updates whose v2 namesake has the same fields.
_SAME_NAME = frozenset(
    {
        "available_commands_update",
        "config_option_update",
        "session_info_update",
        "usage_update",
        "notice",
        "compaction_update",
        "compaction_summary_chunk",
    }
)


def _v1() -> ModuleType:
    """The v1 models, imported on first use: building them costs ~0.2 s, which a client that
    never meets a v1 agent does not pay."""
    from acp_once.protocol import v1

    return v1


def _new_uuid_id() -> str:
    return f"v1msg_{uuid.uuid4().hex}"


def _tag_commands(data: dict[str, Any]) -> dict[str, Any]:
    """v2 tags each available command (`type: "command"`) and its input (`type: "text"`)."""
    commands = []
    for command in data.get("availableCommands") or []:
        if isinstance(command, dict):
            command = {"type": "command", **command}
            hint = command.get("input")
            if isinstance(hint, dict) and "type" not in hint:
                command["input"] = {"type": "text", **hint}
        commands.append(command)
    return {**data, "availableCommands": commands}


def _notification(session_id: str, update: dict[str, Any]) -> s.UpdateSessionNotification:
    # an update the v2 kind of its name refuses validates as the generic kind (the union's
    # catch-all, `SessionUpdateOther`), its fields unchanged
    return validate_update_notification({"sessionId": session_id, "update": update})


def _other(session_id: str, update: dict[str, Any]) -> s.UpdateSessionNotification:
    """The update kept as a generic v2 update (`SessionUpdateOther`), fields unchanged."""
    other = s.SessionUpdateOther.model_validate(update)
    return s.UpdateSessionNotification(session_id=session_id, update=other)


def answer_version(result: Any) -> Literal[1, 2] | None:
    """Which protocol an agent's answer to a v2 `initialize` speaks, by its shape as well as its
    number: 2 (a valid v2 `InitializeResponse`), 1 (a valid v1 one: with `protocolVersion: 1`,
    or with a higher version copied from the request but without v2's required `info`, as the
    official Python SDK's echo agents answer `{"protocolVersion": 2}`), or None (neither: a
    malformed `info`, or a version this code does not know)."""
    if not isinstance(result, dict):
        return None
    version = result.get("protocolVersion")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        return None
    if version >= 2:
        try:
            s.InitializeResponse.model_validate(result)
        except ValidationError:
            if "info" in result:
                return None  # a broken v2 answer
        else:
            return 2 if version == 2 else None
    try:
        _v1().InitializeResponse.model_validate(result)
    except ValidationError:
        return None
    return 1


def not_acp_reason(answer: Any) -> str:
    """One line: why an `initialize` answer that `answer_version` placed in neither version
    is neither (a newer version, or the first field the model of its version refuses)."""
    version = answer.get("protocolVersion") if isinstance(answer, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > PROTOCOL_VERSION:
        return f"the agent answered protocol version {version}; this client speaks 1 and 2"
    model: Any = _v1().InitializeResponse if version == 1 else s.InitializeResponse
    try:
        model.model_validate(answer)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the answer"
        return f"the agent's initialize answer is not valid ACP: {where}: {first['msg']}"
    return f"the agent's initialize answer is not ACP v1 or v2 (protocolVersion {version!r})"


def v2_stop_reason_from_v1(result: Any) -> StopReason:
    """The v2 stop reason of a v1 `session/prompt` result: its `stopReason` where v1 has it,
    else `end_turn` (an unknown one, or none: the turn did end). The other way:
    `acp_once.protocol.v2_to_v1.v1_stop_reason_from_v2`."""
    reason = result.get("stopReason") if isinstance(result, dict) else None
    if isinstance(reason, str) and reason in V1_STOP_REASONS:
        return cast("StopReason", reason)  # every v1 stop reason is a v2 one
    return "end_turn"


def user_message(
    session_id: str, message_id: str, prompt: Sequence[dict[str, Any]]
) -> s.UpdateSessionNotification:
    """The v2 `user_message` update for a prompt sent to a v1 agent under `message_id`.

    Raises:
        pydantic.ValidationError: `prompt` holds something that is not a content block.
    """
    return _notification(
        session_id,
        {"sessionUpdate": "user_message", "messageId": message_id, "content": list(prompt)},
    )


def running_update(session_id: str) -> s.UpdateSessionNotification:
    """The v2 `state_update` that says a turn runs (v1 reports none)."""
    return _notification(session_id, {"sessionUpdate": "state_update", "state": "running"})


def idle_update(session_id: str, stop_reason: str | None) -> s.UpdateSessionNotification:
    """The v2 idle `state_update` for a v1 turn that ended with `stop_reason` (the v1
    `session/prompt` answer's `stopReason`; None when the turn ended without one)."""
    update: dict[str, Any] = {"sessionUpdate": "state_update", "state": "idle"}
    if stop_reason is not None:
        update["stopReason"] = stop_reason
    return _notification(session_id, update)


def permission_request_to_v2(params: v1.RequestPermissionRequest) -> s.RequestPermissionRequest:
    """A v1 `session/request_permission` as the v2 request: the v1 tool call becomes the
    request's `tool_call` subject, its title the request's title. The answer needs no
    translation: v1 and v2 both answer `{outcome: {outcome: "selected", optionId} |
    {outcome: "cancelled"}}`."""
    tool_call = params.tool_call.model_dump(by_alias=True, exclude_unset=True, mode="json")
    title = params.tool_call.title or params.tool_call.name or "Permission requested"
    request: dict[str, Any] = {
        "sessionId": params.session_id,
        "title": title,
        "subject": {"type": "tool_call", "toolCall": tool_call},
        "options": [o.model_dump(by_alias=True, exclude_unset=True) for o in params.options],
    }
    if params.field_meta is not None:
        request["_meta"] = params.field_meta
    return s.RequestPermissionRequest.model_validate(request)


class V1ToV2Updates:
    """Translates one v1 session's updates into v2 updates, in arrival order.

    Args:
        session_id: the session whose updates these are.
        new_id: makes message ids (default: random, `v1msg_<hex>`); it must not repeat.
        plan_id: the v2 plan id of the session's single v1 plan.
    """

    def __init__(
        self,
        session_id: str,
        *,
        new_id: Callable[[], str] = _new_uuid_id,
        plan_id: str = "plan",
    ) -> None:
        self.session_id = session_id
        self.plan_id = plan_id
        self._new_id = new_id
        self._current: dict[_Kind, str] = {}

    def begin_turn(self, user_message_id: str | None = None) -> str:
        """Start a new turn: the agent's next chunks start new messages, and user message
        chunks belong to `user_message_id` (a new id when None). Returns that id."""
        self._current = {"user": user_message_id or self._new_id()}
        return self._current["user"]

    def end_messages(self) -> None:
        """End the messages in progress: the agent's next chunks start new ones (as after a
        tool call)."""
        self._current = {}

    def current(self, kind: _Kind) -> str | None:
        """The id of the message of `kind` ("user", "agent", "thought") chunks now join."""
        return self._current.get(kind)

    def _message_id(self, kind: _Kind) -> str:
        # another kind of message ends the current one of the others: the next chunk of those
        # starts a new message after it (thoughts and agent text may interleave)
        keep: set[_Kind] = {"agent", "thought"} if kind != "user" else {"user"}
        self._current = {k: v for k, v in self._current.items() if k in keep}
        message_id = self._current.get(kind)
        if message_id is None:
            message_id = self._current[kind] = self._new_id()
        return message_id

    def translate(self, update: Any) -> list[s.UpdateSessionNotification]:
        """The v2 notifications for one v1 update: a `v1.SessionNotification`'s `update`
        model, or its wire form (a dict). Usually one; none for a dict that is not an update
        at all (no `sessionUpdate` string).

        Raises:
            pydantic.ValidationError: a v1 message chunk or tool call without the fields v1
                requires (a wire form that the v1 model would refuse).
        """
        data: dict[str, Any] = (
            update
            if isinstance(update, dict)
            else update.model_dump(by_alias=True, exclude_unset=True, mode="json")
        )
        tag = data.get("sessionUpdate")
        if not isinstance(tag, str):
            return []
        sid = self.session_id
        kind = _CHUNK_KIND.get(tag)
        if kind is not None:
            converted = {**data, "messageId": self._message_id(kind)}
            return [self._strict(converted, data, "ContentChunk")]
        if tag in ("tool_call", "tool_call_update"):
            if tag == "tool_call":
                if not isinstance(data.get("title"), str):
                    _v1().ToolCall.model_validate(data)  # raises: v1 requires a title
                # a new entity: the agent's next text goes after it
                self._current = {}
            fields = {k: v for k, v in data.items() if k != "sessionUpdate" and v is not None}
            converted = {**fields, "sessionUpdate": "tool_call_update"}
            return [self._strict(converted, data, "ToolCallUpdate")]
        if tag == "plan":
            plan: dict[str, Any] = {
                "type": "items",
                "planId": self.plan_id,
                "entries": data.get("entries", []),
            }
            plan_update: dict[str, Any] = {"sessionUpdate": "plan_update", "plan": plan}
            if "_meta" in data:
                plan_update["_meta"] = data["_meta"]
            return [_notification(sid, plan_update)]
        if tag == "available_commands_update":
            return [_notification(sid, _tag_commands(data))]
        if tag in _SAME_NAME:
            return [_notification(sid, data)]
        return [_other(sid, data)]

    def _strict(
        self, converted: dict[str, Any], original: dict[str, Any], v1_model: str
    ) -> s.UpdateSessionNotification:
        """`converted` as a v2 notification; if v2 refuses it, `original` is checked against
        the v1 model (raising its errors), and kept generic when v1 accepts it. v1 is not
        checked on the way that succeeds: it would double the cost of each update."""
        notification = _notification(self.session_id, converted)
        if isinstance(notification.update, s.SessionUpdateOther):
            getattr(_v1(), v1_model).model_validate(original)
        return notification

    def translate_notification(self, params: dict[str, Any]) -> list[s.UpdateSessionNotification]:
        """`translate` for the params of a v1 `session/update` notification (its `update`)."""
        update = params.get("update")
        return self.translate(update) if isinstance(update, dict) else []


class V1ToV2Messages:
    """What a v1 agent sends a client, as the v2 models a v2 agent's messages validate to: its
    `session/update` params through one `V1ToV2Updates` per session, its permission requests
    through `permission_request_to_v2`."""

    def __init__(self) -> None:
        self._translators: dict[str, V1ToV2Updates] = {}

    def translator(self, session_id: str) -> V1ToV2Updates:
        """The update translator of a session (made on first use)."""
        translator = self._translators.get(session_id)
        if translator is None:
            translator = self._translators[session_id] = V1ToV2Updates(session_id)
        return translator

    def session_updates(self, params: dict[str, Any] | None) -> list[s.UpdateSessionNotification]:
        """The v2 notifications for the params of a v1 `session/update`.

        Raises:
            pydantic.ValidationError: the params are not a valid v1 notification.
        """
        session_id = (params or {}).get("sessionId")
        if not isinstance(session_id, str):
            _v1().SessionNotification.model_validate(params or {})  # raises: says why
            return []
        return self.translator(session_id).translate_notification(params or {})

    def permission_request(self, params: dict[str, Any] | None) -> s.RequestPermissionRequest:
        """The v2 request for the params of a v1 `session/request_permission`.

        Raises:
            pydantic.ValidationError: the params are not a valid v1 request.
        """
        return permission_request_to_v2(_v1().RequestPermissionRequest.model_validate(params or {}))
