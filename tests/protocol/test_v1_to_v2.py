"""The v1 -> v2 update translation (`acp_once.protocol.v1_to_v2`): pure functions, no I/O."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from pydantic import ValidationError

from acp_once.protocol import schema as s
from acp_once.protocol import v1
from acp_once.protocol.v1_to_v2 import (
    V1ToV2Messages,
    V1ToV2Updates,
    answer_version,
    idle_update,
    permission_request_to_v2,
    running_update,
    user_message,
    v2_stop_reason_from_v1,
)


def _translator() -> V1ToV2Updates:
    counter = itertools.count(1)
    return V1ToV2Updates("sess_1", new_id=lambda: f"m{next(counter)}")


def _chunk(kind: str, text: str) -> dict[str, Any]:
    return {"sessionUpdate": kind, "content": {"type": "text", "text": text}}


def _wire(n: s.UpdateSessionNotification) -> dict[str, Any]:
    return n.model_dump(by_alias=True, exclude_unset=True, mode="json")["update"]  # type: ignore[no-any-return]


def test_agent_chunks_of_one_turn_share_a_message_id_and_are_typed() -> None:
    tr = _translator()
    user_id = tr.begin_turn("u1")
    out = [
        *tr.translate(_chunk("agent_message_chunk", "hel")),
        *tr.translate(_chunk("agent_message_chunk", "lo")),
    ]
    assert user_id == "u1"
    assert all(isinstance(n.update, s.SessionUpdateAgentMessageChunk) for n in out)
    assert [_wire(n)["messageId"] for n in out] == ["m1", "m1"]
    assert [_wire(n)["content"]["text"] for n in out] == ["hel", "lo"]
    assert all(n.session_id == "sess_1" for n in out)


def test_the_v1_model_form_translates_like_the_wire_form() -> None:
    note = v1.SessionNotification.model_validate(
        {"sessionId": "sess_1", "update": _chunk("agent_message_chunk", "hi")}
    )
    (n,) = _translator().translate(note.update)
    assert isinstance(n.update, s.SessionUpdateAgentMessageChunk)
    assert _wire(n) == {
        "sessionUpdate": "agent_message_chunk",
        "messageId": "m1",
        "content": {"type": "text", "text": "hi"},
    }


def test_text_after_a_tool_call_is_a_new_message_placed_after_it() -> None:
    tr = _translator()
    tr.begin_turn("u1")
    first = tr.translate(_chunk("agent_message_chunk", "let me look"))
    call = tr.translate(
        {"sessionUpdate": "tool_call", "toolCallId": "t1", "title": "Read file", "kind": "read"}
    )
    done = tr.translate(
        {"sessionUpdate": "tool_call_update", "toolCallId": "t1", "status": "completed"}
    )
    after = tr.translate(_chunk("agent_message_chunk", "done"))
    assert _wire(first[0])["messageId"] == "m1"
    assert isinstance(call[0].update, s.SessionUpdateToolCallUpdate)
    assert _wire(call[0]) == {
        "sessionUpdate": "tool_call_update",
        "toolCallId": "t1",
        "title": "Read file",
        "kind": "read",
    }
    assert isinstance(done[0].update, s.SessionUpdateToolCallUpdate)
    assert _wire(done[0])["status"] == "completed"
    assert _wire(after[0])["messageId"] == "m2"


def test_thoughts_and_text_interleave_without_splitting_each_other() -> None:
    tr = _translator()
    tr.begin_turn("u1")
    ids = [
        (_wire(n)["sessionUpdate"], _wire(n)["messageId"])
        for kind, text in [
            ("agent_thought_chunk", "hm"),
            ("agent_message_chunk", "a"),
            ("agent_thought_chunk", "so"),
            ("agent_message_chunk", "b"),
        ]
        for n in tr.translate(_chunk(kind, text))
    ]
    assert ids == [
        ("agent_thought_chunk", "m1"),
        ("agent_message_chunk", "m2"),
        ("agent_thought_chunk", "m1"),
        ("agent_message_chunk", "m2"),
    ]


def test_replayed_history_alternates_user_and_agent_messages() -> None:
    """A v1 `session/load` replays the history as chunks: each change of speaker is a new
    message."""
    tr = _translator()
    kinds = [
        "user_message_chunk",
        "user_message_chunk",
        "agent_message_chunk",
        "user_message_chunk",
    ]
    out = [n for kind in kinds for n in tr.translate(_chunk(kind, "x"))]
    assert [type(n.update) for n in out] == [
        s.SessionUpdateUserMessageChunk,
        s.SessionUpdateUserMessageChunk,
        s.SessionUpdateAgentMessageChunk,
        s.SessionUpdateUserMessageChunk,
    ]
    assert [_wire(n)["messageId"] for n in out] == ["m1", "m1", "m2", "m3"]


def test_user_chunks_of_a_turn_join_the_message_id_given_for_it() -> None:
    tr = _translator()
    tr.begin_turn("mine")
    (n,) = tr.translate(_chunk("user_message_chunk", "echoed"))
    assert _wire(n)["messageId"] == "mine"
    assert tr.current("user") == "mine"
    assert tr.current("agent") is None


def test_a_plan_becomes_a_plan_update_of_the_sessions_one_plan() -> None:
    entries = [{"content": "step 1", "priority": "high", "status": "pending"}]
    (n,) = _translator().translate({"sessionUpdate": "plan", "entries": entries})
    assert isinstance(n.update, s.SessionUpdatePlanUpdate)
    assert _wire(n) == {
        "sessionUpdate": "plan_update",
        "plan": {"type": "items", "planId": "plan", "entries": entries},
    }


def test_available_commands_get_v2_tags_and_other_kinds_keep_their_fields() -> None:
    commands = {
        "sessionUpdate": "available_commands_update",
        "availableCommands": [
            {"name": "web", "description": "search the web", "input": {"hint": "query"}}
        ],
    }
    (n,) = _translator().translate(commands)
    assert isinstance(n.update, s.SessionUpdateAvailableCommandsUpdate)
    assert _wire(n) == {
        "sessionUpdate": "available_commands_update",
        "availableCommands": [
            {
                "type": "command",
                "name": "web",
                "description": "search the web",
                "input": {"type": "text", "hint": "query"},
            },
        ],
    }
    usage = {"sessionUpdate": "usage_update", "used": 10, "size": 100}
    (u,) = _translator().translate(usage)
    assert isinstance(u.update, s.SessionUpdateUsageUpdate)
    assert _wire(u) == usage


def test_a_mode_update_has_no_v2_kind_and_is_kept_generic() -> None:
    mode = {"sessionUpdate": "current_mode_update", "currentModeId": "architect"}
    (n,) = _translator().translate(mode)
    assert isinstance(n.update, s.SessionUpdateOther)
    assert _wire(n) == mode


def test_a_kind_whose_v1_fields_v2_refuses_is_kept_generic() -> None:
    notice = {"sessionUpdate": "notice", "severity": "info"}  # v2 requires a title
    (n,) = _translator().translate(notice)
    assert isinstance(n.update, s.SessionUpdateOther)
    assert _wire(n) == notice


def test_not_an_update_gives_nothing_and_a_broken_chunk_raises() -> None:
    tr = _translator()
    assert tr.translate({"content": "no tag"}) == []
    assert tr.translate_notification({"sessionId": "sess_1"}) == []
    with pytest.raises(ValidationError):
        tr.translate({"sessionUpdate": "agent_message_chunk"})  # v1 requires content
    with pytest.raises(ValidationError):
        tr.translate({"sessionUpdate": "tool_call", "toolCallId": "t"})  # v1 requires title


def test_translate_notification_reads_the_update_of_the_params() -> None:
    tr = _translator()
    (n,) = tr.translate_notification(
        {"sessionId": "sess_1", "update": _chunk("agent_message_chunk", "hi")}
    )
    assert _wire(n)["content"]["text"] == "hi"


def test_turn_edges_user_message_running_and_idle() -> None:
    prompt = [{"type": "text", "text": "hello"}]
    start = user_message("sess_1", "u1", prompt)
    assert isinstance(start.update, s.SessionUpdateUserMessage)
    assert _wire(start) == {"sessionUpdate": "user_message", "messageId": "u1", "content": prompt}
    assert _wire(running_update("sess_1")) == {"sessionUpdate": "state_update", "state": "running"}
    assert _wire(idle_update("sess_1", "end_turn")) == {
        "sessionUpdate": "state_update",
        "state": "idle",
        "stopReason": "end_turn",
    }
    assert _wire(idle_update("sess_1", None)) == {"sessionUpdate": "state_update", "state": "idle"}


def test_a_permission_request_becomes_a_tool_call_subject() -> None:
    request = v1.RequestPermissionRequest.model_validate(
        {
            "sessionId": "sess_1",
            "toolCall": {"toolCallId": "t1", "title": "Delete build/", "kind": "delete"},
            "options": [
                {"optionId": "yes", "name": "Yes", "kind": "allow_once"},
                {"optionId": "no", "name": "No", "kind": "reject_once"},
            ],
        }
    )
    v2 = permission_request_to_v2(request).model_dump(
        by_alias=True, exclude_unset=True, mode="json"
    )
    assert v2["title"] == "Delete build/"
    assert v2["subject"] == {
        "type": "tool_call",
        "toolCall": {"toolCallId": "t1", "title": "Delete build/", "kind": "delete"},
    }
    assert [o["optionId"] for o in v2["options"]] == ["yes", "no"]


def test_default_ids_are_unique() -> None:
    tr = V1ToV2Updates("sess_1")
    ids = {tr.begin_turn() for _ in range(100)}
    assert len(ids) == 100


@pytest.mark.parametrize(
    ("answer", "version"),
    [
        ({"protocolVersion": 2, "info": {"name": "a", "version": "1"}, "capabilities": {}}, 2),
        ({"protocolVersion": 1, "agentCapabilities": {"loadSession": True}}, 1),
        ({"protocolVersion": 1}, 1),
        # an official-SDK agent copying the client's version, in v1's shape
        (
            {
                "protocolVersion": 2,
                "agentCapabilities": {},
                "agentInfo": {"name": "a", "version": "1"},
            },
            1,
        ),
        # the official Python SDK's echo agents: the version copied, nothing else (no `info`)
        ({"protocolVersion": 2}, 1),
        ({"protocolVersion": 2, "info": "broken"}, None),
        ({"protocolVersion": 3, "info": {"name": "a", "version": "1"}}, None),
        ({"protocolVersion": 0}, None),
        ({"protocolVersion": True}, None),
        ({"info": {"name": "a", "version": "1"}}, None),
        ([], None),
        (None, None),
    ],
)
def test_answer_version_tells_v1_from_v2(answer: Any, version: int | None) -> None:
    assert answer_version(answer) == version


def test_messages_of_a_v1_agent_are_read_per_session() -> None:
    messages = V1ToV2Messages()
    chunk = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "x"}}
    (first,) = messages.session_updates({"sessionId": "a", "update": chunk})
    (other,) = messages.session_updates({"sessionId": "b", "update": chunk})
    assert first.session_id == "a" and other.session_id == "b"
    assert isinstance(first.update, s.SessionUpdateAgentMessageChunk)
    assert messages.translator("a").current("agent") == first.update.message_id
    messages.translator("a").end_messages()
    (second,) = messages.session_updates({"sessionId": "a", "update": chunk})
    assert isinstance(second.update, s.SessionUpdateAgentMessageChunk)
    assert second.update.message_id != first.update.message_id
    with pytest.raises(ValidationError):
        messages.session_updates({"update": chunk})  # no session: v1 requires one
    request = messages.permission_request(
        {
            "sessionId": "a",
            "toolCall": {"toolCallId": "t1", "title": "write"},
            "options": [{"optionId": "ok", "name": "OK", "kind": "allow_once"}],
        }
    )
    assert request.title == "write" and request.session_id == "a"


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        ({"stopReason": "max_tokens"}, "max_tokens"),
        ({"stopReason": "x"}, "end_turn"),
        ({}, "end_turn"),
    ],
)
def test_the_v2_stop_reason_of_a_v1_answer(result: dict[str, str], expected: str) -> None:
    assert v2_stop_reason_from_v1(result) == expected
