"""Typed `session/update` builders, `TurnContext.emit` of models and dicts, strict mode, and the
tool-call and permission helpers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from pydantic import BaseModel

from acp_once.agent import STRICT_ENV, SessionAgent, StopReason, Turn, TurnContext, updates
from acp_once.agent import turns as runtime_module
from acp_once.protocol import schema as s
from acp_once.storage import MemoryStore
from acp_once.testing import connected
from tests.helpers import UpdateRecorder, initialize_request

pytestmark = pytest.mark.anyio


def wire(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(by_alias=True, exclude_unset=True, mode="json")


def as_received(update: dict[str, Any]) -> Any:
    """What a client makes of `update`: the schema's whole union chooses the kind."""
    notification = {"sessionId": "sess_1", "update": update}
    return s.UpdateSessionNotification.model_validate(notification).update


BUILT: list[tuple[BaseModel, type[BaseModel], dict[str, Any]]] = [
    (
        updates.agent_message_chunk("Hel", message_id="m1"),
        s.SessionUpdateAgentMessageChunk,
        {"messageId": "m1", "content": {"type": "text", "text": "Hel"}},
    ),
    (
        updates.agent_message(["Hel", "lo"], message_id="m1"),
        s.SessionUpdateAgentMessage,
        {"content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
    ),
    (
        updates.agent_thought_chunk("hmm", message_id="t1"),
        s.SessionUpdateAgentThoughtChunk,
        {"messageId": "t1", "content": {"type": "text", "text": "hmm"}},
    ),
    (
        updates.agent_thought("hmm", message_id="t1"),
        s.SessionUpdateAgentThought,
        {"content": [{"type": "text", "text": "hmm"}]},
    ),
    (
        updates.tool_call("Read a", kind="read", tool_call_id="c1", locations=["/w/a"]),
        s.SessionUpdateToolCallUpdate,
        {
            "toolCallId": "c1",
            "title": "Read a",
            "kind": "read",
            "status": "pending",
            "locations": [{"path": "/w/a"}],
        },
    ),
    (
        updates.tool_call_update("c1", status="completed", content=["done"]),
        s.SessionUpdateToolCallUpdate,
        {
            "toolCallId": "c1",
            "status": "completed",
            "content": [{"type": "content", "content": {"type": "text", "text": "done"}}],
        },
    ),
    (
        updates.tool_call_content_chunk("c1", "more"),
        s.SessionUpdateToolCallContentChunk,
        {"content": {"type": "content", "content": {"type": "text", "text": "more"}}},
    ),
    (
        updates.plan(["a", updates.plan_entry("b", status="completed", priority="high")]),
        s.SessionUpdatePlanUpdate,
        {
            "plan": {
                "type": "items",
                "planId": "plan",
                "entries": [
                    {"content": "a", "status": "pending", "priority": "medium"},
                    {"content": "b", "status": "completed", "priority": "high"},
                ],
            }
        },
    ),
    (updates.plan_removed("p2"), s.SessionUpdatePlanRemoved, {"planId": "p2"}),
    (
        updates.usage_update(1200, 200_000, cost={"amount": 0.5, "currency": "USD"}),
        s.SessionUpdateUsageUpdate,
        {"used": 1200, "size": 200_000, "cost": {"amount": 0.5, "currency": "USD"}},
    ),
    (updates.session_info(title="Fix"), s.SessionUpdateSessionInfoUpdate, {"title": "Fix"}),
    (
        updates.notice("Slow", severity="warning", description="rate limited"),
        s.SessionUpdateNotice,
        {"title": "Slow", "severity": "warning", "description": "rate limited"},
    ),
]


@pytest.mark.parametrize(
    ("built", "kind", "fields"), BUILT, ids=[type(b[0]).__name__ for b in BUILT]
)
def test_each_builder_gives_the_schema_kind_a_client_receives(
    built: BaseModel, kind: type[BaseModel], fields: dict[str, Any]
) -> None:
    assert type(built) is kind
    sent = wire(built)
    assert {name: sent[name] for name in fields} == fields
    received = as_received(sent)
    assert type(received) is kind  # the whole union picks the same kind, not the catch-all
    assert wire(received) == sent
    updates.check_update(sent)  # and strict mode accepts it


def test_the_builders_cover_every_kind_an_agent_sends() -> None:
    built = {wire(b[0])["sessionUpdate"] for b in BUILT}
    sent_by_the_runtime = {"state_update", "user_message", "user_message_chunk"}
    # kinds left to wire dicts: rare, with payloads richer than a builder would simplify
    by_dict = {
        "available_commands_update",
        "compaction_summary_chunk",
        "compaction_update",
        "config_option_update",
        "session_message",
        "session_message_chunk",
        "subagent_update",
        "terminal_output_chunk",
        "terminal_update",
    }
    assert set(updates.update_kinds()) == built | sent_by_the_runtime | by_dict


def test_a_fresh_id_by_default_and_patch_semantics_kept() -> None:
    first, second = updates.agent_message_chunk("a"), updates.agent_message_chunk("a")
    assert first.message_id != second.message_id
    assert updates.tool_call("t").tool_call_id.startswith("tool_")
    # not given: absent from the wire (unchanged); None: sent as null (cleared)
    assert "title" not in wire(updates.tool_call_update("c1", status="failed"))
    assert wire(updates.tool_call_update("c1", title=None))["title"] is None


def test_a_builder_refuses_a_value_the_schema_refuses() -> None:
    with pytest.raises(ValueError, match="path"):
        updates.tool_call_update("c1", locations=[{"line": 3}])
    with pytest.raises(ValueError, match="used"):
        updates.usage_update(-1, 10)


def test_check_update_names_a_typo_kind_and_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError) as refused:
        updates.check_update({"sessionUpdate": "agent_mesage_chunk", "content": "x"})
    message = str(refused.value)
    assert "'agent_mesage_chunk'" in message
    assert "agent_message_chunk" in message.split("valid kinds:")[1]
    assert "tool_call_update" in message.split("valid kinds:")[1]


