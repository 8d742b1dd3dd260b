"""Every backend passes the whole `SessionStore` contract."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from acp_once.storage import MemoryStore, SessionStore, SqliteStore
from acp_once.storage.contract import (
    CHECKS,
    DURABLE_CHECKS,
    Check,
    StoreFactory,
    run_contract,
    run_durable_contract,
)

if TYPE_CHECKING:
    from collections.abc import Callable


@pytest.mark.anyio
@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
async def test_contract(check: Check, store_factory: StoreFactory) -> None:
    await check(store_factory)


@pytest.mark.anyio
async def test_run_contract_reports_no_failures(store_factory: StoreFactory) -> None:
    assert await run_contract(store_factory) == []


@pytest.mark.anyio
@pytest.mark.parametrize("check", DURABLE_CHECKS, ids=lambda check: check.__name__)
async def test_durable_contract(check: Check, new_storage: Callable[[], StoreFactory]) -> None:
    await check(new_storage())


@pytest.mark.anyio
async def test_run_durable_contract_reports_no_failures(
    new_storage: Callable[[], StoreFactory],
) -> None:
    assert await run_durable_contract(new_storage) == []


class _ForgetfulStore(MemoryStore):
    """Breaks the contract on purpose: it forgets every key."""

    async def find_key(self, session_id: str, key: str) -> None:
        return None


@pytest.mark.anyio
async def test_run_contract_catches_a_broken_store() -> None:
    failures = await run_contract(_ForgetfulStore)
    names = {name for name, _ in failures}
    assert "check_insert_with_key_inserts_once" in names
    assert all(isinstance(exc, AssertionError) for _, exc in failures)


def test_backends_satisfy_the_protocol() -> None:
    assert isinstance(MemoryStore(), SessionStore)
    assert issubclass(SqliteStore, SessionStore)
