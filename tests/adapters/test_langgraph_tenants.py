"""The LangGraph adapter's store keeps a session's tenant in its session directory, and lists
by tenant, as the storage contract's tenant check asks of every store (issue 20, item 7)."""

from __future__ import annotations

import pytest

from acp_once.adapters.langgraph import LangGraphStore
from acp_once.storage.contract import check_tenant_field_and_filter

pytestmark = pytest.mark.anyio


async def test_the_langgraph_store_keeps_and_filters_tenants() -> None:
    await check_tenant_field_and_filter(lambda: LangGraphStore.open("memory:"))
