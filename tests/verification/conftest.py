"""The cluster tests' fixtures (a fresh PostgreSQL schema per test; under CI=true they fail
rather than skip without ACP_ONCE_TEST_POSTGRES_DSN)."""

from tests.cluster.conftest import anyio_backend, postgres_dsn, schema

__all__ = ["anyio_backend", "postgres_dsn", "schema"]
