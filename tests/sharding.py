"""The second PostgreSQL server of the sharded-store tests, and helpers around two servers.

`.ci/run` starts a second cluster (127.0.0.1:5433) and names it in
`ACP_ONCE_TEST_POSTGRES_DSN2`. Without it the sharded tests skip, except under `CI=true`, where
they fail: CI must never pass by skipping them.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest
from psycopg import sql

POSTGRES_DSN_VAR = "ACP_ONCE_TEST_POSTGRES_DSN"
POSTGRES_DSN2_VAR = "ACP_ONCE_TEST_POSTGRES_DSN2"


def require_dsn(var: str) -> str:
    """The DSN in `var`; skips without it, and fails instead when CI is "true"."""
    dsn = os.environ.get(var, "")
    if not dsn:
        reason = (
            f"{var} is not set; the sharded-store tests need two PostgreSQL servers"
            " (.ci/run starts the second on 127.0.0.1:5433)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true requires the sharded-store tests: {reason}")
        pytest.skip(reason)
    return dsn


def schema_url(dsn: str, schema: str) -> str:
    """The store URL of `schema` on the server `dsn`."""
    return f"{dsn}{'&' if '?' in dsn else '?'}schema={schema}"


@contextmanager
def fresh_schemas(*dsns: str) -> Iterator[Callable[[str], str]]:
    """Hands out fresh schema names on the given servers (`new(dsn)` answers the store URL),
    and drops every one of them at the end."""
    made: list[tuple[str, str]] = []

    def new(dsn: str) -> str:
        name = f"acp_once_shard_{uuid.uuid4().hex}"
        made.append((dsn, name))
        return schema_url(dsn, name)

    try:
        yield new
    finally:
        for dsn in dsns:
            names = [name for where, name in made if where == dsn]
            if not names:
                continue
            with psycopg.connect(dsn, autocommit=True) as conn:
                for name in names:
                    conn.execute(
                        sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
                    )


@pytest.fixture
def postgres_dsn2() -> str:
    """The second server's DSN (`ACP_ONCE_TEST_POSTGRES_DSN2`)."""
    return require_dsn(POSTGRES_DSN2_VAR)


@pytest.fixture
def shard_urls(postgres_dsn: str, postgres_dsn2: str) -> Iterator[Callable[[], list[str]]]:
    """Each call: the URLs of a new two-shard set, one fresh schema on each server."""
    with fresh_schemas(postgres_dsn, postgres_dsn2) as new:
        yield lambda: [new(postgres_dsn), new(postgres_dsn2)]
