"""`connection_prefix`: the connection ids a cluster node issues begin with its node id and a
dot, which a load balancer routes Streamable HTTP requests by (docs/guide/postgres.md)."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from acp_once.agent.reference import ReferenceAgent
from acp_once.server import AcpServer
from acp_once.server.run import _connection_prefix
from acp_once.storage import open_store
from acp_once.transports.websocket import connect_websocket
from tests.remote.harness import running
from tests.remote.test_http import Raw

pytestmark = pytest.mark.anyio

TIMEOUT = 30.0


async def test_every_connection_id_begins_with_the_prefix_over_http_and_websocket(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, app_options={"connection_prefix": "n7."}) as srv:
            async with httpx.AsyncClient() as http:
                raw = Raw(http, f"{srv.http}/acp")
                assert (await raw.initialize())["result"]["protocolVersion"] == 2
                assert raw.cid.startswith("n7.") and len(raw.cid) == 3 + 32
                # a request carrying it reaches its connection (202), as through a balancer
                response = await raw.post(
                    {"jsonrpc": "2.0", "id": 1, "method": "session/list", "params": {}}
                )
                assert response.status_code == 202, response.text
            async with connect_websocket(srv.url) as frames:
                assert frames.connection_id is not None
                assert frames.connection_id.startswith("n7.")


@pytest.mark.parametrize("prefix", ["n1", "n1.x", "a.b.", "n 1.", "é.", "x" * 65 + "."])
async def test_a_prefix_a_balancer_could_not_match_is_refused(prefix: str, tmp_path: Path) -> None:
    async with open_store("memory:") as store:
        agent = ReferenceAgent(store, side_effects=tmp_path)
        with pytest.raises(ValueError, match="connection_prefix"):
            AcpServer(agent, connection_prefix=prefix)


async def test_only_a_shared_store_gives_connection_ids_a_prefix() -> None:
    async with open_store("memory:") as store:
        assert _connection_prefix(store, "n1") == ""
