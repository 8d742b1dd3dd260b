"""`acp-once demo --agent-cmd`: the demo's faults with Codex behind the upgrade runtime.

The runtime is killed at random moments (with Codex and its tools) and dies after some
commits before answering (cut answers); the client restarts twice. Every prompt makes Codex
append its number to `effects.log` in the session's directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from acp_once.demo import run_demo
from acp_once.support.proctree import with_environment
from tests.codex.model_server import ModelServer, codex_home

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

PROMPT = "run: echo {i} >> effects.log"


async def test_with_keys_each_prompt_is_inserted_once_and_its_tool_never_runs_twice(
    tmp_path: Path, model: ModelServer, codex_bin: str
) -> None:
    env = codex_home(tmp_path / "codex-home", model.base_url)
    with anyio.fail_after(120):
        result = await run_demo(
            keys=True,
            submissions=30,
            seed=4,
            workdir=tmp_path,
            cut_rate=0.1,
            agent_cmd=[codex_bin],
            prompt=PROMPT,
            effects=True,
            env=env,
        )
    assert result.inserted_once == 30
    assert result.inserted_twice_or_more == 0 and result.lost == 0
    assert result.duplicate_side_effects == 0
    # a tool is missing only where a fault ended its turn first
    assert result.missing_side_effects <= result.interrupted_turns
    assert result.agent_kills + result.cut_answers > 0, "no fault was injected"
    assert result.client_restarts >= 1
    # nothing the run started outlives it (Codex ignores the end of its stdin)
    assert with_environment("CODEX_HOME", env["CODEX_HOME"]) == []


def test_the_demo_command_with_a_v1_agent_prints_both_runs(
    tmp_path: Path, model: ModelServer, codex_bin: str
) -> None:
    env = {**os.environ, **codex_home(tmp_path / "codex-home", model.base_url)}
    command = [
        sys.executable, "-m", "acp_once", "demo", "--submissions", "12", "--seed", "2",
        "--agent-cmd", codex_bin, "--prompt", PROMPT, "--effects",
    ]  # fmt: skip
    shown = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "With keys every submission was inserted exactly once." in shown.stdout
    # the console folds its lines at the terminal's width, where the agent's path falls
    assert "behind `acp-once agent --runtime v1`" in " ".join(shown.stdout.split())
    assert "Traceback" not in shown.stderr
    refused = subprocess.run(
        [sys.executable, "-m", "acp_once", "demo", "--agent-cmd", codex_bin, "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2 and "{i}" in refused.stderr
