"""Defects of the upgrade runtime found outside its tests (issue 31), each pinned by a test
over real pipes: `acp-once agent --runtime v1` over the stdlib v1 agent
`tests/agents/stubborn_v1_agent.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.protocol import schema as s
from acp_once.protocol.errors import AcpError
from acp_once.storage import MemoryStore
from acp_once.testing import connected
from acp_once.upgrade import UpgradedAgent
from tests.helpers import UpdateRecorder, initialize_request
from tests.upgrade.test_containment import AGENT, prompt, runtime

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 30


def idle_count(updates: list[dict[str, Any]]) -> int:
    return sum(
        1
        for u in updates
        if u["sessionUpdate"] == "state_update" and u["state"] == "idle" and "stopReason" in u
    )


async def test_a_child_session_id_given_to_two_sessions_is_refused(tmp_path: Path) -> None:
    """The child answers every `session/new` with one id: the second session is refused, and
    the first one's turn reaches nobody else."""
    with anyio.fail_after(TIMEOUT):
        async with runtime(tmp_path, agent_args=("--session-id", "same")) as (conn, rec, _):
            first = (await conn.agent.new_session(s.NewSessionRequest(cwd="/tmp"))).session_id
            with pytest.raises(AcpError) as refused:
                await conn.agent.new_session(s.NewSessionRequest(cwd="/tmp"))
            assert refused.value.code == -32603
            assert "another session" in refused.value.message
            await prompt(conn, first, "hello", "key-distinct-1")
            await rec.wait_for(lambda updates: idle_count(updates) >= 1)
            listed = await conn.rpc.request("session/list", {})
            assert [x["sessionId"] for x in listed["sessions"]] == [first]
            assert {n["sessionId"] for n in rec.notifications} == {first}


def _stubborn(tmp: Path) -> list[str]:
    return [sys.executable, str(AGENT), "--effects", str(tmp / "effects.log")]


async def test_session_state_is_dropped_when_sessions_are_closed_or_evicted(
    tmp_path: Path,
) -> None:
    """20 sessions with 200 KB of `mcpServers` each: none of it stays once they are closed, or
    once their connection is gone (idle eviction); a resume gives the servers again."""
    servers = [
        {"type": "stdio", "name": f"s{n}", "command": "x" * 20_000, "args": [], "env": []}
        for n in range(10)
    ]
    params = {"cwd": "/tmp", "mcpServers": servers}
    with anyio.fail_after(TIMEOUT):
        async with (
            MemoryStore() as store,
            UpgradedAgent(store, _stubborn(tmp_path)) as agent,
        ):
            rec = UpdateRecorder()
            async with connected(agent, rec) as conn:
                await conn.agent.initialize(initialize_request("state"))
                ids = []
                for _ in range(20):
                    new = await conn.rpc.request("session/new", params)
                    ids.append(new["sessionId"])
                await prompt(conn, ids[0], "hello", "key-state-1")
                await rec.wait_for(lambda updates: idle_count(updates) >= 1)
                assert len(agent._mcp_servers) == 20
                for sid in ids[:10]:
                    await conn.rpc.request("session/close", {"sessionId": sid})
                assert sorted(agent._mcp_servers) == sorted(ids[10:])
                assert not set(agent._translators) & set(ids[:10])
            # the connection is gone: its sessions are evicted, and their state with them
            assert agent._mcp_servers == {}
            assert agent._translators == {}
            assert not agent._attach_locks
            async with connected(agent, rec) as conn:
                await conn.agent.initialize(initialize_request("state"))
                await conn.rpc.request("session/resume", {**params, "sessionId": ids[0]})
                assert agent._mcp_servers[ids[0]] == servers
                await prompt(conn, ids[0], "again", "key-state-2")
                await rec.wait_for(lambda updates: idle_count(updates) >= 2)
    # the same v1 session went on after the eviction
    sessions = [line.split(" ")[1] for line in (tmp_path / "effects.log").read_text().splitlines()]
    assert len(sessions) == 2 and sessions[0] == sessions[1]
