"""Tenants in the runtime (issue 20, item 7): a session belongs to the tenant of the
connection that created it, and every other tenant (and a tenant-less connection) is answered
as if it did not exist. In memory, on the memory and SQLite stores; the same over a real
`acp-once serve` is in tests/server/test_tenants.py."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.agent.reference import ReferenceAgent
from acp_once.client import ClientSideConnection
from acp_once.protocol.errors import AcpError
from acp_once.storage import MemoryStore, TimelineEntry, open_store
from acp_once.testing import connected
from tests.helpers import initialize_request

pytestmark = pytest.mark.anyio

SESSION_NOT_FOUND = -32002


def _prompt(sid: str, key: str, text: str = "hello") -> dict[str, Any]:
    return {"sessionId": sid, "prompt": [{"type": "text", "text": text}], "idempotencyKey": key}


@contextlib.asynccontextmanager
async def _agent(kind: str, tmp_path: Path) -> AsyncIterator[ReferenceAgent]:
    url = "memory:" if kind == "memory" else f"sqlite:{tmp_path / 's.db'}"
    async with open_store(url) as store, ReferenceAgent(store, side_effects=tmp_path) as agent:
        yield agent


@contextlib.asynccontextmanager
async def _as(agent: ReferenceAgent, tenant: str | None) -> AsyncIterator[ClientSideConnection]:
    async with connected(agent, tenant=tenant) as conn:
        await conn.agent.initialize(initialize_request(tenant or "none"))
        yield conn


async def _refused(conn: ClientSideConnection, method: str, params: dict[str, Any]) -> str:
    """The error text of a request that must be answered -32002."""
    with pytest.raises(AcpError) as info:
        await conn.rpc.request(method, params)
    assert info.value.code == SESSION_NOT_FOUND, (method, info.value)
    return str(info.value)


async def _listed(conn: ClientSideConnection) -> set[str]:
    result = await conn.rpc.request("session/list", {})
    return {entry["sessionId"] for entry in result["sessions"]}


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_tenant_never_reaches_another_tenants_session(kind: str, tmp_path: Path) -> None:
    with anyio.fail_after(20):
        async with _agent(kind, tmp_path) as agent:
            async with _as(agent, "alice") as alice, _as(agent, "bob") as bob:
                sid = (await alice.rpc.request("session/new", {"cwd": "/w"}))["sessionId"]
                first = (await alice.rpc.request("session/prompt", _prompt(sid, "k1")))["messageId"]
                bob_sid = (await bob.rpc.request("session/new", {"cwd": "/w"}))["sessionId"]

                assert await _listed(alice) == {sid}
                assert await _listed(bob) == {bob_sid}
                # what bob gets for alice's session is what he gets for one that never was
                missing = "sess_does_not_exist"
                for method, params in [
                    ("session/resume", {"sessionId": sid, "cwd": "/w"}),
                    ("session/prompt", _prompt(sid, "k1")),  # a probe of alice's key
                    ("session/prompt", _prompt(sid, "k2")),
                    ("session/fork", {"sessionId": sid, "cwd": "/w"}),
                ]:
                    text = await _refused(bob, method, params)
                    other = {**params, "sessionId": missing}
                    assert text == (await _refused(bob, method, other)).replace(missing, sid)
                # close and delete answer as for a missing session (both are idempotent), and
                # change nothing
                await bob.rpc.request("session/close", {"sessionId": sid})
                await bob.rpc.request("session/delete", {"sessionId": sid})
                assert await agent.store.get_session(sid) is not None
                again = await alice.rpc.request("session/prompt", _prompt(sid, "k1"))
                assert again["messageId"] == first  # still active on alice's connection
                assert await agent.store.count_user_messages(sid) == 1

            # a new connection of alice's resumes it and forks it; the fork is hers too
            async with _as(agent, "alice") as alice, _as(agent, "bob") as bob:
                await alice.rpc.request("session/resume", {"sessionId": sid, "cwd": "/w"})
                fork = await alice.rpc.request("session/fork", {"sessionId": sid, "cwd": "/w"})
                assert await _listed(alice) == {sid, fork["sessionId"]}
                assert await _listed(bob) == {bob_sid}
                await _refused(bob, "session/resume", {"sessionId": fork["sessionId"], "cwd": "/"})
                # alice may delete hers; bob's stays
                await alice.rpc.request("session/delete", {"sessionId": fork["sessionId"]})
                assert await agent.store.get_session(fork["sessionId"]) is None
                assert await agent.store.get_session(bob_sid) is not None


async def test_tenant_less_connections_see_only_tenant_less_sessions(tmp_path: Path) -> None:
    with anyio.fail_after(20):
        async with (
            _agent("memory", tmp_path) as agent,
            _as(agent, None) as plain,
            _as(agent, "alice") as alice,
        ):
            mine = (await plain.rpc.request("session/new", {"cwd": "/w"}))["sessionId"]
            hers = (await alice.rpc.request("session/new", {"cwd": "/w"}))["sessionId"]
            assert await _listed(plain) == {mine}
            assert await _listed(alice) == {hers}
            await _refused(plain, "session/resume", {"sessionId": hers, "cwd": "/w"})
            await _refused(alice, "session/resume", {"sessionId": mine, "cwd": "/w"})
            record = await agent.store.get_session(hers)
            assert record is not None and record.tenant == "alice"


class _TailCounting(MemoryStore):
    """Counts the reads that loading a session does (its timeline's tail, for recovery)."""

    tails = 0

    async def read_timeline_tail(self, session_id: str, *, limit: int = 1) -> list[TimelineEntry]:
        self.tails += 1
        return await super().read_timeline_tail(session_id, limit=limit)


async def test_another_tenants_resume_is_refused_before_the_session_is_loaded(
    tmp_path: Path,
) -> None:
    """Loading runs the recovery of interrupted turns: a tenant's request must not make the
    agent load (and recover) another tenant's session."""
    with anyio.fail_after(20):
        async with _TailCounting() as store, ReferenceAgent(store, side_effects=tmp_path) as agent:
            async with _as(agent, "alice") as alice:
                sid = (await alice.rpc.request("session/new", {"cwd": "/w"}))["sessionId"]
            assert sid not in agent._sessions  # nothing holds it: it would load on resume
            async with _as(agent, "bob") as bob:
                await _refused(bob, "session/resume", {"sessionId": sid, "cwd": "/w"})
            assert store.tails == 0 and sid not in agent._sessions
            async with _as(agent, "alice") as alice:
                await alice.rpc.request("session/resume", {"sessionId": sid, "cwd": "/w"})
            assert store.tails == 1
