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
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg import sql

from acp_once.storage import MemoryStore, SqliteStore
from acp_once.storage.postgres import PostgresStore
from acp_once.storage.postgres.shards import open_shards
from tests.sharding import postgres_dsn2, shard_urls

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator
    from contextlib import AbstractAsyncContextManager
    from pathlib import Path

    from acp_once.storage import SessionStore
    from acp_once.storage.contract import StoreFactory

POSTGRES_DSN_VAR = "ACP_ONCE_TEST_POSTGRES_DSN"

__all__ = ["postgres_dsn2", "shard_urls"]  # fixtures of tests.sharding, used here


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


STORE_KINDS = [
    "memory",
    "sqlite",
    "sqlite-batched",
    "sqlite-single",
    "sqlite-writer",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("postgres-batched", marks=pytest.mark.postgres),
    pytest.param("postgres-single", marks=pytest.mark.postgres),
    pytest.param("postgres-sharded", marks=pytest.mark.postgres),
]
"""The store configurations every contract check runs on: the durable stores as opened by
default (group commit: a lone write alone, writes that queue together in one transaction),
`-batched` (every write through the path of a batch, even alone: one transaction of several
writes, a pipeline on PostgreSQL) and `-single` (without group commit: a transaction per
write); `postgres-sharded` is a `ShardedStore` over two PostgreSQL servers (two shards)."""


def batch_everything(store: SqliteStore | PostgresStore) -> None:
    """Make `store` write even a lone write as a batch (see `STORE_KINDS`)."""
    if isinstance(store, SqliteStore) and store._writer is not None:
        return  # the writer process writes every write in a batch (a frame)
    assert store._group is not None
    store._group.batch_from = 1


@asynccontextmanager
async def _opened(
    opening: AbstractAsyncContextManager[SqliteStore] | AbstractAsyncContextManager[PostgresStore],
    batched: bool,
) -> AsyncIterator[SessionStore]:
    async with opening as store:
        if batched:
            batch_everything(store)
        yield store


@pytest.fixture(params=STORE_KINDS)
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """Opens a store on fresh, empty storage at each call (a new file or a new schema)."""
    kind: str = request.param
    if kind == "memory":
        return MemoryStore
    if kind == "postgres-sharded":
        new_urls: Callable[[], list[str]] = request.getfixturevalue("shard_urls")
        return lambda: open_shards(new_urls())
    backend, _, variant = kind.partition("-")
    group_commit = variant != "single"
    batched = variant == "batched"
    if backend == "postgres":
        dsn: str = request.getfixturevalue("postgres_dsn")
        new_schema: Callable[[], str] = request.getfixturevalue("new_schema")

        def open_postgres() -> AbstractAsyncContextManager[SessionStore]:
            return _opened(
                PostgresStore.open(dsn, schema=new_schema(), group_commit=group_commit), batched
            )

        return open_postgres
    counter = itertools.count()

    def open_sqlite() -> AbstractAsyncContextManager[SessionStore]:
        path = tmp_path / f"store-{next(counter)}.db"
        return _opened(
            SqliteStore.open(path, group_commit=group_commit, writer_process=variant == "writer"),
            batched,
        )

    return open_sqlite


DURABLE_KINDS = [kind for kind in STORE_KINDS if kind != "memory"]
"""The store configurations of `STORE_KINDS` whose storage outlives a store."""


@pytest.fixture(params=DURABLE_KINDS)
def new_storage(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], StoreFactory]:
    """Hands out shared-storage factories (`acp_once.storage.contract.DURABLE_CHECKS`): each
    on fresh storage (a new file or a new schema), every store it opens on that one."""
    kind: str = request.param
    backend, _, variant = kind.partition("-")
    group_commit = variant != "single"
    batched = variant == "batched"
    counter = itertools.count()
    if backend == "postgres":
        dsn: str = request.getfixturevalue("postgres_dsn")
        new_schema: Callable[[], str] = request.getfixturevalue("new_schema")

        def postgres_storage() -> StoreFactory:
            schema = new_schema()

            def open_postgres() -> AbstractAsyncContextManager[SessionStore]:
                return _opened(
                    PostgresStore.open(dsn, schema=schema, group_commit=group_commit), batched
                )

            return open_postgres

        return postgres_storage

    def sqlite_storage() -> StoreFactory:
        path = tmp_path / f"shared-{next(counter)}.db"

        def open_sqlite() -> AbstractAsyncContextManager[SessionStore]:
            return _opened(
                SqliteStore.open(
                    path, group_commit=group_commit, writer_process=variant == "writer"
                ),
                batched,
            )

        return open_sqlite

    return sqlite_storage
