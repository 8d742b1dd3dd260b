"""The upgrade runtime contains its child: `acp-once agent --runtime v1 -- CMD` over a v1 agent
that ignores the end of its stdin and SIGTERM (`tests/agents/stubborn_v1_agent.py`), which
also starts a `sleep` of its own. Whether the runtime stops, is SIGKILLed mid-turn, or dies
without its child noticing, no process of the child's group outlives it, and a restarted
runtime never runs a second child beside the first.
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.client import ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.transports.stdio import AgentProcess, spawn
from acp_once.upgrade.containment import GROUP_TOKEN_VARIABLE, GroupFile, group_members
from tests.helpers import UpdateRecorder, initialize_request

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 30
GONE_WITHIN = 5.0  # seconds: the acceptance bound for the old group
AGENT = Path(__file__).parents[1] / "agents" / "stubborn_v1_agent.py"


def runtime_command(tmp: Path, agent_args: tuple[str, ...] = ("--grandchild",)) -> list[str]:
    return [
        sys.executable,
        "-m",
        "acp_once",
        "agent",
        "--runtime",
        "v1",
        "--store",
        f"sqlite:{tmp / 'sessions.sqlite3'}",
        "--",
        sys.executable,
        str(AGENT),
        "--effects",
        str(tmp / "effects.log"),
        *agent_args,
    ]


@asynccontextmanager
async def runtime(
    tmp: Path, *, shutdown_timeout: float = 5.0, agent_args: tuple[str, ...] = ("--grandchild",)
) -> AsyncIterator[tuple[ClientSideConnection, UpdateRecorder, AgentProcess]]:
    recorder = UpdateRecorder()
    with open(tmp / "runtime.stderr", "ab") as errfile:  # noqa: ASYNC230 (a log file for the child)
        async with (
            spawn(
                runtime_command(tmp, agent_args),
                stderr=errfile.fileno(),
                shutdown_timeout=shutdown_timeout,
            ) as proc,
            ClientSideConnection(recorder, proc.frames) as conn,
        ):
            await conn.agent.initialize(initialize_request("containment-tests"))
            yield conn, recorder, proc


def effects(tmp: Path) -> list[list[str]]:
    path = tmp / "effects.log"
    return [line.split(" ", 2) for line in path.read_text().splitlines()] if path.exists() else []


async def prompt(conn: ClientSideConnection, session_id: str, text: str, key: str) -> None:
    params: dict[str, Any] = {
        "sessionId": session_id,
        "prompt": [{"type": "text", "text": text}],
        "idempotencyKey": key,
    }
    await conn.rpc.request("session/prompt", params)


async def working(rec: UpdateRecorder, count: int = 1) -> None:
    """Wait until the child has sent `count` `working` chunks (it is in the turn)."""

    def seen(updates: list[dict[str, Any]]) -> bool:
        chunks = [
            u
            for u in updates
            if u["sessionUpdate"] == "agent_message_chunk" and u["content"].get("text") == "working"
        ]
        return len(chunks) >= count

    await rec.wait_for(seen)


async def gone(pgid: int) -> None:
    """Wait (the caller bounds it) until no live process is left in the group `pgid`."""
    while group_members(pgid):  # noqa: ASYNC110 (the process table: nothing to wait on)
        await anyio.sleep(0.02)


async def test_sigkill_of_the_runtime_mid_turn_leaves_no_process_of_the_child_group(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with runtime(tmp_path) as (conn, rec, proc):
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/tmp"))).session_id
            await prompt(conn, sid, "first [hang]", "key-containment-1")
            await working(rec)
            ((pid, child_session, _),) = effects(tmp_path)
            pgid = os.getpgid(int(pid))
            assert pgid != os.getpgid(proc.pid)  # a group of its own
            assert len(group_members(pgid)) >= 3  # launcher, agent, its sleep
            proc.process.kill()
            await proc.process.wait()
            with anyio.fail_after(GONE_WITHIN):
                await gone(pgid)
        # the restarted runtime runs the next prompt in one new child, the old one gone
        async with runtime(tmp_path) as (conn, rec, _):
            await conn.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/tmp"))
            await prompt(conn, sid, "second", "key-containment-2")
            await working(rec)
            lines = effects(tmp_path)
            assert [line[1] for line in lines] == [child_session, child_session]  # loaded
            assert lines[0][0] != lines[1][0]
            assert group_members(pgid) == []


async def test_a_stopping_runtime_stops_a_child_that_ignores_eof_and_sigterm(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(TIMEOUT):
        # time to cancel the turn (the child never answers) and stop the child, step by step
        async with runtime(tmp_path, shutdown_timeout=TIMEOUT) as (conn, rec, proc):
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/tmp"))).session_id
            await prompt(conn, sid, "work [hang]", "key-containment-3")
            await working(rec)
            ((pid, _, _),) = effects(tmp_path)
            pgid = os.getpgid(int(pid))
        # leaving the block closed the runtime's stdin; it stopped its child before exiting
        # (not killed by the spawn's SIGTERM, which its launcher would have noticed)
        assert proc.returncode == 0
        assert group_members(pgid) == []


def test_a_group_file_left_by_a_dead_runtime_gets_its_group_killed(tmp_path: Path) -> None:
    """The fallback where the kernel cannot signal a parent's death: the next runtime on the
    store kills the recorded group, and only a group that carries the recorded token."""
    token = secrets.token_hex(8)
    env = dict(os.environ, **{GROUP_TOKEN_VARIABLE: token})
    # a group that ignores SIGTERM: a shell and its sleep, which says when both are there
    stubborn = subprocess.Popen(
        ["sh", "-c", "trap '' TERM; sleep 1000 & echo started; wait"],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
    )
    other = subprocess.Popen(["sleep", "1000"], start_new_session=True)  # no token
    try:
        # Popen returns once the shell's exec is past its point of no return, before the kernel
        # has laid out its environment: till then /proc shows none, so no token. What a dead
        # runtime left behind has long been running.
        assert stubborn.stdout is not None
        assert select.select([stubborn.stdout], [], [], TIMEOUT)[0], "the group did not start"
        assert stubborn.stdout.readline() == b"started\n"
        first = GroupFile(tmp_path / "store.group")
        assert first.acquire()
        first.record(stubborn.pid, token)
        assert not GroupFile(tmp_path / "store.group").acquire()  # held: a live runtime's
        first.release()  # the runtime died: its lock went with it, the record stays
        second = GroupFile(tmp_path / "store.group")
        assert second.acquire()
        assert group_members(stubborn.pid) == []
        assert stubborn.wait(timeout=TIMEOUT) == -signal.SIGKILL
        second.record(other.pid, token)  # a pgid reused by a process without the token
        second.release()
        assert GroupFile(tmp_path / "store.group").acquire()
        assert other.poll() is None  # left alone
    finally:
        for process in (stubborn, other):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=TIMEOUT)
        if stubborn.stdout is not None:
            stubborn.stdout.close()


def test_no_group_file_is_kept_in_a_directory_others_may_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert not GroupFile(shared / "store.group").acquire()
    assert not (shared / "store.group").exists()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "store.group").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):  # a planted link is never followed
        GroupFile(private / "store.group").acquire()
    assert not (tmp_path / "elsewhere").exists()
