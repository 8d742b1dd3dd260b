"""`acp-once zed` prints an `agent_servers` entry that works where Zed runs it: started from
another directory with a bare PATH, the command answers `initialize`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": 2, "info": {"name": "zed-test", "version": "1"}},
}
AGENT = """
from acp_once.agent import SessionAgent, Turn, TurnContext


class Quiet(SessionAgent):
    async def run_turn(self, turn: Turn, ctx: TurnContext) -> str:
        return "end_turn"
"""


def zed(cwd: Path, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "acp_once", "zed", *args],
        cwd=cwd, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    settings = json.loads(done.stdout)
    assert list(settings) == ["agent_servers"]
    (entry,) = settings["agent_servers"].values()
    assert entry["type"] == "custom"
    assert Path(entry["command"]).is_absolute()
    return dict(entry)


def answers_initialize(entry: dict[str, Any], elsewhere: Path) -> dict[str, Any]:
    """Run the entry as Zed would: another working directory, a PATH without this venv."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(elsewhere), **entry.get("env", {})}
    done = subprocess.run(
        [entry["command"], *entry["args"]],
        cwd=elsewhere, env=env, input=json.dumps(INITIALIZE) + "\n", capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout.splitlines()[0])
    return answer


def test_the_reference_agents_entry_runs_from_anywhere(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    entry = zed(tmp_path, "--store", "sqlite:rel/sessions.db")
    assert entry["args"][-3:] == ["agent", "--store", f"sqlite:{tmp_path}/rel/sessions.db"]
    answer = answers_initialize(entry, tmp_path / "elsewhere")
    assert answer["result"]["protocolVersion"] == 2
    assert (tmp_path / "rel" / "sessions.db").exists()


def test_a_module_factorys_entry_carries_its_directory(tmp_path: Path) -> None:
    (tmp_path / "quiet_agent.py").write_text(AGENT)
    (tmp_path / "elsewhere").mkdir()
    entry = zed(tmp_path, "quiet_agent:Quiet", "--store", "sqlite:q.db", "--name", "Quiet")
    assert entry["args"][-4:] == [
        "agent",
        "quiet_agent:Quiet",
        "--store",
        f"sqlite:{tmp_path}/q.db",
    ]
    assert entry["env"] == {"PYTHONPATH": str(tmp_path)}
    assert answers_initialize(entry, tmp_path / "elsewhere")["result"]["protocolVersion"] == 2


def test_a_file_factory_is_made_absolute(tmp_path: Path) -> None:
    (tmp_path / "quiet_agent.py").write_text(AGENT)
    (tmp_path / "elsewhere").mkdir()
    entry = zed(tmp_path, "quiet_agent.py:Quiet", "--store", "sqlite:q.db")
    assert f"{tmp_path}/quiet_agent.py:Quiet" in entry["args"]
    assert "env" not in entry
    assert answers_initialize(entry, tmp_path / "elsewhere")["result"]["protocolVersion"] == 2


def test_a_v1_agent_is_put_behind_the_v1_runtime(tmp_path: Path) -> None:
    entry = zed(tmp_path, "--runtime", "v1", "--store", "sqlite:u.db", "--", "npx", "x", "--acp")
    args = entry["args"]
    assert args[args.index("agent") :] == [
        "agent", "--runtime", "v1", "--store", f"sqlite:{tmp_path}/u.db", "--", "npx", "x", "--acp",
    ]  # fmt: skip


def test_a_factory_that_does_not_load_is_refused_at_once(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "acp_once", "zed", "no_such_module:make"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 2
    assert "no module named 'no_such_module'" in done.stderr
