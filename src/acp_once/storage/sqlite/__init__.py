"""The SQLite store (`store.py`), its checkpoint thread (`checkpoint.py`) and its schema and
migrations (`schema.py`, with the `acp-once db` backends)."""

from acp_once.storage.sqlite.schema import LATEST_VERSION, database_status, migrate_database
from acp_once.storage.sqlite.store import BUMP_RESOLUTION, FIND_KEY_SQL, SqliteStore
from acp_once.support.sqlite import Synchronous

__all__ = [
    "BUMP_RESOLUTION",
    "FIND_KEY_SQL",
    "LATEST_VERSION",
    "SqliteStore",
    "Synchronous",
    "database_status",
    "migrate_database",
]
