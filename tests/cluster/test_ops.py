"""`GET /ops/status`: token-protected, per node: sessions owned, prompts held, dedup hits."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from acp_once.server import create_app
from acp_once.testing import connected
from tests.cluster.harness import initialize, new_session, node, prompt, resume

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


async def test_ops_status_lists_the_nodes_and_needs_the_token(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    with anyio.fail_after(30):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx") as a,
            node(postgres_dsn, schema, "b", tmp_path / "fx") as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            first = await prompt(conn_a, sid, "[work:5] long", "k1")
            assert await prompt(conn_b, sid, "[work:5] long", "k1") == first  # a dedup hit on B
            await b.coordinator.pg.heartbeat(b.coordinator.stats())
            await a.coordinator.pg.heartbeat(a.coordinator.stats())
            app = create_app(a.agent, token="secret-token")
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                refused = await http.get("/ops/status")
                assert refused.status_code == 401
                wrong = await http.get("/ops/status", headers={"Authorization": "Bearer nope"})
                assert wrong.status_code == 401
                answer = await http.get(
                    "/ops/status", headers={"Authorization": "Bearer secret-token"}
                )
                assert (await http.get("/healthz")).status_code == 200  # stays open
            assert answer.status_code == 200
            body = answer.json()
            assert body["node"] == "a"
            nodes = {n["node"]: n for n in body["nodes"]}
            assert set(nodes) == {"a", "b"}
            assert nodes["a"]["alive"] and nodes["b"]["alive"]
            assert nodes["a"]["sessions_owned"] == 1  # A runs the long turn
            assert nodes["b"]["sessions_owned"] == 0
            assert nodes["b"]["dedup_hits"] >= 1
            assert "k1" not in answer.text
