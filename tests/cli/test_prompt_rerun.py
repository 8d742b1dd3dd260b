"""`acp-once prompt` ends every submission: a rerun after the agent lost the answer and died
(and the command was killed) prints the interrupted outcome and exits 3 at once, over stdio,
WebSocket and Streamable HTTP; a blind rerun with --session and --key inserts once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from acp_once.storage import open_store
from tests.remote.harness import ServeProcess

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

PROMPT = [sys.executable, "-m", "acp_once", "prompt"]
TEXT = "X [work:3]"
WAIT = "120"  # far longer than a rerun may take: the rerun must not wait for it


def agent_command(tmp: Path) -> str:
    return (
        f"{sys.executable} -m acp_once agent --store sqlite:{tmp / 'agent.db'}"
        f" --side-effects {tmp / 'fx'}"
    )


async def run_killed(
    agent: str, outbox: Path, env: dict[str, str], died: ServeProcess | None = None
) -> None:
    """Run the command until its agent is lost (it says so; or the server `died`), then
    SIGKILL it."""
    args = [*PROMPT, "--agent", agent, "--outbox", str(outbox), "--wait", WAIT, TEXT]
    async with await anyio.open_process(args, env={**os.environ, **env}) as proc:
        assert proc.stderr is not None
        if died is not None:
            assert died.process is not None
            await died.process.wait()  # it killed itself right after the insert
        else:
            seen = b""
            async for chunk in proc.stderr:
                seen += chunk
                if b"connection to the agent failed" in seen:
                    break
            else:
                raise AssertionError("the command ended without losing its agent")
        proc.kill()
        await proc.wait()


async def rerun(agent: str, outbox: Path) -> tuple[int, str, float]:
    started = time.monotonic()
    done = await anyio.run_process(
        [*PROMPT, "--agent", agent, "--outbox", str(outbox), "--wait", WAIT, TEXT], check=False
    )
    took = time.monotonic() - started
    out = done.stdout.decode()
    assert "Traceback" not in out + done.stderr.decode()
    print(f"rerun of {agent.split()[0][:40]}: {took:.2f} s")  # the figure for the report
    return done.returncode, out, took


def check_interrupted(status: int, out: str) -> str:
    assert status == 3, out
    assert "finished a pending submission: msg_user_" in out
    assert "stop reason: error" in out
    assert "its turn was interrupted: The agent restarted before the turn finished" in out
    found = re.search(r"session (sess_\w+)", out)
    assert found is not None
    return found.group(1)


async def count(db: Path, session_id: str) -> int:
    async with open_store(f"sqlite:{db}") as store:
        return await store.count_user_messages(session_id)


async def test_rerun_after_a_lost_answer_and_a_dead_agent_over_stdio(tmp_path: Path) -> None:
    outbox = tmp_path / "ob.db"
    launched = tmp_path / "launched"
    # the first launch inserts and dies before answering; later launches fail at once, so
    # the command is stuck reconnecting when it is killed
    flaky = (
        f"sh -c 'test -e {launched} && exit 1; touch {launched}; exec {agent_command(tmp_path)}'"
    )
    with anyio.fail_after(90):
        await run_killed(flaky, outbox, {"ACP_ONCE_CRASH": "after-insert"})
        status, out, _ = await rerun(agent_command(tmp_path), outbox)
    session_id = check_interrupted(status, out)
    assert await count(tmp_path / "agent.db", session_id) == 1


@pytest.mark.parametrize("scheme", ["ws", "http"])
async def test_rerun_after_a_lost_answer_and_a_dead_server(
    tmp_path: Path, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    outbox = tmp_path / "ob.db"
    with anyio.fail_after(90):
        monkeypatch.setenv("ACP_ONCE_CRASH", "after-insert")  # the first server only
        async with ServeProcess(tmp_path) as server:
            monkeypatch.delenv("ACP_ONCE_CRASH")
            url = f"{scheme}://127.0.0.1:{server.port}/acp"
            await run_killed(url, outbox, {}, died=server)
            await server.restart()  # the same store and port, without the crash
            status, out, _ = await rerun(url, outbox)
            session_id = check_interrupted(status, out)
            assert await server.count(session_id) == 1


async def test_a_blind_rerun_with_session_and_key_inserts_once(tmp_path: Path) -> None:
    agent = agent_command(tmp_path)
    key = "5b0c9a52-3f4e-4d0a-9c1b-7e2f6a8d9e10"
    with anyio.fail_after(90):
        first = await anyio.run_process([*PROMPT, "--agent", agent, "hello"], check=False)
        found = re.search(r"session (sess_\w+)", first.stdout.decode())
        assert first.returncode == 0 and found is not None
        session_id = found.group(1)
        named = [*PROMPT, "--agent", agent, "--session", session_id, "deploy [tool]"]
        once = await anyio.run_process([*named, "--key", key], check=False)
        again = await anyio.run_process(named, check=False, env={**os.environ, "ACP_ONCE_KEY": key})
    out1, out2 = once.stdout.decode(), again.stdout.decode()
    assert once.returncode == 0 and again.returncode == 0, out1 + out2
    message_id = re.search(r"inserted as (msg_user_\w+)", out1)
    assert message_id is not None
    assert f"inserted earlier as {message_id.group(1)} (the same key)" in out2
    assert "agent deploy [tool]" in out2  # the turn's answer, from the history
    # the turn's end is in the replayed history, tagged with its message id (A10)
    assert out2.rstrip().endswith("stop reason: end_turn")
    assert await count(tmp_path / "agent.db", session_id) == 2  # "hello" and "deploy" once
    assert len((tmp_path / "fx" / f"{session_id}.log").read_text().splitlines()) == 1


def test_a_key_without_a_session_is_a_usage_error() -> None:
    done = subprocess.run(
        [*PROMPT, "--agent", "true", "--key", "5b0c9a52-3f4e-4d0a-9c1b-7e2f6a8d9e10", "x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--session" in done.stderr


async def test_no_end_within_wait_is_status_4_and_a_key_too_long_is_status_2(
    tmp_path: Path,
) -> None:
    agent = agent_command(tmp_path)
    with anyio.fail_after(90):
        slow = await anyio.run_process(
            [*PROMPT, "--agent", agent, "--wait", "0.5", "slow [work:5]"], check=False
        )
        bad = await anyio.run_process(
            [*PROMPT, "--agent", agent, "--session", "sess_x", "--key", "k" * 300, "x"],
            check=False,
        )
    assert slow.returncode == 4, slow.stdout.decode()
    assert "the turn did not end within 0.5 s" in slow.stdout.decode()
    assert bad.returncode == 2, bad.stdout.decode()
    assert bad.stdout.decode().startswith("bad --key:")
    assert "k" * 300 not in bad.stdout.decode()  # a key never appears in a message


async def test_a_run_whose_agent_restarts_ends_with_the_interrupted_turn(tmp_path: Path) -> None:
    """Not killed: the command starts the agent again itself, resends, and ends at once with
    the interrupted outcome (status 3), the prompt stored once."""
    crash = {"ACP_ONCE_CRASH": "after-insert", "ACP_ONCE_CRASH_MARKER": str(tmp_path / "once")}
    with anyio.fail_after(90):
        done = await anyio.run_process(
            [*PROMPT, "--agent", agent_command(tmp_path), "--wait", WAIT, TEXT],
            check=False,
            env={**os.environ, **crash},
        )
    out = done.stdout.decode()
    assert done.returncode == 3, out
    assert "(answered after a reconnect)" in out
    assert "its turn was interrupted: The agent restarted before the turn finished" in out
    found = re.search(r"session (sess_\w+)", out)
    assert found is not None
    assert await count(tmp_path / "agent.db", found.group(1)) == 1
