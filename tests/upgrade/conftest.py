"""The PostgreSQL fixtures of the storage tests (a DSN, fresh schemas dropped at teardown), for
the upgrade runtime's run on a PostgreSQL store."""

from tests.storage.conftest import new_schema, postgres_dsn

__all__ = ["new_schema", "postgres_dsn"]
