"""`acp-once prompt`: prints the turn, and a killed command rerun with its outbox finishes the
same submission without inserting it twice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from acp_once.client.outbox import open_outbox
from acp_once.storage import open_store

pytestmark = pytest.mark.slow


def agent_command(tmp: Path, *extra: str) -> str:
    return (
        f"{sys.executable} -m acp_once agent --store sqlite:{tmp / 'agent.db'}"
        f" --side-effects {tmp / 'fx'} " + " ".join(extra)
    )


def test_prompt_prints_the_turn(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "acp_once", "prompt", "--agent", agent_command(tmp_path)]
    done = subprocess.run(
        [*command, "hi [tool]"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "inserted as msg_user_" in out
    assert "hi [tool]" in out  # user text is shown as typed, not as markup
    assert "completed" in out and "end_turn" in out


def test_killed_prompt_rerun_with_outbox_inserts_once(tmp_path: Path) -> None:
    outbox = tmp_path / "outbox.db"
    once = tmp_path / "launched"
    # First launch: the agent commits the message and dies before answering. Every later
    # launch fails at once, so the command is stuck reconnecting when we kill it.
    flaky_agent = f"sh -c 'test -e {once} && exit 1; touch {once}; exec {agent_command(tmp_path)}'"
    env = {**os.environ, "ACP_ONCE_CRASH": "after-insert"}
    args = ["--outbox", str(outbox), "--wait", "0", "deploy [tool]"]
    first = [sys.executable, "-m", "acp_once", "prompt", "--agent", flaky_agent, *args]
    with subprocess.Popen(
        first, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:  # blocks until the client reports the lost agent
            if b"connection to the agent failed" in line:
                break
        else:
            raise AssertionError("the command ended without losing its agent")
        proc.kill()
        proc.wait()

    async def pending() -> int:
        async with open_outbox(f"sqlite:{outbox}") as box:
            return len(await box.pending())

    assert anyio.run(pending) == 1  # the submission and its key survived the kill
    again = [sys.executable, "-m", "acp_once", "prompt", "--agent", agent_command(tmp_path), *args]
    rerun = subprocess.run(again, capture_output=True, text=True, timeout=60, check=False)
    assert rerun.returncode == 0, rerun.stderr
    assert "finished a pending submission" in rerun.stdout
    assert anyio.run(pending) == 0

    async def count() -> int:
        async with open_store(f"sqlite:{tmp_path / 'agent.db'}") as store:
            sessions, _ = await store.list_sessions()
            assert len(sessions) == 1
            return await store.count_user_messages(sessions[0].session_id)

    assert anyio.run(count) == 1
