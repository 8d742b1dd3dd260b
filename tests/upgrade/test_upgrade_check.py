"""`acp-once check` against `acp-once agent --runtime v1 -- <an official Python SDK 0.12.1
agent>`: every requirement of the conformance suite holds for an upgraded v1 agent.

Two checks per test, then the privacy check over their frames: each check starts the upgraded
agent (two Python processes) a few times, so the reference agent's groups
(`tests/conformance/groups.py`) would take over a minute each here."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from rich.console import Console

from acp_once.cli.check import run_check
from acp_once.conformance import CHECKS, checks_for
from tests.conformance.groups import PRIVACY

SDK_AGENT = Path(__file__).parents[1] / "agents" / "sdk_v1_effects_agent.py"
_IDS = [c.id for c in CHECKS if c.id != PRIVACY]
PAIRS = [_IDS[i : i + 2] for i in range(0, len(_IDS), 2)]


def upgraded_command(tmp: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "acp_once",
        "agent",
        "--runtime",
        "v1",
        "--store",
        f"sqlite:{tmp / 'sessions.sqlite3'}",
        "--",
        sys.executable,
        str(SDK_AGENT),
        "--effects",
        str(tmp / "effects.log"),
        "--load",
        "--state",
        str(tmp / "v1-state.json"),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_the_upgraded_sdk_agent_passes_every_check(tmp_path: Path, pair: list[str]) -> None:
    selected = [*pair, PRIVACY]
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    code = run_check(
        target=None,
        command=upgraded_command(tmp_path),
        token=None,
        json_report=tmp_path / "report.json",
        junit=None,
        slow_prompt="[work:1]",
        timeout=20,
        console=console,
        select=selected,
    )
    data = json.loads((tmp_path / "report.json").read_text())
    not_passed = {r["id"]: r["message"] for r in data["results"] if r["status"] != "passed"}
    assert not_passed == {}, out.getvalue()
    assert code == 0
    assert [r["id"] for r in data["results"]] == [c.id for c in checks_for(selected)]
