"""Where sessions, their retained history and their idempotency keys are kept.

One interface at the level of our records, `SessionStore`, and its backends: `MemoryStore`
(the reference, enough for stdio while the process lives) and `SqliteStore` (survives
restarts and is shared by the processes that open the same file); `ShardedStore` spreads
sessions over several stores (PostgreSQL databases, `open_store([url, ...])`). The
backend-agnostic contract every backend must pass is `acp_once.storage.contract`.

    async with open_store("sqlite:sessions.db") as store:
        outcome = await store.insert_user_message(
            session_id, message_id=mid, update=update_json,
            idempotency_key=key, prompt_digest=digest,
        )
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from acp_once.storage.base import (
    UNCHANGED,
    InsertOutcome,
    InvalidCursor,
    KeyRecord,
    SchemaOutOfDate,
    SessionExists,
    SessionMissing,
    SessionRecord,
    SessionStore,
    StorageError,
    TimelineEntry,
    Unchanged,
)
from acp_once.storage.memory import MemoryStore
from acp_once.storage.sharded import ShardedStore
from acp_once.storage.sqlite import SqliteStore, migrate_database
from acp_once.support.busypoll import DEFAULT_LIMIT_S

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

__all__ = [
    "UNCHANGED",
    "InsertOutcome",
    "InvalidCursor",
    "KeyRecord",
    "MemoryStore",
    "SchemaOutOfDate",
    "SessionExists",
    "SessionMissing",
    "SessionRecord",
    "SessionStore",
    "ShardedStore",
    "SqliteStore",
    "StorageError",
    "TimelineEntry",
    "Unchanged",
    "check_store_url",
    "check_store_urls",
    "migrate_database",
    "open_store",
]

_SUPPORTED = "use 'memory:', 'sqlite:PATH' or 'postgresql://...'"


def check_store_url(url: str) -> str:
    """The store URL `url` in the form `open_store` takes, checked without opening anything:
    `memory` (no colon) is read as `memory:`.

    Raises:
        ValueError: an unsupported scheme, `sqlite:` without a path, or anything after
            `memory:`; the message says which forms are supported.
    """
    if url == "memory":
        return "memory:"
    scheme, sep, rest = url.partition(":")
    if not sep:
        raise ValueError(f"store URL {url!r} has no scheme; {_SUPPORTED}")
    if scheme == "memory" and rest:
        raise ValueError("the 'memory:' store URL takes nothing after the colon")
    if scheme == "sqlite" and not rest:
        raise ValueError("the 'sqlite:' store URL needs a path, as in 'sqlite:sessions.db'")
    if scheme not in ("memory", "sqlite", "postgresql", "postgres"):
        raise ValueError(f"unsupported store URL scheme {scheme!r}; {_SUPPORTED}")
    return url


@asynccontextmanager
async def open_store(
    url: str | Sequence[str],
    *,
    migrate: bool = True,
    sqlite_writer: bool = False,
    sqlite_busy_poll_s: float = DEFAULT_LIMIT_S,
) -> AsyncIterator[SessionStore]:
    """Open the store named by `url` for the duration of the `async with` block.

    Several URLs (a list of two or more `postgresql://` URLs) open one store sharded over
    those databases, in that order (`acp_once.storage.postgres.shards`); one URL in a list is
    that URL.

    * `memory:` (or `memory`) a new, empty `MemoryStore`;
    * `sqlite:PATH` a `SqliteStore` on the file PATH (relative to the working directory,
      created if missing; `sqlite::memory:` is a private in-memory database); with
      `sqlite_writer` its user messages and retained updates are written by a process of the
      store's own (`acp_once.storage.sqlite.writer`: for a server with many busy sessions),
      and `sqlite_busy_poll_s` is how long the event loop polls for its answers after each
      batch instead of sleeping (`SqliteStore.open`'s `busy_poll_s`);
    * `postgresql://...` or `postgres://...` a `PostgresStore` (libpq URL; the acp-once
      parameter `?schema=NAME` picks the schema, `acp_once` by default).

    Raises:
        ValueError: an unsupported scheme or a missing path, or a negative
            `sqlite_busy_poll_s`.
        SchemaOutOfDate: `migrate=False` and the schema is out of date.
        StorageError: the database cannot be opened.
        ModuleNotFoundError: a PostgreSQL URL without the `postgres` extra installed.
    """
    if not isinstance(url, str):
        urls = check_store_urls(url)
        if len(urls) == 1:
            url = urls[0]
        else:
            _postgres_extra()
            from acp_once.storage.postgres.shards import open_shards

            async with open_shards(urls, migrate=migrate) as sharded:
                yield sharded
            return
    scheme, _, rest = check_store_url(url).partition(":")
    if scheme == "memory":
        async with MemoryStore() as memory:
            yield memory
    elif scheme == "sqlite":
        async with SqliteStore.open(
            rest, migrate=migrate, writer_process=sqlite_writer, busy_poll_s=sqlite_busy_poll_s
        ) as sqlite:
            yield sqlite
    else:  # postgresql:// or postgres://, as check_store_url says
        _postgres_extra()
        from acp_once.storage.postgres import PostgresStore, parse_postgres_url

        dsn, schema = parse_postgres_url(url)
        async with PostgresStore.open(dsn, migrate=migrate, schema=schema) as postgres:
            yield postgres


def check_store_urls(urls: Sequence[str]) -> list[str]:
    """Several store URLs (`--store` repeated) checked as `check_store_url` checks one: one
    URL of any kind, or two or more `postgresql://` URLs (the shards of one store, in order).

    Raises:
        ValueError: no URL, a bad URL, or several URLs that are not all PostgreSQL.
    """
    checked = [check_store_url(url) for url in urls]
    if not checked:
        raise ValueError(f"no store URL; {_SUPPORTED}")
    if len(checked) > 1 and not all(
        url.startswith(("postgresql:", "postgres:")) for url in checked
    ):
        raise ValueError(
            "several store URLs shard one store over PostgreSQL databases:"
            " each must be a postgresql:// URL"
        )
    return checked


def _postgres_extra() -> None:
    try:
        import acp_once.storage.postgres  # noqa: F401
    except ModuleNotFoundError as exc:  # psycopg is an extra, not a base dependency
        raise ModuleNotFoundError(
            f"a PostgreSQL store needs the postgres extra ({exc.name} is missing): "
            "pip install 'acp-once[postgres]'",
            name=exc.name,
        ) from exc
