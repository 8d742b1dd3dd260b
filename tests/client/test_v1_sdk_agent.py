"""`AcpClient` against an ACP v1 agent written with the official Python SDK 0.12.1 (`acp`,
tests/agents/sdk_v1_agent.py), over real pipes to a real subprocess: the version negotiated at
`initialize`, v1 turns seen as typed v2 updates, the unaware-agent policy, cancel,
permissions, and `session/load` after a reconnect. What the client sent is read from the
agent's side (its log of every message it received)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.client import (
    AcpClient,
    AgentRefused,
    OutcomeUnknown,
    SessionUpdate,
    StdioLauncher,
)
from acp_once.protocol import schema as s
from acp_once.protocol.errors import MethodNotFound
from acp_once.support.backoff import Backoff

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

AGENT = Path(__file__).resolve().parents[1] / "agents" / "sdk_v1_agent.py"
TIMEOUT = 30
FAST = Backoff(base=0.05, factor=2.0, cap=0.5)
NO_KEYS = "v1 has no idempotency keys, so a resend after a lost answer may run the work twice"


def sdk_agent(tmp: Path, *flags: str) -> StdioLauncher:
    command = [sys.executable, str(AGENT), "--log", str(tmp / "received.jsonl"), *flags]
    return StdioLauncher(command, env=dict(os.environ))


def received(tmp: Path) -> list[dict[str, Any]]:
    """Every message the agent received (and its `{"turn": ...}` marks), in order."""
    path = tmp / "received.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def sent(tmp: Path, method: str) -> list[dict[str, Any]]:
    return [m["params"] for m in received(tmp) if m.get("method") == method]


def turns(tmp: Path) -> list[str]:
    return [m["turn"] for m in received(tmp) if "turn" in m]


def kinds(updates: list[SessionUpdate] | tuple[SessionUpdate, ...]) -> list[str]:
    return [str(getattr(u, "session_update", "")) for u in updates]


def v1_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if NO_KEYS in r.getMessage()]


async def test_a_whole_turn_arrives_as_typed_v2_updates_and_ends_with_end_turn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="acp_once.client")
    seen: list[SessionUpdate] = []
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(sdk_agent(tmp_path)) as client:
            assert client.protocol_version == 1
            assert client.agent_info_v1 is not None
            assert client.agent_info_v1.agent_info is not None
            assert client.agent_info_v1.agent_info.name == "sdk-v1-echo"
            session = await client.new_session(str(tmp_path))
            session.on_update(seen.append)
            turn = session.prompt("hello")
            streamed = [u async for u in turn.updates()]
            result = await turn.finished()
            message_id = await turn

    assert result.stop_reason == "end_turn"
    assert result.text == "echo: hello"
    assert message_id == result.message_id == turn.message_id
    assert message_id.startswith("v1_")
    assert kinds(seen) == [
        "user_message",
        "state_update",
        "agent_message_chunk",
        "agent_message_chunk",
        "state_update",
    ]
    assert list(result.updates) == streamed == seen
    chunks = [u for u in seen if isinstance(u, s.SessionUpdateAgentMessageChunk)]
    assert len({c.message_id for c in chunks}) == 1
    first = seen[0]
    assert isinstance(first, s.SessionUpdateUserMessage)
    assert first.message_id == message_id
    # the agent's side: a v2 initialize was offered, v1 session/new params, no key anywhere
    (init,) = sent(tmp_path, "initialize")
    assert init["protocolVersion"] == 2
    (new,) = sent(tmp_path, "session/new")
    assert new == {"cwd": str(tmp_path), "mcpServers": []}
    (prompt,) = sent(tmp_path, "session/prompt")
    assert prompt == {
        "sessionId": session.session_id,
        "prompt": [{"type": "text", "text": "hello"}],
    }
    assert "idempotencyKey" not in json.dumps(received(tmp_path))
    # the default policy (warn) says why, once
    assert len(v1_warnings(caplog)) == 1


async def test_tool_calls_plans_and_thoughts_are_typed_and_text_after_a_tool_is_a_new_message(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(sdk_agent(tmp_path), on_unaware="trust") as client:
            session = await client.new_session(str(tmp_path))
            result = await session.prompt("[plan][thought][tool] go").finished()

    updates = list(result.updates)
    assert kinds(updates) == [
        "user_message",
        "state_update",
        "plan_update",
        "agent_thought_chunk",
        "agent_message_chunk",
        "tool_call_update",
        "tool_call_update",
        "agent_message_chunk",
        "state_update",
    ]
    plan = updates[2]
    assert isinstance(plan, s.SessionUpdatePlanUpdate)
    assert isinstance(updates[3], s.SessionUpdateAgentThoughtChunk)
    tool_start, tool_done = updates[5], updates[6]
    assert isinstance(tool_start, s.SessionUpdateToolCallUpdate)
    assert isinstance(tool_done, s.SessionUpdateToolCallUpdate)
    assert (tool_start.title, tool_done.status) == ("Read the file", "completed")
    before, after = updates[4], updates[7]
    assert isinstance(before, s.SessionUpdateAgentMessageChunk)
    assert isinstance(after, s.SessionUpdateAgentMessageChunk)
    assert before.message_id != after.message_id
    assert result.text == "echo: [plan][thought][tool] go"


async def test_refuse_refuses_a_v1_agent_with_the_reason(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT), pytest.raises(AgentRefused) as raised:
        async with AcpClient(sdk_agent(tmp_path), on_unaware="refuse"):
            pytest.fail("a v1 agent must be refused")
    assert NO_KEYS in str(raised.value)
    assert "refuse" in str(raised.value)
    assert sent(tmp_path, "session/new") == []


async def test_warn_does_not_resend_a_prompt_whose_answer_was_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="acp_once.client")
    launcher = sdk_agent(tmp_path, "--state", str(tmp_path / "state.json"))
    seen: list[SessionUpdate] = []
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(launcher, backoff=FAST) as client:
            session = await client.new_session(str(tmp_path))
            await session.prompt("first").finished()
            session.on_update(seen.append)
            with pytest.raises(OutcomeUnknown) as raised:
                await session.prompt("[die] once")
            # the client reconnected (a new agent process) and loaded the session again
            await client.wait_connected()
            after = await session.prompt("still here").finished()

    assert NO_KEYS in str(raised.value)
    assert turns(tmp_path) == ["first", "[die] once", "still here"]  # not resent
    # the load replayed "first" (as v1 chunks); the application saw it live and not again
    assert "user_message_chunk" not in kinds(seen)
    assert kinds(seen).count("user_message") == 2  # "[die] once" and "still here"
    assert kinds(seen).count("agent_message_chunk") == 2  # "still here" (the death came first)
    assert after.stop_reason == "end_turn"
    assert len(sent(tmp_path, "session/load")) == 1
    assert len(v1_warnings(caplog)) == 1  # once, not at each connection


async def test_trust_resends_a_lost_prompt_silently_and_the_work_runs_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="acp_once.client")
    launcher = sdk_agent(tmp_path, "--state", str(tmp_path / "state.json"))
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(launcher, backoff=FAST, on_unaware="trust") as client:
            session = await client.new_session(str(tmp_path))
            result = await session.prompt("[die-once] deploy").finished()

    assert result.stop_reason == "end_turn"
    assert result.text == "echo: [die-once] deploy"
    # what v1 cannot prevent: the agent saw the prompt twice
    assert turns(tmp_path) == ["[die-once] deploy", "[die-once] deploy"]
    prompts = sent(tmp_path, "session/prompt")
    assert len(prompts) == 2
    assert all("idempotencyKey" not in p for p in prompts)
    assert v1_warnings(caplog) == []


async def test_cancel_ends_a_v1_turn_with_cancelled(tmp_path: Path) -> None:
    running = anyio.Event()

    def on_update(update: SessionUpdate) -> None:
        if isinstance(update, s.SessionUpdateAgentMessageChunk):
            running.set()

    with anyio.fail_after(TIMEOUT):
        async with AcpClient(sdk_agent(tmp_path), on_unaware="trust") as client:
            session = await client.new_session(str(tmp_path))
            session.on_update(on_update)
            turn = session.prompt("[wait]")
            await running.wait()
            await session.cancel()
            result = await turn.finished()

    assert result.stop_reason == "cancelled"
    assert sent(tmp_path, "session/cancel") == [{"sessionId": session.session_id}]


async def test_a_v1_permission_request_reaches_the_handler_as_a_v2_request(
    tmp_path: Path,
) -> None:
    asked: list[s.RequestPermissionRequest] = []

    async def on_permission(request: s.RequestPermissionRequest) -> s.RequestPermissionResponse:
        asked.append(request)
        return s.RequestPermissionResponse.model_validate(
            {"outcome": {"outcome": "selected", "optionId": "yes"}}
        )

    with anyio.fail_after(TIMEOUT):
        async with AcpClient(
            sdk_agent(tmp_path), on_unaware="trust", on_permission=on_permission
        ) as client:
            session = await client.new_session(str(tmp_path))
            result = await session.prompt("[permission]").finished()

    (request,) = asked
    assert request.title == "Run the tests?"
    assert [o.option_id for o in request.options] == ["yes", "no"]
    assert result.text == "echo: yes"


async def test_an_agent_that_copies_the_version_but_answers_in_v1_shape_is_v1(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(sdk_agent(tmp_path, "--echo-version"), on_unaware="trust") as client:
            assert client.protocol_version == 1
            session = await client.new_session(str(tmp_path))
            result = await session.prompt("hi").finished()
    assert result.stop_reason == "end_turn"
    assert "idempotencyKey" not in json.dumps(sent(tmp_path, "session/prompt"))


async def test_resume_loads_a_v1_session_in_a_new_client(tmp_path: Path) -> None:
    state = str(tmp_path / "state.json")
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(sdk_agent(tmp_path, "--state", state), on_unaware="trust") as client:
            session = await client.new_session(str(tmp_path))
            await session.prompt("first").finished()
        async with AcpClient(sdk_agent(tmp_path, "--state", state), on_unaware="trust") as client:
            assert client.session(session.session_id) is None
            resumed = await client.resume_session(session.session_id, str(tmp_path))
            result = await resumed.prompt("second").finished()
    assert sent(tmp_path, "session/load") == [
        {"sessionId": session.session_id, "cwd": str(tmp_path), "mcpServers": []}
    ]
    assert result.text == "echo: second"
    assert turns(tmp_path) == ["first", "second"]


async def test_without_load_session_resume_is_refused_clearly(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(sdk_agent(tmp_path, "--no-load"), on_unaware="trust") as client:
            with pytest.raises(MethodNotFound) as raised:
                await client.resume_session("sdk_gone", str(tmp_path))
    assert "session/load" in raised.value.message
    assert sent(tmp_path, "session/load") == []


async def test_under_trust_a_pending_submission_of_an_earlier_run_is_resent_after_a_load(
    tmp_path: Path,
) -> None:
    state = str(tmp_path / "state.json")
    outbox = f"sqlite:{tmp_path / 'outbox.db'}"
    recovered: list[str] = []
    done = anyio.Event()

    async def on_recovered(submission: Any, message_id: str) -> None:
        recovered.append(message_id)
        done.set()

    with anyio.fail_after(TIMEOUT):
        async with AcpClient(
            sdk_agent(tmp_path, "--state", state), outbox=outbox, on_unaware="trust"
        ) as client:
            session = await client.new_session(str(tmp_path))
            # written and never sent: what a run killed before its first attempt leaves behind
            prompt = json.dumps([{"type": "text", "text": "left over"}]).encode()
            await client.outbox.add(session.session_id, prompt, idempotency_key="k_left")
        async with AcpClient(
            sdk_agent(tmp_path, "--state", state),
            outbox=outbox,
            on_unaware="trust",
            on_recovered=on_recovered,
        ) as client:
            await done.wait()
            assert await client.outbox.pending() == []
    assert recovered[0].startswith("v1_")
    assert turns(tmp_path) == ["left over"]
    # re-attached with v1's session/load (the cwd is what session/list says, if anything)
    assert [p["sessionId"] for p in sent(tmp_path, "session/load")] == [session.session_id]
    assert sent(tmp_path, "session/resume") == []
