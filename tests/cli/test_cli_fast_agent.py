"""`acp-once agent` starts without typer and rich, and does what the typer command does.

The console script (`acp_once.cli.entry`) runs the common forms of `acp-once agent` through
`acp_once.cli.stdio_agent`; everything else goes to the typer application. These tests hold
the two paths to the same agent option by option, check that the fast path hands every other
form to typer, and guard what the start imports and builds: no command-line framework, no
extra, no v1 models, no pydantic validator that the first request does not need.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from acp_once.cli import stdio_agent
from acp_once.cli.app import app

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": 2, "info": {"name": "fast-agent-test", "version": "1"}},
}
# what the start of `acp-once agent` must not import (the framework, the extras, the v1 face)
NOT_IMPORTED = (
    "typer", "rich", "click", "starlette", "uvicorn", "websockets", "httpx", "h11", "psycopg",
    "langgraph", "langchain_core", "acp_once.server", "acp_once.client", "acp_once.adapters",
    "acp_once.protocol.v1", "acp_once.protocol._generated.v1",
)  # fmt: skip


class Started:
    """What `run_reference` and `logging.basicConfig` were called with."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[dict[str, Any]] = []
        self.levels: list[int] = []
        monkeypatch.setattr(stdio_agent, "run_reference", self._run)
        monkeypatch.setattr(logging, "basicConfig", lambda **kw: self.levels.append(kw["level"]))

    def _run(self, url: str, **options: Any) -> None:
        self.calls.append({"url": url, **options})

    def take(self) -> tuple[dict[str, Any], int]:
        assert len(self.calls) == 1 and len(self.levels) == 1, (self.calls, self.levels)
        taken = self.calls.pop(), self.levels.pop()
        return taken


def _argvs(tmp: Path) -> list[list[str]]:
    return [
        [],
        ["--store", "memory"],
        ["--store=memory:"],
        [
            "--store",
            f"sqlite:{tmp / 'deep' / 'dir' / 's.sqlite3'}",
            "--policy",
            "steer",
            "--no-compare-prompts",
            "--side-effects",
            str(tmp / "effects"),
            "--interrupted",
            "continue",
            "--runtime",
            "reference",
            "-vv",
        ],
        ["--store", "memory", "-v", "--log-level", "ERROR"],
        ["--verbose", "--compare-prompts", "--log-level=debug", "--store", "memory"],
        ["-v", "-v", "--policy=hold", "--interrupted=report", "--side-effects=fx"],
    ]


def test_the_fast_path_starts_the_agent_typer_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # the default store's home
    started = Started(monkeypatch)
    for argv in _argvs(tmp_path):
        assert stdio_agent.try_fast_agent(argv), argv
        fast = started.take()
        assert app(["agent", *argv], standalone_mode=False) is None
        assert started.take() == fast, argv
    assert (tmp_path / "deep" / "dir").is_dir()
    assert (tmp_path / "data" / "acp-once").is_dir()  # the default SQLite file's directory


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--policy", "HOLD"],
        ["--store", "nope"],
        ["--store", "postgresql://127.0.0.1/db"],
        ["--store", "memory", "--store", "memory"],
        ["--runtime", "langgraph"],
        ["--runtime", "v1", "--", "agent"],
        ["--bogus"],
        ["--store"],
        ["--store", "--policy"],
        ["--store="],
        ["stray"],
        ["--", "cmd"],
        ["-vvvv"],
    ],
)
def test_the_fast_path_leaves_every_other_form_to_typer(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    started = Started(monkeypatch)
    assert stdio_agent.try_fast_agent(argv) is False
    assert started.calls == [] and started.levels == []


def _agent(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -X importtime -m acp_once agent ARGS`, sent `initialize` on stdin (then EOF)."""
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "acp_once", "agent", *args],
        input=json.dumps(INITIALIZE) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "200"},  # typer's error box on one line
    )


def _imported(stderr: str) -> set[str]:
    return {
        line.rpartition("|")[2].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:") and "[us]" not in line
    }


def test_agent_answers_initialize_without_importing_the_cli_framework(tmp_path: Path) -> None:
    done = _agent("--store", f"sqlite:{tmp_path / 's.sqlite3'}", "--side-effects", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.splitlines()[0])
    assert answer["id"] == 1 and answer["result"]["protocolVersion"] == 2
    imported = _imported(done.stderr)
    assert "acp_once.agent.reference" in imported  # the profile saw the agent's imports
    assert "acp_once.cli.app" not in imported
    for name in NOT_IMPORTED:
        assert not {m for m in imported if m == name or m.startswith(name + ".")}, name


def test_a_form_the_fast_path_does_not_take_still_gets_typers_answer() -> None:
    refused = _agent("--store", "nope")
    assert refused.returncode == 2
    assert "--store" in refused.stderr and "has no scheme" in refused.stderr
    assert "typer" in _imported(refused.stderr)


def test_the_agent_path_builds_no_validator_at_import() -> None:
    """Importing what `acp-once agent` runs builds no pydantic validator of a wire model or of
    a method's params; the first use builds it (and then validates as before)."""
    code = """
import sys
import acp_once.cli.stdio_agent, acp_once.cli._eventloop
import acp_once.agent.reference, acp_once.agent.serve, acp_once.storage
from pydantic import BaseModel
from acp_once.agent import updates
from acp_once.protocol import methods, schema as s

built = [
    name for name, model in vars(s).items()
    if isinstance(model, type) and issubclass(model, BaseModel)
    and model.__module__.startswith("acp_once.protocol._generated")
    and model.__pydantic_complete__
]
assert built == [], built
specs = {**methods.AGENT_METHODS, **methods.CLIENT_METHODS}
adapters = [name for name, spec in specs.items() if spec.params.pydantic_complete]
assert adapters == [], adapters
assert updates._kinds.cache_info().currsize == 0
params = specs["session/set_config_option"].params.validate_python(
    {"sessionId": "s", "configId": "c", "type": "boolean", "value": True}
)
assert type(params).__name__ == "SetSessionConfigOptionRequestBoolean", params
assert "agent_message" in updates.update_kinds()
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_collector_paused_for_the_imports_runs_again_after_them() -> None:
    assert gc.isenabled()
    try:
        with pytest.raises(ImportError), stdio_agent._imports_frozen():
            assert not gc.isenabled()
            import acp_once.no_such_module  # type: ignore[import-not-found]  # noqa: F401
        assert gc.isenabled()
        assert gc.get_freeze_count() > 0  # what the block left alive is out of reach
        gc.disable()
        with stdio_agent._imports_frozen():  # a collector the caller paused stays paused
            pass
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
