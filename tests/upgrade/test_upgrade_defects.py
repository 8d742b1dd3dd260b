"""Defects of the upgrade runtime found outside its tests (issue 31), each pinned by a test
over real pipes: `acp-once agent --runtime v1` over the stdlib v1 agent
`tests/agents/stubborn_v1_agent.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.protocol import schema as s
from acp_once.protocol.errors import AcpError
from tests.upgrade.test_containment import prompt, runtime

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
