"""The PostgreSQL store, for several agent nodes on one database.

`store.py` holds `PostgresStore`, `sql.py` its statements, `guard.py` its guarded writes (a
`WriteGuard` contributes the SQL a write is stored under, such as the cluster's lease fence),
`migrations.py` its schema and the `acp-once db` backends, `urls.py` the store URL and how
messages name it, and `connection.py` the psycopg calls that the store and the statements of
other modules run on its pool (`PostgresStore.run`) share.
"""

from acp_once.storage.base import FencingError
from acp_once.storage.postgres.guard import GuardSql, WriteGuard
from acp_once.storage.postgres.migrations import (
    LATEST_VERSION,
    MIGRATIONS,
    apply_migrations,
    current_version,
    migrate_postgres,
    postgres_status,
)
from acp_once.storage.postgres.store import PostgresStore
from acp_once.storage.postgres.urls import DEFAULT_SCHEMA, describe_postgres, parse_postgres_url

__all__ = [
    "DEFAULT_SCHEMA",
    "LATEST_VERSION",
    "FencingError",
    "GuardSql",
    "MIGRATIONS",
    "PostgresStore",
    "WriteGuard",
    "apply_migrations",
    "current_version",
    "describe_postgres",
    "migrate_postgres",
    "parse_postgres_url",
    "postgres_status",
]
