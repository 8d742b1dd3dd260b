"""`acp-once prompt` and `acp-once check` against an ACP v1 agent written with the official
Python SDK 0.12.1 (`acp`, tests/agents/sdk_v1_agent.py), each a real subprocess over real
pipes: the turn printed, no key sent (read from the agent's side), the unaware-agent policy,
and one clear line where the old client printed a traceback."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from acp_once.cli.check import EXIT_V1

pytestmark = pytest.mark.slow

AGENT = Path(__file__).resolve().parents[1] / "agents" / "sdk_v1_agent.py"
NO_KEYS = "v1 has no idempotency keys, so a resend after a lost answer may run the work twice"


def sdk_agent(tmp: Path) -> str:
    return shlex.join([sys.executable, str(AGENT), "--log", str(tmp / "received.jsonl")])


def received(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "received.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def acp_once(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acp_once", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "400"},
    )


def test_prompt_prints_a_v1_turn_sends_no_key_and_warns_once(tmp_path: Path) -> None:
    done = acp_once("prompt", "--agent", sdk_agent(tmp_path), "hello [tool]")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "ACP v1 agent: sent without an idempotency key" in out
    assert "agent echo: " in out
    assert "tool Read the file: completed" in out
    assert out.rstrip().endswith("stop reason: end_turn")
    assert "Traceback" not in out + done.stderr
    assert done.stderr.count(NO_KEYS) == 1
    prompts = [m["params"] for m in received(tmp_path) if m.get("method") == "session/prompt"]
    assert prompts == [
        {"sessionId": prompts[0]["sessionId"], "prompt": [{"type": "text", "text": "hello [tool]"}]}
    ]
    assert "idempotencyKey" not in json.dumps(received(tmp_path))


def test_prompt_with_trust_proceeds_without_the_warning(tmp_path: Path) -> None:
    done = acp_once("prompt", "--on-unaware", "trust", "--agent", sdk_agent(tmp_path), "hi")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("stop reason: end_turn")
    assert NO_KEYS not in done.stdout + done.stderr


def test_prompt_with_refuse_refuses_a_v1_agent_in_one_line(tmp_path: Path) -> None:
    done = acp_once("prompt", "--on-unaware", "refuse", "--agent", sdk_agent(tmp_path), "hi")
    assert done.returncode == 1
    (line,) = done.stdout.strip().splitlines()
    assert line.startswith("refused the agent:")
    assert NO_KEYS in line
    assert "Traceback" not in done.stdout + done.stderr
    assert [m for m in received(tmp_path) if m.get("method") == "session/new"] == []


def test_an_initialize_answer_that_is_not_acp_is_one_line(tmp_path: Path) -> None:
    # answers initialize with v2's `info` field, malformed: neither a v2 nor a v1 answer
    script = tmp_path / "not_acp.py"
    script.write_text(
        "import json, sys\n"
        "request = json.loads(sys.stdin.readline())\n"
        "result = {'protocolVersion': 2, 'info': 'broken'}\n"
        "answer = {'jsonrpc': '2.0', 'id': request['id'], 'result': result}\n"
        "print(json.dumps(answer), flush=True)\n"
        "sys.stdin.readline()\n",
        encoding="utf-8",
    )
    agent = shlex.join([sys.executable, str(script)])
    done = acp_once("prompt", "--agent", agent, "hi")
    assert done.returncode == 1
    (line,) = done.stdout.strip().splitlines()
    assert (
        line
        == "refused the agent: the agent's initialize answer is not valid ACP: info: Input should "
        "be a valid dictionary or instance of Implementation"
    )
    assert "Traceback" not in done.stdout + done.stderr


def test_check_says_in_one_line_that_the_agent_speaks_v1(tmp_path: Path) -> None:
    command = [sys.executable, str(AGENT), "--log", str(tmp_path / "received.jsonl")]
    done = acp_once("check", "--", *command)
    assert done.returncode == EXIT_V1 == 3
    (line,) = done.stdout.strip().splitlines()
    assert line == (
        "acp-once check: this agent speaks ACP v1; the conformance suite checks v2 agents; "
        f"run it behind `acp-once agent --runtime v1 --store STORE -- {shlex.join(command)}` "
        "to get keys"
    )
    # one initialize, no check run against it
    assert [m.get("method") for m in received(tmp_path)] == ["initialize"]


def test_prompt_continues_a_v1_session_through_session_load(tmp_path: Path) -> None:
    state = str(tmp_path / "state.json")
    agent = shlex.join(
        [sys.executable, str(AGENT), "--log", str(tmp_path / "received.jsonl"), "--state", state]
    )
    first = acp_once("prompt", "--on-unaware", "trust", "--agent", agent, "first")
    assert first.returncode == 0, first.stdout + first.stderr
    session_id = first.stdout.splitlines()[0].removeprefix("session ").strip()
    assert session_id.startswith("sdk_")
    again = acp_once(
        "prompt", "--on-unaware", "trust", "--agent", agent, "--session", session_id, "second"
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.splitlines()[0] == f"session {session_id}"
    assert "agent echo: second" in again.stdout
    assert "first" not in again.stdout  # the history the load replays is not printed
    loads = [m["params"] for m in received(tmp_path) if m.get("method") == "session/load"]
    assert [p["sessionId"] for p in loads] == [session_id]


def test_prompt_to_a_v1_session_without_session_load_is_one_line(tmp_path: Path) -> None:
    agent = shlex.join([sys.executable, str(AGENT), "--no-load"])
    done = acp_once("prompt", "--agent", agent, "--session", "sdk_gone", "hi")
    assert done.returncode == 1
    (line,) = done.stdout.strip().splitlines()
    assert line.startswith("refused (-32601):")
    assert "does not offer session/load" in line


def bare_sdk_agent(tmp: Path) -> list[str]:
    """The SDK agent answering `initialize` as the SDK's simple echo examples do: the client's
    version (2) and nothing else, no `info`."""
    return [sys.executable, str(AGENT), "--log", str(tmp / "received.jsonl"), "--bare-initialize"]


def test_prompt_takes_an_agent_that_echoes_the_version_without_info_as_v1(tmp_path: Path) -> None:
    done = acp_once("prompt", "--agent", shlex.join(bare_sdk_agent(tmp_path)), "hello")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ACP v1 agent: sent without an idempotency key" in done.stdout
    assert done.stdout.rstrip().endswith("stop reason: end_turn")
    assert "idempotencyKey" not in json.dumps(received(tmp_path))


def test_check_says_in_one_line_that_an_echoing_agent_without_info_speaks_v1(
    tmp_path: Path,
) -> None:
    command = bare_sdk_agent(tmp_path)
    done = acp_once("check", "--", *command)
    assert done.returncode == EXIT_V1, done.stdout + done.stderr
    (line,) = done.stdout.strip().splitlines()
    assert line.startswith("acp-once check: this agent speaks ACP v1;")
    assert [m.get("method") for m in received(tmp_path)] == ["initialize"]
