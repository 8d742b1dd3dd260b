"""examples/streaming_agent.py over stdio, in a real subprocess: three chunks, a tool call whose
permission the client answers, its status updates, and the stop reason."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.client import AcpClient, StdioLauncher
from acp_once.protocol import schema as s

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def run(choice: str, tmp_path: Path) -> tuple[list[dict[str, Any]], list[Any], str | None]:
    asked: list[s.RequestPermissionRequest] = []

    async def answer(request: s.RequestPermissionRequest) -> s.RequestPermissionResponse:
        asked.append(request)
        outcome = {"outcome": "selected", "optionId": choice}
        return s.RequestPermissionResponse.model_validate({"outcome": outcome})

    async def go() -> tuple[list[dict[str, Any]], str | None]:
        launcher = StdioLauncher([sys.executable, str(ROOT / "examples" / "streaming_agent.py")])
        async with AcpClient(launcher, on_permission=answer) as client:
            session = await client.new_session(str(tmp_path))
            with anyio.fail_after(30):
                result = await session.prompt("read my notes").finished()
        sent = [
            u.model_dump(by_alias=True, exclude_unset=True, mode="json") for u in result.updates
        ]
        return sent, result.stop_reason

    sent, stop_reason = anyio.run(go)
    return sent, asked, stop_reason


def test_the_streaming_example_streams_asks_and_runs_its_tool(tmp_path: Path) -> None:
    sent, asked, stop_reason = run("allow_once", tmp_path)
    kinds = [u["sessionUpdate"] for u in sent]
    chunks = [u for u in sent if u["sessionUpdate"] == "agent_message_chunk"]
    assert [c["content"]["text"] for c in chunks] == ["Let me ", "look at ", "that file."]
    assert len({c["messageId"] for c in chunks}) == 1
    (whole,) = [u for u in sent if u["sessionUpdate"] == "agent_message"]
    assert whole["messageId"] == chunks[0]["messageId"]
    assert whole["content"] == [{"type": "text", "text": "Let me look at that file."}]

    tool = [u for u in sent if u["sessionUpdate"] == "tool_call_update"]
    assert len({u["toolCallId"] for u in tool}) == 1
    assert (tool[0]["title"], tool[0]["kind"], tool[0]["status"]) == (
        "Read notes.txt",
        "read",
        "pending",
    )
    assert [u["status"] for u in tool] == ["pending", "in_progress", "completed"]
    assert tool[-1]["content"] == [
        {"type": "content", "content": {"type": "text", "text": "3 lines read"}}
    ]

    (request,) = asked  # the permission round trip: asked about this tool call, answered
    subject = request.model_dump(by_alias=True, exclude_unset=True)["subject"]
    assert subject["toolCall"]["toolCallId"] == tool[0]["toolCallId"]
    # ordering: chunks before the tool call, the status updates after the answer
    assert kinds.index("agent_message_chunk") < kinds.index("tool_call_update")
    assert stop_reason == "end_turn"


def test_a_refused_permission_cancels_the_tool_call(tmp_path: Path) -> None:
    sent, asked, stop_reason = run("reject_once", tmp_path)
    tool = [u for u in sent if u["sessionUpdate"] == "tool_call_update"]
    assert len(asked) == 1
    assert [u["status"] for u in tool] == ["pending", "cancelled"]
    assert stop_reason == "end_turn"
