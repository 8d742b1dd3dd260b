"""Tenants on PostgreSQL with two nodes (issue 20, item 7): two `acp-once serve --tokens FILE`
processes on one schema; a tenant on either node cannot see or touch the other tenant's
sessions, wherever they were created."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tests.remote.test_tenants import ALICE, BOB, TenantServer, check_isolation

pytestmark = pytest.mark.anyio


async def test_two_tenants_on_two_postgres_nodes_never_meet(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    separator = "&" if "?" in postgres_dsn else "?"
    store = f"{postgres_dsn}{separator}schema={schema}"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with anyio.fail_after(20):
        async with TenantServer(tmp_path / "a", store, tokens).run() as node_a:
            # the first node creates the schema before the second one opens it
            await check_isolation(node_a.url, node_a.url)
            async with TenantServer(tmp_path / "b", store, tokens).run() as node_b:
                await check_isolation(node_a.url, node_b.url)
                await check_isolation(node_b.url, node_a.url)
