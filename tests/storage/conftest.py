"""Fixtures of the storage tests: the anyio backend and a store factory per backend."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import pytest

from acp_once.storage import MemoryStore, SqliteStore

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager
    from pathlib import Path

    from acp_once.storage import SessionStore
    from acp_once.storage.contract import StoreFactory


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["memory", "sqlite"])
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """Opens a store on fresh, empty storage at each call (a new file for SQLite)."""
    if request.param == "memory":
        return MemoryStore
    counter = itertools.count()

    def open_sqlite() -> AbstractAsyncContextManager[SessionStore]:
        return SqliteStore.open(tmp_path / f"store-{next(counter)}.db")

    return open_sqlite
