"""The v1 -> v2 translation of the upgrade runtime (pure functions: updates, stop reasons,
permission requests and answers). The v1 updates are built with the official Python SDK 0.12.1
(`acp` helpers), as a v1 agent sends them."""

from __future__ import annotations

from typing import Any

import acp
import orjson
import pytest
from acp.helpers import update_current_mode
from acp.schema import SessionNotification

from acp_once.agent.updates import check_update
from acp_once.protocol.v1_to_v2 import v2_stop_reason_from_v1
from acp_once.upgrade.translate import (
    STORED_PART_BYTES,
    StoredV1ToV2Updates,
    permission_to_v1,
    permission_to_v2,
    permission_tool_call,
    prompt_to_v1,
)


def wire(update: Any) -> dict[str, Any]:
    """A v1 update as the SDK puts it on the wire."""
    note = SessionNotification(session_id="s", update=update)
    dumped: dict[str, Any] = note.model_dump(by_alias=True, exclude_none=True, mode="json")
    return dumped["update"]  # type: ignore[no-any-return]


def test_chunks_are_sent_live_under_one_id_and_stored_whole() -> None:
    tr = StoredV1ToV2Updates("plan_s")
    first = tr.translate(wire(acp.update_agent_message_text("echo: ")))
    second = tr.translate(wire(acp.update_agent_message_text("hi")))
    assert [o.mode for o in first + second] == ["live", "live"]
    ids = {o.update["messageId"] for o in first + second}
    assert len(ids) == 1 and next(iter(ids)).startswith("msg_agent_")
    assert first[0].update == {
        "sessionUpdate": "agent_message_chunk",
        "messageId": next(iter(ids)),
        "content": {"type": "text", "text": "echo: "},
    }
    (whole,) = tr.finish()
    assert whole.mode == "store"
    assert whole.update["content"] == [{"type": "text", "text": "echo: hi"}]
    assert tr.finish() == []  # the run ended


def test_another_kind_ends_the_run_and_starts_a_new_message() -> None:
    tr = StoredV1ToV2Updates("plan_s")
    thought = tr.translate(wire(acp.update_agent_thought_text("hmm")))
    tool = tr.translate(wire(acp.start_tool_call("t1", "read", kind="read", status="pending")))
    message = tr.translate(wire(acp.update_agent_message_text("done")))
    assert thought[0].update["sessionUpdate"] == "agent_thought_chunk"
    # the thought's whole message is stored before the tool call that ended it
    assert [o.update["sessionUpdate"] for o in tool] == ["agent_thought", "tool_call_update"]
    assert [o.mode for o in tool] == ["store", "retain"]
    assert tool[1].update == {
        "sessionUpdate": "tool_call_update",
        "toolCallId": "t1",
        "title": "read",
        "kind": "read",
        "status": "pending",
    }
    assert message[0].update["messageId"] != thought[0].update["messageId"]
    for out in thought + tool + message + tr.finish():
        check_update(out.update)  # every one a valid v2 update


def test_plan_becomes_the_sessions_one_plan_and_other_kinds_pass_or_drop() -> None:
    tr = StoredV1ToV2Updates("plan_s")
    (plan,) = tr.translate(wire(acp.update_plan([acp.plan_entry("look")])))
    assert plan.mode == "retain"
    assert plan.update["plan"]["planId"] == "plan_s"
    assert plan.update["plan"]["entries"][0]["content"] == "look"
    assert tr.translate(wire(acp.update_user_message_text("echoed user text"))) == []
    assert tr.translate(wire(update_current_mode("ask"))) == []
    assert tr.translate({"sessionUpdate": "no_such_kind"}) == []
    assert tr.translate({"sessionUpdate": "agent_message_chunk"}) == []  # no content
    assert tr.translate("not an object") == []
    assert tr.dropped == 3
    commands = {"sessionUpdate": "available_commands_update", "availableCommands": []}
    (live,) = tr.translate(commands)
    assert live.mode == "live" and live.update == commands


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        ({"stopReason": "end_turn"}, "end_turn"),
        ({"stopReason": "cancelled"}, "cancelled"),
        ({"stopReason": "refusal"}, "refusal"),
        ({"stopReason": "something_new"}, "end_turn"),
        (None, "end_turn"),
    ],
)
def test_stop_reasons(result: Any, expected: str) -> None:
    assert v2_stop_reason_from_v1(result) == expected


