"""The commands' event loop: uvloop by default, the standard loop on request, same behaviour.

The reference agent is run as a real subprocess on each loop; which loop it runs on is read
from the shared objects its process has mapped, and a keyed prompt and its retry must give
the same answers on both.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest

from acp_once.cli import _eventloop
from acp_once.client import ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.transports.stdio import spawn
from tests.helpers import UpdateRecorder, initialize_request

pytestmark = pytest.mark.anyio

TIMEOUT = 30


def test_loop_name_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACP_ONCE_LOOP", "asyncio")
    assert _eventloop.loop_name() == "asyncio"
    monkeypatch.setenv("ACP_ONCE_LOOP", " AsyncIO ")
    assert _eventloop.loop_name() == "asyncio"
    monkeypatch.delenv("ACP_ONCE_LOOP")
    # uvloop is a dependency everywhere but on Windows
    assert _eventloop.loop_name() == ("asyncio" if sys.platform == "win32" else "uvloop")


def _maps_uvloop(pid: int) -> bool:
    return "uvloop" in Path(f"/proc/{pid}/maps").read_text(encoding="utf-8")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_the_agent_runs_on_the_chosen_loop_and_keeps_a_key(loop: str, tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("ACP_ONCE_LOOP", None)
    if loop == "asyncio":
        env["ACP_ONCE_LOOP"] = "asyncio"
    command = [sys.executable, "-m", "acp_once", "agent", "--store", "memory:"]
    command += ["--side-effects", str(tmp_path / "fx")]
    with anyio.fail_after(TIMEOUT):
        async with (
            spawn(command, env=env) as proc,
            ClientSideConnection(UpdateRecorder(), proc.frames) as conn,
        ):
            await conn.agent.initialize(initialize_request())
            session = await conn.agent.new_session(s.NewSessionRequest(cwd=str(tmp_path)))
            request = s.PromptRequest.model_validate(
                {
                    "sessionId": session.session_id,
                    "prompt": [{"type": "text", "text": "hello"}],
                    "idempotencyKey": "k-1",
                }
            )
            first = await conn.agent.prompt(request)
            again = await conn.agent.prompt(request)
            assert again.message_id == first.message_id
            assert _maps_uvloop(proc.pid) is (loop == "uvloop")
