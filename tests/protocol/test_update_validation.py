"""`validate_update_notification` gives what `UpdateSessionNotification.model_validate` gives.

It validates an update against the kinds its `sessionUpdate` tag allows instead of all 23: the
result (class, fields, extras, which fields were set) and the errors must be the same as the
whole model's for any input, known kinds and malformed, custom and future ones alike.
"""

from __future__ import annotations

import typing
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from acp_once.protocol import schema as s
from acp_once.protocol.updates import validate_update_notification

KINDS = typing.get_args(s.UpdateSessionNotification.model_fields["update"].annotation)
TAGS = sorted(
    {
        tag
        for kind in KINDS
        for tag in typing.get_args(kind.model_fields["session_update"].annotation)
        if isinstance(tag, str)
    }
)

TEXT = [{"type": "text", "text": "hello"}]
VALUES: dict[str, list[Any]] = {
    "messageId": ["msg_1", 5, None],
    "content": [TEXT, [], [{"type": "text"}], {"type": "text", "text": "x"}, "text"],
    "state": ["running", "idle", "requires_action", "cancelled", "junk", 3],
    "stopReason": ["end_turn", "cancelled", "error", "nope"],
    "error": [{"code": -32603, "message": "failed"}, "bad"],
    "toolCallId": ["tool_1", 7],
    "status": ["pending", "in_progress", "completed", "failed", "odd"],
    "title": ["a title", None, 1],
    "kind": ["edit", "read", "other", "weird"],
    "entries": [[], [{"content": "step", "priority": "high", "status": "pending"}], "x"],
    "terminalId": ["term_1"],
    "data": ["output", 1],
    "text": ["chunk"],
    "used": [10, "many"],
    "size": [100],
    "_meta": [{"trace": "1"}, "meta"],
    "x-vendor": [True, {"nested": [1, 2]}],
}
REALISTIC = [
    {"sessionUpdate": "user_message", "messageId": "msg_user_1", "content": TEXT},
    {"sessionUpdate": "agent_message", "messageId": "msg_agent_1", "content": TEXT},
    {"sessionUpdate": "agent_message_chunk", "messageId": "msg_agent_1", "content": TEXT[0]},
    {"sessionUpdate": "state_update", "state": "running"},
    {"sessionUpdate": "state_update", "state": "idle", "stopReason": "end_turn"},
    {"sessionUpdate": "state_update", "state": "idle", "stopReason": "error", "error": {}},
    {"sessionUpdate": "tool_call_update", "toolCallId": "t1", "status": "completed"},
    {"sessionUpdate": "_vendor_update", "payload": [1, 2]},
    {"sessionUpdate": "future_kind"},
    {"sessionUpdate": 3},
    {"no": "tag"},
]


def same(params: Any) -> None:
    try:
        expected = s.UpdateSessionNotification.model_validate(params or {})
    except ValidationError as exc:
        with pytest.raises(ValidationError) as caught:
            validate_update_notification(params)
        assert caught.value.title == exc.title
        assert caught.value.errors() == exc.errors()
        return
    got = validate_update_notification(params)
    assert type(got) is s.UpdateSessionNotification
    assert got == expected
    assert type(got.update) is type(expected.update)
    assert got.model_fields_set == expected.model_fields_set
    assert got.model_extra == expected.model_extra
    assert got.update.model_fields_set == expected.update.model_fields_set
    assert got.update.model_extra == expected.update.model_extra
    assert got.model_dump(by_alias=True, exclude_unset=True) == expected.model_dump(
        by_alias=True, exclude_unset=True
    )


@pytest.mark.parametrize("update", REALISTIC)
@pytest.mark.parametrize(
    "envelope",
    [{"sessionId": "sess_1"}, {"sessionId": "sess_1", "_meta": {"a": 1}, "extra": 2}, {}],
)
def test_the_updates_agents_send(update: dict[str, Any], envelope: dict[str, Any]) -> None:
    same({**envelope, "update": update})


def test_no_params_and_an_update_that_is_no_object() -> None:
    same(None)
    same({"sessionId": "sess_1", "update": "state_update"})
    same({"sessionId": 1, "update": REALISTIC[0]})  # the envelope's error, in its own words


@st.composite
def notifications(draw: st.DrawFn) -> dict[str, Any]:
    tag = draw(st.sampled_from([*TAGS, "_vendor_update", "future_kind"]))
    names = draw(st.lists(st.sampled_from(sorted(VALUES)), max_size=5, unique=True))
    update: dict[str, Any] = {"sessionUpdate": tag}
    for name in names:
        update[name] = draw(st.sampled_from(VALUES[name]))
    envelope: dict[str, Any] = {"sessionId": draw(st.sampled_from(["sess_1", "sess_1", 2]))}
    if draw(st.booleans()):
        envelope["_meta"] = {"k": "v"}
    return {**envelope, "update": update}


@settings(max_examples=400, deadline=None)
@given(notifications())
def test_any_update_validates_as_the_whole_model_does(params: dict[str, Any]) -> None:
    same(params)
