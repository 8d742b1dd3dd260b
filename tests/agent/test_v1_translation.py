"""`acp_once.protocol.v2_to_v1`: each v2 update, result and request in the shape a v1 client
reads. Every translated update is validated against the vendored v1 schema's models."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from acp_once.protocol import v1
from acp_once.protocol.v2_to_v1 import (
    V2ToV1Updates,
    initialize_response,
    permission_request,
    v1_stop_reason_from_v2,
)


def v1_valid(updates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for update in updates:
        v1.SessionNotification.model_validate({"sessionId": "s", "update": update})
    return updates


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def test_whole_messages_become_one_chunk_per_block() -> None:
    t = V2ToV1Updates()
    user = {"sessionUpdate": "user_message", "messageId": "u1", "content": [text("a"), text("b")]}
    assert v1_valid(t.translate(user)) == [
        {"sessionUpdate": "user_message_chunk", "content": text("a"), "messageId": "u1"},
        {"sessionUpdate": "user_message_chunk", "content": text("b"), "messageId": "u1"},
    ]
    thought = {"sessionUpdate": "agent_thought", "messageId": "t1", "content": [text("hm")]}
    assert [u["sessionUpdate"] for u in v1_valid(t.translate(thought))] == ["agent_thought_chunk"]
    assert t.translate({"sessionUpdate": "agent_message", "messageId": "a0"}) == []


def test_a_whole_message_after_its_chunks_is_not_sent_again() -> None:
    t = V2ToV1Updates()
    chunk = {"sessionUpdate": "agent_message_chunk", "messageId": "a1", "content": text("he")}
    assert v1_valid(t.translate(chunk)) == [chunk]
    whole = {"sessionUpdate": "agent_message", "messageId": "a1", "content": [text("hello")]}
    assert t.translate(whole) == []  # v1 cannot replace what was streamed
    other = {**whole, "messageId": "a2"}
    assert len(t.translate(other)) == 1


def test_a_tool_call_is_created_once_then_updated_with_v1_statuses() -> None:
    t = V2ToV1Updates()
    first = t.translate(
        {
            "sessionUpdate": "tool_call_update",
            "toolCallId": "c1",
            "title": "Read",
            "kind": "read",
            "status": "paused",
            "capabilities": {"cancel": {}},
        }
    )
    assert v1_valid(first) == [
        {
            "sessionUpdate": "tool_call",
            "toolCallId": "c1",
            "title": "Read",
            "kind": "read",
            "status": "in_progress",
        }
    ]
    then = t.translate(
        {"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "cancelled"}
    )
    assert v1_valid(then) == [
        {"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "failed"}
    ]
    # an unseen id without a title still creates a valid v1 tool call
    untitled = t.translate({"sessionUpdate": "tool_call_update", "toolCallId": "c2"})
    assert v1_valid(untitled)[0]["sessionUpdate"] == "tool_call"


def test_tool_content_chunks_are_sent_as_the_whole_content_so_far() -> None:
    t = V2ToV1Updates()
    item = {"type": "content", "content": text("x")}
    t.translate({"sessionUpdate": "tool_call_update", "toolCallId": "c1", "title": "Run"})
    one = t.translate(
        {"sessionUpdate": "tool_call_content_chunk", "toolCallId": "c1", "content": item}
    )
    two = t.translate(
        {"sessionUpdate": "tool_call_content_chunk", "toolCallId": "c1", "content": item}
    )
    assert v1_valid(one)[0]["content"] == [item]
    assert v1_valid(two)[0] == {
        "sessionUpdate": "tool_call_update",
        "toolCallId": "c1",
        "content": [item, item],
    }


def test_tool_output_in_many_chunks_costs_the_v1_client_linear_bytes() -> None:
    """2,000 chunks of 400 bytes (0.8 MB): the v1 client gets the whole output (v1 replaces a
    tool call's content), in at most 3x its size on the wire, not the square of it."""
    t = V2ToV1Updates()
    t.translate({"sessionUpdate": "tool_call_update", "toolCallId": "c1", "title": "Run"})
    items = [{"type": "content", "content": text(f"{n:05d}" + "x" * 395)} for n in range(2000)]
    sent: list[dict[str, Any]] = []
    for item in items:
        sent += t.translate(
            {"sessionUpdate": "tool_call_content_chunk", "toolCallId": "c1", "content": item}
        )
    sent += t.translate(
        {"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "completed"}
    )
    output = len(orjson.dumps(items))
    assert len(orjson.dumps(v1_valid(sent))) <= 3 * output
    assert sent[-1] == {
        "sessionUpdate": "tool_call_update",
        "toolCallId": "c1",
        "status": "completed",
        "content": items,
    }
    # every update the client got holds a prefix of the output, growing
    lengths = [len(u["content"]) for u in sent if "content" in u]
    assert lengths == sorted(lengths) and all(
        u["content"] == items[: len(u["content"])] for u in sent if "content" in u
    )


def test_held_back_tool_output_goes_out_when_the_turn_ends() -> None:
    t = V2ToV1Updates()
    item = {"type": "content", "content": text("x")}
    chunk = {"sessionUpdate": "tool_call_content_chunk", "toolCallId": "c1", "content": item}
    assert [len(u["content"]) for n in range(3) for u in t.translate(chunk)] == [1, 2]
    assert v1_valid(t.translate({"sessionUpdate": "state_update", "state": "idle"})) == [
        {"sessionUpdate": "tool_call_update", "toolCallId": "c1", "content": [item] * 3}
    ]
    assert t.translate({"sessionUpdate": "state_update", "state": "idle"}) == []


def test_plans_of_items_become_v1_plans_other_plans_are_dropped() -> None:
    t = V2ToV1Updates()
    entries = [{"content": "step", "priority": "high", "status": "pending"}]
    items = {"type": "items", "planId": "p", "entries": entries}
    assert v1_valid(t.translate({"sessionUpdate": "plan_update", "plan": items})) == [
        {"sessionUpdate": "plan", "entries": entries}
    ]
    markdown = {"type": "markdown", "planId": "p", "content": "# x"}
    assert t.translate({"sessionUpdate": "plan_update", "plan": markdown}) == []


@pytest.mark.parametrize(
    "update",
    [
        {"sessionUpdate": "state_update", "state": "idle", "stopReason": "end_turn"},
        {"sessionUpdate": "state_update", "state": "running"},
        {"sessionUpdate": "plan_removed", "planId": "p"},
        {"sessionUpdate": "terminal_output_chunk", "terminalId": "t", "data": "eA=="},
        {"sessionUpdate": "notice", "severity": "info", "title": "hi"},
        {"sessionUpdate": "_vendor_thing"},
        {"no": "kind"},
    ],
)
def test_v2_only_kinds_are_dropped(update: dict[str, Any]) -> None:
    assert V2ToV1Updates().translate(update) == []


def test_kinds_with_the_same_shape_pass_unchanged() -> None:
    t = V2ToV1Updates()
    for update in (
        {"sessionUpdate": "usage_update", "used": 1, "size": 10},
        {"sessionUpdate": "session_info_update", "title": "T"},
        {"sessionUpdate": "available_commands_update", "availableCommands": []},
    ):
        assert v1_valid(t.translate(update)) == [update]


def test_stop_reasons() -> None:
    for reason in ("end_turn", "max_tokens", "max_turn_requests", "refusal", "cancelled"):
        assert v1_stop_reason_from_v2(reason) == reason
    assert v1_stop_reason_from_v2(None) == "end_turn"
    assert v1_stop_reason_from_v2("_vendor_paused") == "end_turn"


def test_initialize_response_is_v1s() -> None:
    result = {
        "protocolVersion": 2,
        "info": {"name": "a", "version": "1"},
        "capabilities": {"session": {"prompt": {"image": {}}, "delete": {}}},
        "_meta": {"acpOnce": {"idempotencyKeys": True}},
    }
    response = initialize_response(result, load_session=True, session_methods=["list"])
    parsed = v1.InitializeResponse.model_validate(response)
    assert parsed.agent_capabilities is not None and parsed.agent_capabilities.load_session
    assert response["agentCapabilities"]["promptCapabilities"] == {
        "image": True,
        "audio": False,
        "embeddedContext": False,
    }
    assert response["agentCapabilities"]["sessionCapabilities"] == {"list": {}}
    assert response["agentInfo"] == {"name": "a", "version": "1"}
    assert "_meta" not in response


def test_permission_requests_ask_about_a_tool_call() -> None:
    options = [{"optionId": "allow_once", "kind": "allow_once", "name": "Allow"}]
    about_tool = {
        "sessionId": "s",
        "title": "Write the file?",
        "subject": {"type": "tool_call", "toolCall": {"toolCallId": "c1", "status": "paused"}},
        "options": options,
    }
    params = permission_request(about_tool, "fallback")
    v1.RequestPermissionRequest.model_validate(params)
    assert params["toolCall"] == {
        "toolCallId": "c1",
        "status": "in_progress",
        "title": "Write the file?",
    }
    about_command = {
        "sessionId": "s",
        "title": "Run it?",
        "description": "rm -rf build",
        "subject": {"type": "command", "command": "rm", "cwd": "/w"},
        "options": options,
    }
    params = permission_request(about_command, "fallback")
    v1.RequestPermissionRequest.model_validate(params)
    assert params["toolCall"] == {"toolCallId": "fallback", "title": "Run it?: rm -rf build"}
    assert params["options"] == options
