"""Your own agent on the command line: `acp-once serve FILE.py:FACTORY` / `MODULE:FACTORY` and
`acp-once agent ...` (stdio), `serve_agent` from Python (examples/serve_agent.py), and the
one-line errors of a factory that cannot be loaded."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]
URL = re.compile(r"ws://127\.0\.0\.1:(\d+)/acp")

AGENT_FILE = """
from acp_once.agent import SessionAgent, Turn, TurnContext
from acp_once.agent.updates import agent_message

print("noise at import time")  # must not reach the stdio agent's stdout


class ShoutAgent(SessionAgent):
    async def run_turn(self, turn: Turn, ctx: TurnContext) -> str:
        await ctx.emit(agent_message(turn.text.upper() + "!"), retain=True)
        return "end_turn"


def make_agent(store):
    return ShoutAgent(store)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ACP_ONCE_TOKEN"}
    env["COLUMNS"] = "200"
    env.update(extra)
    return env


@contextmanager
def running(argv: list[str], cwd: Path, env: dict[str, str]) -> Iterator[str]:
    """`argv` as a server subprocess; yields its ws:// URL read from its stderr (killed after
    60 s whatever happens)."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if found := URL.search(line):
                break
        else:
            raise AssertionError("".join(seen))
        yield found.group(0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def acp_once(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acp_once", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_serve_a_file_factory_with_a_token_and_prompt_it(tmp_path: Path) -> None:
    (tmp_path / "shout.py").write_text(AGENT_FILE)
    argv = [sys.executable, "-m", "acp_once", "serve", "shout.py:make_agent", "--port", "0"]
    argv += ["--store", "sqlite:s.db"]
    with running(argv, tmp_path, _env(ACP_ONCE_TOKEN="t0ken")) as url:
        done = acp_once("prompt", "hello", "--agent", url, cwd=tmp_path, env=_env())
        assert done.returncode == 1 and "401" in done.stdout + done.stderr, done.stdout
        done = acp_once(
            "prompt", "hello", "--agent", url, cwd=tmp_path, env=_env(ACP_ONCE_TOKEN="t0ken")
        )
        assert done.returncode == 0, done.stderr
        assert "HELLO!" in done.stdout


def test_the_stdio_agent_takes_a_module_factory_and_keeps_stdout_clean(tmp_path: Path) -> None:
    (tmp_path / "shout.py").write_text(AGENT_FILE)
    agent = f"{sys.executable} -m acp_once agent shout:ShoutAgent --store sqlite:s.db"
    done = acp_once("prompt", "hi there", "--agent", agent, cwd=tmp_path, env=_env())
    assert done.returncode == 0, done.stderr
    assert "HI THERE!" in done.stdout
    assert "noise at import time" in done.stderr


def test_a_factory_agent_starts_without_the_cli_framework(tmp_path: Path) -> None:
    (tmp_path / "shout.py").write_text(AGENT_FILE)
    initialize = {
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": 2, "info": {"name": "t", "version": "1"}},
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "acp_once", "agent", "shout.py:ShoutAgent",
         "--store", "memory:"],
        cwd=tmp_path, input=json.dumps(initialize) + "\n", capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[0])["result"]["protocolVersion"] == 2
    imported = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines()}
    assert "acp_once.agent.factory" in imported
    assert "typer" not in imported and "acp_once.cli.app" not in imported


def test_the_fast_path_reads_a_factory_and_leaves_reference_options_to_typer() -> None:
    from acp_once.cli.stdio_agent import parse_agent_args

    args = parse_agent_args(["my.py:make", "--store", "memory:", "-v"])
    assert args is not None and (args.target, args.store, args.verbose) == (
        "my.py:make",
        "memory:",
        1,
    )
    assert parse_agent_args(["my.py:make", "--policy", "steer"]) is None
    assert parse_agent_args(["my.py:make", "other:make"]) is None


def test_the_docs_quickstart_agent_runs_on_stdio(tmp_path: Path) -> None:
    example = ROOT / "examples" / "my_agent.py"
    agent = f"{sys.executable} -m acp_once agent {example}:EchoAgent --store sqlite:q.db"
    done = acp_once("prompt", "quick", "--agent", agent, cwd=tmp_path, env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "you said: quick" in done.stdout


def test_the_serve_agent_example_serves_its_agent(tmp_path: Path) -> None:
    argv = [sys.executable, str(ROOT / "examples" / "serve_agent.py"), "0"]
    with running(argv, tmp_path, _env()) as url:
        done = acp_once("prompt", "ping", "--agent", url, cwd=tmp_path, env=_env())
        assert done.returncode == 0, done.stderr
        assert "you said: ping" in done.stdout
    assert (tmp_path / "sessions.db").exists()


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nowhere_module:make", "no module named 'nowhere_module'"),
        ("shout.py:nothing", "has no attribute 'nothing'"),
        ("missing.py:make", "no file"),
        ("shout", "expected MODULE:NAME or FILE.py:NAME"),
    ],
)
def test_a_factory_that_cannot_be_loaded_is_one_usage_error(
    tmp_path: Path, target: str, message: str
) -> None:
    (tmp_path / "shout.py").write_text(AGENT_FILE)
    for command in ("agent", "serve"):
        done = acp_once(command, target, "--store", "memory:", cwd=tmp_path, env=_env())
        assert done.returncode == 2, done.stderr
        assert message in done.stderr
        assert "Traceback" not in done.stderr


def test_the_reference_agents_options_are_refused_with_a_factory(tmp_path: Path) -> None:
    (tmp_path / "shout.py").write_text(AGENT_FILE)
    done = acp_once("agent", "shout:make_agent", "--policy", "steer", cwd=tmp_path, env=_env())
    assert done.returncode == 2
    assert "--policy" in done.stderr and "reference agent" in done.stderr


def test_a_factory_that_makes_no_agent_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("def make(store):\n    return 42\n")
    done = acp_once("agent", "bad.py:make", "--store", "memory:", cwd=tmp_path, env=_env())
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "acp-once agent: make made a int, not an acp_once.agent.Agent "
        "(subclass SessionAgent or Agent)"
    ]
