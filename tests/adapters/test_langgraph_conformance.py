"""The conformance suite (the seven RFD traces and the probe set) against the LangGraph adapter,
over real stdio, its sessions in a LangGraph SQLite checkpointer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from acp_once.adapters.langgraph import LangGraphStore
from acp_once.client import StdioLauncher
from acp_once.conformance import CHECKS, Status, run_suite

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def langgraph_command(tmp: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "acp_once",
        "agent",
        "--runtime",
        "langgraph",
        "--store",
        f"sqlite:{tmp / 'threads.sqlite3'}",
        "--side-effects",
        str(tmp / "effects"),
        *extra,
    ]


async def test_the_langgraph_adapter_passes_every_check(tmp_path: Path) -> None:
    report = await run_suite(
        StdioLauncher(langgraph_command(tmp_path)), slow_prompt="[work:1]", timeout=30
    )
    not_passed = {r.id: r.message for r in report.results if r.status is not Status.PASSED}
    assert not_passed == {}
    assert [r.id for r in report.results] == [c.id for c in CHECKS]
    assert report.exit_code == 0
    # no stored prompt to compare with: a reused key is answered as a retry (R23 allows it)
    assert "answered as a retry" in report.by_id("reuse.different-prompt").message
    # the sessions really are LangGraph threads: their user messages are in the checkpointer,
    # each id once
    async with LangGraphStore.open(f"sqlite:{tmp_path / 'threads.sqlite3'}") as threads:
        sessions, _ = await threads.list_sessions(limit=1000)
        assert sessions
        human: list[str | None] = []
        for record in sessions:
            messages = await threads.thread_messages(record.session_id)
            ids = [m.id for m in messages]
            assert len(ids) == len(set(ids))
            human.extend(m.id for m in messages if m.type == "human")
    assert len(human) >= 20
