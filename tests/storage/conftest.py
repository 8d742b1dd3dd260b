"""Fixtures of the storage tests: the anyio backend and a store factory per backend.

PostgreSQL runs when `ACP_ONCE_TEST_POSTGRES_DSN` names a server (`.ci/run` sets it). Without
it the PostgreSQL tests are skipped, except under `CI=true`, where they fail: CI must never
pass by skipping the only multi-node backend. Every PostgreSQL store opens in a fresh schema
`acp_once_test_<uuid>`, dropped at teardown, so parallel runs never meet.
"""

from __future__ import annotations

import itertools
import os
import uuid
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg import sql

from acp_once.storage import MemoryStore, SqliteStore

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from contextlib import AbstractAsyncContextManager
    from pathlib import Path

    from acp_once.storage import SessionStore
    from acp_once.storage.contract import StoreFactory

POSTGRES_DSN_VAR = "ACP_ONCE_TEST_POSTGRES_DSN"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def postgres_dsn() -> str:
    """The test server's DSN; skips without one, and fails instead when CI is "true"."""
    dsn = os.environ.get(POSTGRES_DSN_VAR, "")
    if not dsn:
        reason = (
            f"{POSTGRES_DSN_VAR} is not set; set it to a PostgreSQL URL such as"
            " postgresql://postgres@127.0.0.1:5432/postgres to run the PostgreSQL tests"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true requires the PostgreSQL tests: {reason}")
        pytest.skip(reason)
    return dsn


@pytest.fixture
def new_schema(postgres_dsn: str) -> Iterator[Callable[[], str]]:
    """Hands out fresh schema names (`acp_once_test_<uuid>`); drops them all at teardown."""
    names: list[str] = []

    def new() -> str:
        names.append(f"acp_once_test_{uuid.uuid4().hex}")
        return names[-1]

    yield new
    if names:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            for name in names:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
                )


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """Opens a store on fresh, empty storage at each call (a new file or a new schema)."""
    if request.param == "memory":
        return MemoryStore
    if request.param == "postgres":
        from acp_once.storage.postgres import PostgresStore

        dsn: str = request.getfixturevalue("postgres_dsn")
        new_schema: Callable[[], str] = request.getfixturevalue("new_schema")

        def open_postgres() -> AbstractAsyncContextManager[SessionStore]:
            return PostgresStore.open(dsn, schema=new_schema())

        return open_postgres
    counter = itertools.count()

    def open_sqlite() -> AbstractAsyncContextManager[SessionStore]:
        return SqliteStore.open(tmp_path / f"store-{next(counter)}.db")

    return open_sqlite
