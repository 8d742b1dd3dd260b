"""At 80 columns nothing is cut: every `--help` folds long option names and defaults instead
of ending them in "…", the demo's table turns (one row per figure) when its ten columns do not
fit, and `check`'s table fits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from acp_once.cli.app import app

COMMANDS = [
    [], ["agent"], ["serve"], ["bridge"], ["prompt"], ["check"], ["status"], ["zed"],
    ["demo"], ["db"], ["db", "migrate"], ["db", "status"],
]  # fmt: skip


def _acp_once(*args: str, columns: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "acp_once", *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "acp-once")
def test_help_fits_80_columns_and_cuts_nothing(command: list[str]) -> None:
    env = {"COLUMNS": "80", "TERMINAL_WIDTH": "80", "NO_COLOR": "1", "TERM": "dumb"}
    result = CliRunner().invoke(app, [*command, "--help"], env=env, prog_name="acp-once")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in result.output, [line for line in lines if "…" in line]
    if command == ["serve"]:  # the longest option name, folded whole
        assert "--max-connections-per-add" in result.output and "ress" in result.output


def test_the_demo_table_turns_at_80_columns_and_not_when_wide() -> None:
    narrow = _acp_once("demo", "--submissions", "5", columns=80)
    assert narrow.returncode == 0, narrow.stderr
    lines = narrow.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in narrow.stdout
    header = next(line for line in lines if "with keys" in line and "no keys" in line)
    assert header.startswith("┃")  # the runs are the columns
    assert any(line.startswith("│ dup. side effects ") for line in lines)

    wide = _acp_once("demo", "--submissions", "5", columns=200)
    assert wide.returncode == 0, wide.stderr
    assert any(
        "inserted once" in line and "client restarts" in line for line in wide.stdout.splitlines()
    )


def test_check_fits_80_columns() -> None:
    agent = [sys.executable, "-m", "acp_once", "agent", "--store", "memory:"]
    done = _acp_once("check", "--only", "session.new", "--", *agent, columns=80)
    assert done.returncode == 0, done.stdout
    table = [line for line in done.stdout.splitlines() if line[:1] in "┏┃┡│└"]
    assert table and max(len(line) for line in table) <= 80
    assert "…" not in done.stdout