def test_check_update_names_the_malformed_field() -> None:
    bad = {"sessionUpdate": "agent_message_chunk", "messageId": "m", "content": "plain string"}
    with pytest.raises(ValueError, match=r"invalid agent_message_chunk update: field 'content'"):
        updates.check_update(bad)
    with pytest.raises(ValueError, match=r"field 'messageId'"):
        updates.check_update({"sessionUpdate": "agent_message_chunk", "content": updates.text("x")})


class ScriptedAgent(SessionAgent):
    """Runs `script(ctx)` as its turn and keeps what it raised."""

    def __init__(self, script: Callable[[TurnContext], Awaitable[None]], **kw: Any) -> None:
        super().__init__(MemoryStore(), **kw)
        self.script = script
        self.raised: list[BaseException] = []

    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason:
        try:
            await self.script(ctx)
        except ValueError as exc:
            self.raised.append(exc)
        return "end_turn"


class Answering(UpdateRecorder):
    """Records updates and answers permission requests with `choice` (None: cancelled)."""

    def __init__(self, choice: str | None) -> None:
        super().__init__()
        self.choice = choice
        self.asked: list[s.RequestPermissionRequest] = []

    async def request_permission(
        self, params: s.RequestPermissionRequest, connection: Any
    ) -> s.RequestPermissionResponse:
        self.asked.append(params)
        outcome: dict[str, Any] = (
            {"outcome": "selected", "optionId": self.choice}
            if self.choice
            else {"outcome": "cancelled"}
        )
        return s.RequestPermissionResponse.model_validate({"outcome": outcome})


@asynccontextmanager
async def turn_of(
    script: Callable[[TurnContext], Awaitable[None]],
    recorder: UpdateRecorder | None = None,
    **kw: Any,
) -> AsyncIterator[tuple[ScriptedAgent, UpdateRecorder]]:
    """Run one turn of `script` and yield the agent and what the client received, turn over."""
    recorder = recorder or UpdateRecorder()
    async with ScriptedAgent(script, **kw) as agent, connected(agent, recorder) as conn:
        await conn.agent.initialize(initialize_request())
        sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
        prompt = {"sessionId": sid, "prompt": [updates.text("go")]}
        await conn.agent.prompt(s.PromptRequest.model_validate(prompt))
        with anyio.fail_after(10):
            await recorder.wait_for(
                lambda seen: any(
                    u.get("stopReason") for u in seen if u["sessionUpdate"] == "state_update"
                )
            )
        yield agent, recorder


def agent_updates(recorder: UpdateRecorder) -> list[dict[str, Any]]:
    runtime_sent = {"state_update", "user_message"}
    return [u for u in recorder.updates if u["sessionUpdate"] not in runtime_sent]


async def test_emit_sends_a_model_as_its_json_wire_form() -> None:
    link = {"type": "resource_link", "uri": "https://example.org/a", "name": "a"}

    async def script(ctx: TurnContext) -> None:
        await ctx.emit(updates.agent_message_chunk(link, message_id="m1"))
        await ctx.emit(updates.agent_message("whole", message_id="m1"), retain=True)

    async with turn_of(script, strict_updates=True) as (agent, recorder):
        assert agent.raised == []
        chunk, whole = agent_updates(recorder)
        # it reached the client: a URL left as AnyUrl would not encode (JSON mode made it a
        # string), and the client's model turns it back into AnyUrl
        assert (chunk["sessionUpdate"], chunk["messageId"]) == ("agent_message_chunk", "m1")
        assert {**chunk["content"], "uri": str(chunk["content"]["uri"])} == link
        assert whole["content"] == [updates.text("whole")]


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"sessionUpdate": "agent_mesage_chunk", "content": "plain string"}, "agent_mesage_chunk"),
        (
            {"sessionUpdate": "agent_message_chunk", "messageId": "m", "content": "plain string"},
            "field 'content'",
        ),
    ],
)
async def test_strict_mode_refuses_an_invalid_dict_naming_it(
    bad: dict[str, Any], named: str
) -> None:
    async def script(ctx: TurnContext) -> None:
        await ctx.emit(bad)

    async with turn_of(script, strict_updates=True) as (agent, recorder):
        assert len(agent.raised) == 1
        assert named in str(agent.raised[0])
        assert agent_updates(recorder) == []  # nothing was sent


