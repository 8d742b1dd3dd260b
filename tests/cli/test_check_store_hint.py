"""`acp-once check` says when the store is the cause: a stdio agent on `memory:` loses its
sessions each time check starts it again, which fails the restart checks with "Session not
found"; the report ends with one line pointing at a durable store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECKS = ["--only", "trace.T3-agent-restart", "--only", "privacy.no-key-in-frames"]


def check(store: str) -> subprocess.CompletedProcess[str]:
    agent = [sys.executable, "-m", "acp_once", "agent", "--store", store]
    return subprocess.run(
        [sys.executable, "-m", "acp_once", "check", *CHECKS, "--", *agent],
        env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip


def test_a_memory_store_failing_the_restart_checks_is_named() -> None:
    done = check("memory:")
    assert done.returncode == 1
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("hint: 2 check(s) failed with Session not found (-32002)"), last
    assert "(--store memory:)" in last and "--store sqlite:" in last


def test_a_durable_store_passes_them_without_a_hint(tmp_path: Path) -> None:
    done = check(f"sqlite:{tmp_path / 'agent.db'}")
    assert done.returncode == 0, done.stdout
    assert "hint:" not in done.stdout
