"""Misspelt values of ACP's open string sets are caught: by `mypy --strict` (the builders, the
tool-call helpers and `run_turn` take `Literal`s or an `Extension`) and at run time in strict
mode; `_`-prefixed extensions stay expressible both ways."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from acp_once.agent import (
    Extension,
    SessionAgent,
    StopReason,
    Turn,
    TurnContext,
    extension,
    updates,
)
from acp_once.protocol import schema as s
from acp_once.protocol.vocabulary import check_open_value
from acp_once.storage import MemoryStore
from acp_once.testing import connected
from tests.agent.test_updates import agent_updates, turn_of
from tests.helpers import UpdateRecorder, initialize_request

TYPOS = """\
from acp_once.agent import Extension, SessionAgent, StopReason, Turn, TurnContext, extension
from acp_once.agent import updates


class Typos(SessionAgent):
    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason:
        tool = await ctx.start_tool_call("Read", kind="raed")
        await ctx.emit(updates.tool_call_update(tool, status="complete"))
        return "end_trun"


class Extensions(SessionAgent):
    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason | Extension:
        tool = await ctx.start_tool_call("Ask", kind=extension("_ask_user"))
        await ctx.emit(updates.tool_call_update(tool, status=extension("_waiting")))
        await ctx.emit(updates.plan_entry("x", priority="high"))
        return extension("_rate_limited")
"""


pytestmark = pytest.mark.anyio


def test_mypy_strict_rejects_the_three_typos_and_accepts_extensions(tmp_path: Path) -> None:
    (tmp_path / "typos.py").write_text(TYPOS)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--cache-dir",
         str(tmp_path / "cache"), "--follow-imports=silent", "typos.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    errors = [line for line in done.stdout.splitlines() if ": error: " in line]
    assert done.returncode == 1, done.stdout + done.stderr
    assert len(errors) == 3, errors
    kind, status, reason = errors
    assert kind.startswith('typos.py:7: error: Argument "kind" to "start_tool_call"')
    assert "\"Literal['raed']\"" in kind and "'read'" in kind and "Extension" in kind
    assert status.startswith('typos.py:8: error: Argument "status" to "tool_call_update"')
    assert "\"Literal['complete']\"" in status and "'completed'" in status
    assert reason.startswith("typos.py:9: error: Incompatible return value type")
    assert "\"Literal['end_trun']\"" in reason and "'end_turn'" in reason


def test_extension_takes_only_underscored_names() -> None:
    assert extension("_mine") == "_mine"
    for bad in ("raed", "", "_"):
        with pytest.raises(ValueError, match="starts with '_'"):
            extension(bad)
    check_open_value("kind", "read")
    check_open_value("kind", "_mine")
    with pytest.raises(ValueError, match=r"kind 'raed' is not one of delete, edit, execute"):
        check_open_value("kind", "raed")


async def test_strict_mode_refuses_a_misspelt_tool_kind_or_status() -> None:
    async def script(ctx: TurnContext) -> None:
        raed = cast(Any, "raed")  # what an untyped caller passes
        await ctx.emit(updates.tool_call("Read", kind=raed))

    async with turn_of(script, strict_updates=True) as (agent, recorder):
        assert [str(e) for e in agent.raised] == [
            "invalid tool_call_update update: kind 'raed' is not one of delete, edit, execute, "
            "fetch, move, other, read, search, switch_mode, think (an extension starts with _)"
        ]
        assert agent_updates(recorder) == []  # nothing reached the client

    async def extended(ctx: TurnContext) -> None:
        tool = await ctx.start_tool_call("Ask", kind=extension("_ask"), status="in_progress")
        await ctx.update_tool_call(tool, status=extension("_waiting"))

    async with turn_of(extended, strict_updates=True) as (agent, recorder):
        assert agent.raised == []
        sent = agent_updates(recorder)
        assert [(u.get("kind"), u["status"]) for u in sent] == [
            ("_ask", "in_progress"),
            (None, "_waiting"),
        ]

    async def lenient(ctx: TurnContext) -> None:
        await ctx.emit(updates.tool_call("Read", kind=cast(Any, "raed")))

    async with turn_of(lenient, strict_updates=False) as (agent, recorder):  # the schema allows it
        assert agent.raised == []
        assert [u["kind"] for u in agent_updates(recorder)] == ["raed"]


class Returning(SessionAgent):
    def __init__(self, reason: str, **kw: Any) -> None:
        super().__init__(MemoryStore(), **kw)
        self.reason = reason

    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason | Extension:
        return cast(StopReason, self.reason)  # whatever an untyped agent returns


async def _stop_reason(reason: str, *, strict: bool) -> str:
    recorder = UpdateRecorder()
    agent = Returning(reason, strict_updates=strict)
    async with agent, connected(agent, recorder) as conn:
        await conn.agent.initialize(initialize_request())
        sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
        prompt = {"sessionId": sid, "prompt": [updates.text("go")]}
        await conn.agent.prompt(s.PromptRequest.model_validate(prompt))
        with anyio.fail_after(10):
            await recorder.wait_for(lambda seen: any(u.get("stopReason") for u in seen))
    (reason_sent,) = [u["stopReason"] for u in recorder.updates if u.get("stopReason")]
    return str(reason_sent)


async def test_strict_mode_ends_a_turn_with_a_misspelt_stop_reason_as_an_error() -> None:
    assert await _stop_reason("end_trun", strict=True) == "error"
    assert await _stop_reason("_rate_limited", strict=True) == "_rate_limited"
    assert await _stop_reason("max_tokens", strict=True) == "max_tokens"
    assert await _stop_reason("end_trun", strict=False) == "end_trun"
