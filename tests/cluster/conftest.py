"""Fixtures of the cluster tests: a fresh PostgreSQL schema per test, nodes in-process.

Under `CI=true` these tests fail (never skip) without `ACP_ONCE_TEST_POSTGRES_DSN`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from tests.sharding import postgres_dsn2, shard_urls

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
        reason = f"{POSTGRES_DSN_VAR} is not set; the cluster tests need PostgreSQL"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true requires the cluster tests: {reason}")
        pytest.skip(reason)
    return dsn


@pytest.fixture
def schema(postgres_dsn: str) -> Iterator[str]:
    """A fresh schema `acp_once_cluster_<uuid>`, dropped at teardown."""
    name = f"acp_once_cluster_{uuid.uuid4().hex}"
    yield name
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
