"""Tenants through a real `acp-once bridge --tokens FILE -- acp-once agent` (issue 20, item 7):
the bridge authenticates each connection to a tenant and keeps the tenants' sessions apart in
front of its one agent process; neither tenant lists, resumes, prompts into, forks, closes
or deletes the other's session."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from acp_once.transports.websocket import WebSocketRejected, connect_websocket
from tests.remote.test_bridge import bridge_process, reference_agent
from tests.remote.test_tenants import (
    ALICE,
    BOB,
    CAROL,
    TIMEOUT,
    check_isolation,
    listed,
    refused,
    tenant,
)

pytestmark = pytest.mark.anyio


async def test_two_tenants_behind_one_bridge_never_meet(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    with anyio.fail_after(TIMEOUT):
        async with bridge_process(reference_agent(tmp_path), "--tokens", str(tokens)) as bridge:
            with pytest.raises(WebSocketRejected) as info:
                async with connect_websocket(bridge.url, token=CAROL):
                    pass
            assert info.value.status == 401
            await check_isolation(bridge.url, bridge.url)
            # a fork belongs to the tenant that made it; the other tenant cannot use it either
            async with tenant(bridge.url, ALICE) as alice, tenant(bridge.url, BOB) as bob:
                alice_had, bob_had = await listed(alice), await listed(bob)
                sid = (await alice.rpc.request("session/new", {"cwd": "/w"}))["sessionId"]
                fork = await alice.rpc.request("session/fork", {"sessionId": sid, "cwd": "/w"})
                forked = fork["sessionId"]
                assert await listed(alice) == alice_had | {sid, forked}
                assert await listed(bob) == bob_had
                await refused(bob, "session/resume", {"sessionId": forked, "cwd": "/w"})
    assert not any(token in line for line in bridge.lines for token in (ALICE, BOB))


async def test_sessions_from_before_a_bridge_restart_belong_to_no_tenant(tmp_path: Path) -> None:
    """The bridge keeps the record in memory: after a restart on the same store, a session
    created before is visible to no tenant (the agent still has it)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{ALICE}\n")
    agent = reference_agent(tmp_path)
    with anyio.fail_after(TIMEOUT):
        async with (
            bridge_process(agent, "--tokens", str(tokens)) as bridge,
            tenant(bridge.url, ALICE) as alice,
        ):
            sid = (await alice.rpc.request("session/new", {"cwd": "/w"}))["sessionId"]
            assert await listed(alice) == {sid}
        async with (
            bridge_process(agent, "--tokens", str(tokens)) as bridge,
            tenant(bridge.url, ALICE) as alice,
        ):
            assert await listed(alice) == set()
            await refused(alice, "session/resume", {"sessionId": sid, "cwd": "/w"})
        async with bridge_process(agent) as bridge, tenant(bridge.url, "") as anyone:
            assert sid in await listed(anyone)  # without tenants the bridge shows everything
