"""The PostgreSQL store, for several agent nodes on one database.

`store.py` holds `PostgresStore` (and the fencing token `Fence` of the cluster's writes),
`sql.py` its statements, `migrations.py` its schema and the `acp-once db` backends,
`urls.py` the store URL and how messages name it, and `connection.py` the psycopg calls that
the store and `acp_once.cluster.sql` share.
"""

from acp_once.storage.base import FencingError
from acp_once.storage.postgres.migrations import (
    LATEST_VERSION,
    MIGRATIONS,
    apply_migrations,
    current_version,
    migrate_postgres,
    postgres_status,
)
from acp_once.storage.postgres.store import Fence, PostgresStore, QueueRowGone
from acp_once.storage.postgres.urls import DEFAULT_SCHEMA, describe_postgres, parse_postgres_url

__all__ = [
    "DEFAULT_SCHEMA",
    "LATEST_VERSION",
    "Fence",
    "FencingError",
    "MIGRATIONS",
    "PostgresStore",
    "QueueRowGone",
    "apply_migrations",
    "current_version",
    "describe_postgres",
    "migrate_postgres",
    "parse_postgres_url",
    "postgres_status",
]