def test_prompt_blocks_pass_unchanged() -> None:
    blocks = [
        {"type": "text", "text": "x"},
        {"type": "resource_link", "uri": "file:///a", "name": "a"},
    ]
    assert prompt_to_v1(blocks) == blocks


def test_permission_request_and_answer() -> None:
    v1 = {
        "sessionId": "v1sess",
        "toolCall": {"toolCallId": "t9", "title": "write the file", "status": "pending"},
        "options": [{"optionId": "allow_once", "name": "Allow", "kind": "allow_once"}],
    }
    assert permission_to_v2(v1, "sess_v2") == {
        "sessionId": "sess_v2",
        "title": "write the file",
        "options": [{"optionId": "allow_once", "name": "Allow", "kind": "allow_once"}],
        "subject": {"type": "tool_call", "toolCall": {"toolCallId": "t9"}},
    }
    announce = permission_tool_call(v1)
    assert announce is not None and announce["toolCallId"] == "t9"
    untitled = permission_to_v2({**v1, "toolCall": {"toolCallId": "t9"}}, "sess_v2")
    assert untitled["title"] == "Permission requested"
    with pytest.raises(ValueError, match="no options"):
        permission_to_v2({**v1, "options": []}, "sess_v2")
    with pytest.raises(ValueError, match="no tool call"):
        permission_to_v2({**v1, "toolCall": {}}, "sess_v2")
    selected = {"outcome": {"outcome": "selected", "optionId": "allow_once"}}
    assert permission_to_v1(selected) == selected
    assert permission_to_v1({"outcome": {"outcome": "cancelled"}}) == {
        "outcome": {"outcome": "cancelled"}
    }
    assert permission_to_v1({}) == {"outcome": {"outcome": "cancelled"}}


def test_thoughts_interleave_with_text_and_a_plan_ends_the_messages_before_it() -> None:
    tr = StoredV1ToV2Updates("plan_s")
    text = tr.translate(wire(acp.update_agent_message_text("a")))
    thought = tr.translate(wire(acp.update_agent_thought_text("hmm")))
    more = tr.translate(wire(acp.update_agent_message_text("b")))
    # v2 lets two messages' chunks interleave: the text after the thought continues its message
    assert more[0].update["messageId"] == text[0].update["messageId"]
    assert thought[0].update["messageId"] != text[0].update["messageId"]
    plan = tr.translate(wire(acp.update_plan([acp.plan_entry("look")])))
    # both messages are stored whole, in the order they started, before the plan that ends them
    assert [(o.update["sessionUpdate"], o.mode) for o in plan] == [
        ("agent_message", "store"),
        ("agent_thought", "store"),
        ("plan_update", "retain"),
    ]
    assert plan[0].update["content"] == [{"type": "text", "text": "ab"}]
    after = tr.translate(wire(acp.update_agent_message_text("c")))
    assert after[0].update["messageId"] != text[0].update["messageId"]
    assert tr.dropped == 0


def test_a_long_message_is_stored_in_parts_that_replay_far_below_the_frame_limit() -> None:
    """3.2 MB of text (multibyte characters, 1,000 characters a chunk): stored as chunks of at
    most `STORED_PART_BYTES` of text under the message's id, none split inside a character,
    together the whole text; the thought beside it, short, stays one whole update."""
    tr = StoredV1ToV2Updates("plan_s")
    piece = "a\u00e9\u20ac\U0001f600" * 250  # 1, 2, 3 and 4 UTF-8 bytes: 2,500 bytes
    chunks = 1300
    for _ in range(chunks):
        tr.translate(
            {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": piece}}
        )
    tr.translate(
        {"sessionUpdate": "agent_thought_chunk", "content": {"type": "text", "text": "hm"}}
    )
    stored = tr.finish()
    assert all(o.mode == "store" for o in stored)
    *parts, thought = [o.update for o in stored]
    assert thought["sessionUpdate"] == "agent_thought"
    assert thought["content"] == [{"type": "text", "text": "hm"}]
    assert len(parts) == -(-chunks * len(piece.encode()) // STORED_PART_BYTES)
    assert {p["sessionUpdate"] for p in parts} == {"agent_message_chunk"}
    assert len({p["messageId"] for p in parts}) == 1
    for part in parts:
        check_update(part)
        assert len(part["content"]["text"].encode()) <= STORED_PART_BYTES
        assert len(orjson.dumps(part)) <= STORED_PART_BYTES + 200
    assert "".join(p["content"]["text"] for p in parts) == piece * chunks
