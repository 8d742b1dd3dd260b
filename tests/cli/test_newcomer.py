"""A newcomer's path, as the README tells it, with real processes: write an agent file, serve it
with a token (`acp-once serve FILE.py:FACTORY`), drive it (`acp-once prompt ws://...`), check it
(`acp-once check ws://...`), and print its Zed entry (`acp-once zed FILE.py:FACTORY`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")

MY_AGENT = """\
from acp_once.agent import SessionAgent, StopReason, Turn, TurnContext
from acp_once.agent.updates import agent_message
from acp_once.storage import SessionStore


class Reverser(SessionAgent):
    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason:
        await ctx.emit(agent_message(turn.text[::-1]), retain=True)
        return "end_turn"


def make_agent(store: SessionStore) -> Reverser:
    return Reverser(store)
"""
URL = re.compile(r"ws://127\.0\.0\.1:\d+/acp")


def run(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acp_once", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_write_serve_drive_check_and_wire_into_zed(tmp_path: Path) -> None:
    (tmp_path / "my_agent.py").write_text(MY_AGENT)
    env = {k: v for k, v in os.environ.items() if k != "ACP_ONCE_TOKEN"}
    env |= {"COLUMNS": "200", "ACP_ONCE_TOKEN": "newcomer-token"}
    server = subprocess.Popen(
        [sys.executable, "-m", "acp_once", "serve", "my_agent.py:make_agent", "--port", "0",
         "--store", "sqlite:sessions.db"],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watchdog = threading.Timer(120, server.kill)
    watchdog.start()
    drain: threading.Thread | None = None
    try:
        assert server.stderr is not None
        url = next((m.group(0) for line in server.stderr if (m := URL.search(line))), None)
        assert url is not None, "serve printed no URL"
        # the rest of its log is read as it comes, so a full pipe never blocks the server
        drain = threading.Thread(target=server.stderr.read, daemon=True)
        drain.start()

        drove = run("prompt", "stressed", "--agent", url, cwd=tmp_path, env=env)
        assert drove.returncode == 0, drove.stdout + drove.stderr
        assert "agent desserts" in drove.stdout
        assert "stop reason: end_turn" in drove.stdout

        checked = run("check", url, cwd=tmp_path, env=env)
        assert checked.returncode == 0, checked.stdout
        assert "every MUST requirement holds" in checked.stdout

        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        watchdog.cancel()
        server.kill()
        server.wait()
        if drain is not None:
            drain.join(timeout=10)  # EOF: the server is gone
        assert server.stderr is not None
        server.stderr.close()

    zed = run("zed", "my_agent.py:make_agent", "--store", "sqlite:sessions.db", cwd=tmp_path,
              env=env)  # fmt: skip
    assert zed.returncode == 0, zed.stderr
    entry = json.loads(zed.stdout)["agent_servers"]["make_agent"]
    assert Path(entry["command"]).is_absolute()
    assert entry["args"][-4:] == [
        "agent", f"{tmp_path}/my_agent.py:make_agent", "--store", f"sqlite:{tmp_path}/sessions.db",
    ]  # fmt: skip
