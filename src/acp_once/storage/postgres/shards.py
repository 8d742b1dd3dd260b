"""Sessions sharded over several PostgreSQL databases: opening the set, and keeping it fixed.

`open_shards(urls)` opens one `PostgresStore` per URL (each in its own schema, `?schema=` as for
one store) and a `ShardedStore` over them, which places a session by a hash of its id modulo
the number of shards (`acp_once.storage.sharded.shard_of`). That placement must never change
while a session exists, so the set is recorded in every shard (the table `shard_set`, migration
4): each database has an id of its own (`shard_id`, made once), and `members` lists the ids of
its set in order. Opening a set whose shards say otherwise is refused before anything is
served: another number of DSNs, another order, a database of another set, the same database
twice, or a database that holds sessions without being in a set (a one-database store made a
shard: its sessions would hash elsewhere). A recorded shard opened alone as one store is
refused too (`prepare_schema`). Nothing moves sessions between shards: resharding is not
supported.

Recording is safe when several nodes open the same set at once: each shard's id is inserted
once (`ON CONFLICT DO NOTHING`, then read back), and `members` is written under the row's lock
only while still NULL, so the nodes compute and write the same list; two different lists
started at once leave at least one shard refusing one of them.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from acp_once.storage.base import StorageError
from acp_once.storage.postgres.connection import Conn, compose, execute, fetch_one
from acp_once.storage.postgres.migrations import migrate_postgres, postgres_status
from acp_once.storage.postgres.store import PostgresStore
from acp_once.storage.postgres.urls import describe_postgres, parse_postgres_url
from acp_once.storage.sharded import ShardedStore
from acp_once.support.opening import Opening

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

__all__ = ["ShardStatus", "join_shard_set", "migrate_shards", "open_shards", "shards_status"]

_OWN_ID: Final = (
    "INSERT INTO {s}.shard_set (shard_id) VALUES (%s) ON CONFLICT (only_row) DO NOTHING"
)
_READ: Final = "SELECT shard_id, members FROM {s}.shard_set"
_LOCK: Final = "SELECT members FROM {s}.shard_set FOR UPDATE"
_HAS_SESSIONS: Final = "SELECT EXISTS (SELECT 1 FROM {s}.sessions)"
_RECORD: Final = "UPDATE {s}.shard_set SET members = %s, recorded_at = now()"


def _parsed(urls: Sequence[str]) -> list[tuple[str, str]]:
    if len(urls) < 2:
        raise ValueError("a sharded store takes two or more postgresql:// URLs")
    return [parse_postgres_url(url) for url in urls]


async def join_shard_set(stores: Sequence[PostgresStore]) -> None:
    """Record `stores` as one shard set in this order, or check that they are one already.

    Raises:
        StorageError: a shard belongs to another set, or to this set at another position, or
            one database is given twice, or a shard not in a set holds sessions; the message
            says which shard (never with a password) and what it was recorded as.
    """
    ids = [await store.run(_own_id(store.schema), begin=True) for store in stores]
    for index, store in enumerate(stores):
        if ids.index(ids[index]) != index:
            raise StorageError(
                f"{store.where}: shard {index + 1} of {len(stores)} is the same database as"
                f" shard {ids.index(ids[index]) + 1}; give each shard once"
            )
    for index, store in enumerate(stores):
        await store.run(_record(store.schema, store.where, ids, index), begin=True)


def _own_id(schema: str) -> Callable[[Conn], Awaitable[str]]:
    async def work(conn: Conn) -> str:
        await execute(conn, compose(_OWN_ID, schema), (uuid.uuid4().hex,))
        row = await fetch_one(conn, compose(_READ, schema))
        assert row is not None
        return str(row[0])

    return work


def _record(
    schema: str, where: str, ids: list[str], index: int
) -> Callable[[Conn], Awaitable[None]]:
    async def work(conn: Conn) -> None:
        row = await fetch_one(conn, compose(_LOCK, schema))
        assert row is not None
        members: list[str] | None = row[0]
        count = len(ids)
        if members is None:
            has = await fetch_one(conn, compose(_HAS_SESSIONS, schema))
            if has is not None and has[0]:
                raise StorageError(
                    f"{where}: holds sessions stored without sharding; it cannot become shard"
                    f" {index + 1} of {count} (their placement would change: resharding is"
                    " not supported)"
                )
            await execute(conn, compose(_RECORD, schema), (ids,))
            return
        if list(members) == ids:
            return
        own = ids[index]
        recorded = (
            f"shard {members.index(own) + 1} of {len(members)}" if own in members else "no shard"
        )
        raise StorageError(
            f"{where}: recorded as {recorded} of its set, now given as shard {index + 1} of"
            f" {count}; a session's shard is fixed by the set's size and order: give the same"
            " DSNs in the same order (resharding is not supported)"
        )

    return work


def open_shards(
    urls: Sequence[str],
    *,
    migrate: bool = True,
    group_commit: bool = True,
    min_size: int = 1,
    max_size: int = 10,
) -> Opening[ShardedStore]:
    """Open a `ShardedStore` over one `PostgresStore` per `postgresql://` URL (in this order:
    the order places sessions); await it or `async with` it. Closing it closes every shard.
    `migrate`, `group_commit`, `min_size` and `max_size` are those of `PostgresStore.open`,
    for every shard (a pool per shard).

    Raises:
        ValueError: fewer than two URLs, or one that is not a PostgreSQL store URL.
        SchemaOutOfDate: `migrate=False` and a shard's schema is out of date.
        StorageError: a shard cannot be opened, or the shards are not this set
            (`join_shard_set`).
    """
    parsed = _parsed(urls)

    async def open_() -> ShardedStore:
        async with contextlib.AsyncExitStack() as stack:
            shards = [
                await stack.enter_async_context(
                    PostgresStore.open(
                        dsn,
                        schema=schema,
                        migrate=migrate,
                        group_commit=group_commit,
                        min_size=min_size,
                        max_size=max_size,
                        shard=True,
                    )
                )
                for dsn, schema in parsed
            ]
            await join_shard_set(shards)
            closing = stack.pop_all()
            return ShardedStore(shards, on_close=closing.aclose)
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(store: ShardedStore) -> None:
        await store.aclose()

    return Opening(open_, close)


@dataclass(frozen=True, slots=True)
class ShardStatus:
    """One shard as `acp-once db migrate` and `db status` report it."""

    where: str
    before: int
    after: int


async def migrate_shards(urls: Sequence[str]) -> list[ShardStatus]:
    """`acp-once db migrate` of a shard set: every shard's schema brought up to date, then the
    set recorded (`join_shard_set`); (version before, after) per shard.

    Raises:
        ValueError: as `open_shards`.
        StorageError: a shard cannot be reached or migrated, or the shards are not this set.
    """
    parsed = _parsed(urls)
    report = []
    for dsn, schema in parsed:
        before, after = await migrate_postgres(dsn, schema)
        report.append(ShardStatus(describe_postgres(dsn, schema), before, after))
    async with open_shards(urls, migrate=False, group_commit=False):
        pass
    return report


async def shards_status(urls: Sequence[str]) -> list[ShardStatus]:
    """`acp-once db status` of a shard set: (version, latest) per shard; nothing is created.

    Raises:
        ValueError: as `open_shards`.
        StorageError: a shard cannot be reached.
    """
    report = []
    for dsn, schema in _parsed(urls):
        found, latest = await postgres_status(dsn, schema)
        report.append(ShardStatus(describe_postgres(dsn, schema), found, latest))
    return report