async def test_strict_mode_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRICT_ENV, "1")
    assert ScriptedAgent(lambda ctx: anyio.lowlevel.checkpoint()).strict_updates is True
    monkeypatch.setenv(STRICT_ENV, "0")
    assert ScriptedAgent(lambda ctx: anyio.lowlevel.checkpoint()).strict_updates is False
    monkeypatch.delenv(STRICT_ENV)
    assert ScriptedAgent(lambda ctx: anyio.lowlevel.checkpoint()).strict_updates is False
    strict = ScriptedAgent(lambda ctx: anyio.lowlevel.checkpoint(), strict_updates=True)
    assert strict.strict_updates is True


async def test_outside_strict_mode_an_invalid_dict_is_sent_as_is_and_logged_once_per_kind(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime_module, "_SAMPLED", set())
    typo = {"sessionUpdate": "agent_mesage_chunk", "messageId": "m", "content": "plain string"}

    async def script(ctx: TurnContext) -> None:
        await ctx.emit(typo)
        await ctx.emit(dict(typo, messageId="m2"))

    with caplog.at_level(logging.WARNING, logger="acp_once.agent"):
        async with turn_of(script, strict_updates=False) as (agent, recorder):
            assert agent.raised == []
            assert agent_updates(recorder) == [typo, dict(typo, messageId="m2")]
    warnings = [r for r in caplog.records if "agent_mesage_chunk" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING


async def test_tool_call_helpers_and_a_permission_with_simple_arguments() -> None:
    seen: dict[str, Any] = {}

    async def script(ctx: TurnContext) -> None:
        tool_id = await ctx.start_tool_call("Write a", kind="edit", locations=["/w/a"])
        answer = await ctx.request_permission(title="Write a?", tool_call_id=tool_id)
        seen["tool_id"], seen["choice"] = tool_id, updates.selected_option(answer)
        await ctx.update_tool_call(tool_id, status="completed", content=["written"])

    recorder = Answering("allow_once")
    async with turn_of(script, recorder, strict_updates=True) as (agent, _):
        assert agent.raised == []
        tool_id = seen["tool_id"]
        assert seen["choice"] == "allow_once"
        (asked,) = recorder.asked
        sent = wire(asked)
        assert sent["title"] == "Write a?"
        assert sent["subject"] == {"type": "tool_call", "toolCall": {"toolCallId": tool_id}}
        assert [o["optionId"] for o in sent["options"]] == ["allow_once", "reject_once"]
        started, finished = agent_updates(recorder)
        assert started["toolCallId"] == finished["toolCallId"] == tool_id
        assert (started["status"], started["kind"], started["locations"]) == (
            "pending",
            "edit",
            [{"path": "/w/a"}],
        )
        assert finished["status"] == "completed"
        assert finished["content"][0]["content"]["text"] == "written"


async def test_request_permission_with_options_and_a_cancelled_answer() -> None:
    seen: dict[str, Any] = {}

    async def script(ctx: TurnContext) -> None:
        answer = await ctx.request_permission(
            title="Run it?", options=[("allow_always", "Always"), ("reject_once", "No")]
        )
        seen["choice"] = updates.selected_option(answer)
        with pytest.raises(ValueError, match="a request or a title"):
            await ctx.request_permission()

    recorder = Answering(None)
    async with turn_of(script, recorder, strict_updates=True):
        assert seen["choice"] is None
        options = wire(recorder.asked[0])["options"]
        assert options == [
            {"optionId": "allow_always", "kind": "allow_always", "name": "Always"},
            {"optionId": "reject_once", "kind": "reject_once", "name": "No"},
        ]


async def test_outside_strict_mode_only_the_first_dict_of_a_kind_is_validated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runtime_module, "_SAMPLED", set())
    checked: list[str] = []

    def counting(update: dict[str, Any]) -> None:
        checked.append(update["sessionUpdate"])

    monkeypatch.setattr(runtime_module, "check_update", counting)

    async def script(ctx: TurnContext) -> None:
        for i in range(3):
            await ctx.emit(wire(updates.agent_message_chunk(str(i), message_id="m")))
        await ctx.emit(updates.agent_message("012", message_id="m"))  # a model: never checked

    async with turn_of(script, strict_updates=False) as (_, recorder):
        assert len(agent_updates(recorder)) == 4
    # the hot path is a set lookup after the first (the runtime's own state_update dicts
    # are sampled the same way)
    assert checked.count("agent_message_chunk") == 1
    assert "agent_message" not in checked
