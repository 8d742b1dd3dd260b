"""Storage throughput and key-lookup latency of the stores.

    python3 dev.py run python benchmarks/bench_store.py [N] [--dsn DSN | --no-postgres]

Prints user-message inserts per second (sequential awaits, with and without an idempotency
key) for `MemoryStore` and for `SqliteStore` with `synchronous=NORMAL` (with and without
group commit) and `FULL`; then keyed inserts from 20 and from 500 concurrent sessions (each
session a task inserting one message after the other) for SQLite and PostgreSQL, with group
commit and without, with the transactions (commits) per insert; then the latency of
`find_key` in a session of 10 messages and in one of 100,000. The SQLite history of 100,000
messages is written in one raw batch (the schema's own INSERT), because this benchmark
measures the lookup, not the insert; every lookup goes through the interface.

PostgreSQL: `--dsn`, else `ACP_ONCE_TEST_POSTGRES_DSN`, else
postgresql://postgres@127.0.0.1:5432/postgres; each run uses a fresh schema, dropped after.
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import orjson
import psycopg
from psycopg import sql

from acp_once.storage import MemoryStore, SessionRecord, SessionStore, SqliteStore
from acp_once.storage.postgres import PostgresStore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from contextlib import AbstractAsyncContextManager

    from acp_once.storage.sqlite import Synchronous

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
CONCURRENT_INSERTS = {"sqlite": 10_000, "postgres": 2_000}
"""Keyed inserts per concurrent run (spread over its sessions)."""
BIG = 100_000
SMALL = 10
LOOKUPS = 2_000


def _record(session_id: str) -> SessionRecord:
    now = time.time()
    return SessionRecord(session_id, "/bench", (), None, now, now)


def _update(message_id: str) -> bytes:
    return orjson.dumps(
        {
            "sessionUpdate": "user_message",
            "messageId": message_id,
            "content": [{"type": "text", "text": "Run the database migration"}],
        }
    )


async def _inserts_per_second(store: SessionStore, n: int, *, keyed: bool) -> float:
    session_id = f"sess_{'keyed' if keyed else 'plain'}"
    await store.create_session(_record(session_id))
    updates = [_update(f"msg_{i}") for i in range(n)]
    start = time.perf_counter()
    for i in range(n):
        await store.insert_user_message(
            session_id,
            message_id=f"msg_{i}",
            update=updates[i],
            idempotency_key=f"key-{i}" if keyed else None,
            prompt_digest=b"\x00" * 32 if keyed else None,
        )
    return n / (time.perf_counter() - start)


async def _concurrent(
    store: SqliteStore | PostgresStore, sessions: int, total: int
) -> tuple[float, float | None]:
    """`sessions` tasks, each inserting keyed messages into its own session one after the
    other, `total` in all: inserts per second, and transactions per insert (None without
    group commit: one each)."""
    per = max(total // sessions, 1)
    for n in range(sessions):
        await store.create_session(_record(f"c{n}"))
    update = _update("msg")
    stats = store.group_stats
    before = 0 if stats is None else stats.batches

    async def client(sid: str) -> None:
        for i in range(per):
            await store.insert_user_message(
                sid,
                message_id=f"msg_{i}",
                update=update,
                idempotency_key=f"key-{i}",
                prompt_digest=b"\x00" * 32,
            )

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for n in range(sessions):
            tg.start_soon(client, f"c{n}")
    rate = sessions * per / (time.perf_counter() - start)
    commits = None if stats is None else (stats.batches - before) / (sessions * per)
    return rate, commits


async def _concurrent_table(tmp: str, dsn: str | None) -> None:
    print("keyed inserts/s from concurrent sessions (transactions per insert)")
    counter = iter(range(1_000_000))

    @asynccontextmanager
    async def postgres(group: bool) -> AsyncIterator[PostgresStore]:
        assert dsn is not None
        schema = f"bench_store_{uuid.uuid4().hex[:12]}"
        try:
            async with PostgresStore.open(dsn, schema=schema, group_commit=group) as store:
                yield store
        finally:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )

    def sqlite(group: bool) -> AbstractAsyncContextManager[SqliteStore]:
        return SqliteStore.open(Path(tmp) / f"concurrent-{next(counter)}.db", group_commit=group)

    backends: list[tuple[str, Callable[[bool], AbstractAsyncContextManager[Any]]]] = [
        ("sqlite", sqlite)
    ]
    if dsn is not None:
        backends.append(("postgres", postgres))
    for name, opener in backends:
        for sessions in (20, 500):
            cells: list[str] = []
            rates: list[float] = []
            for group in (False, True):
                async with opener(group) as store:
                    rate, commits = await _concurrent(store, sessions, CONCURRENT_INSERTS[name])
                rates.append(rate)
                per = "1" if commits is None else f"{commits:.3f}"
                cells.append(f"{'grouped' if group else 'single '} {rate:>8,.0f} /s ({per})")
            print(
                f"  {name:<8} {sessions:>3} sessions  {cells[0]}   {cells[1]}"
                f"   x{rates[1] / rates[0]:.2f}"
            )


async def _lookup_us(store: SessionStore, session_id: str, size: int) -> float:
    keys = [f"key-{random.randrange(size)}" for _ in range(LOOKUPS)]
    start = time.perf_counter()
    for key in keys:
        if await store.find_key(session_id, key) is None:
            raise RuntimeError("a recorded key was not found")
    return (time.perf_counter() - start) / LOOKUPS * 1e6


async def _fill(store: SessionStore, session_id: str, size: int) -> None:
    await store.create_session(_record(session_id))
    update = _update("msg")
    for i in range(size):
        await store.insert_user_message(
            session_id,
            message_id=f"msg_{i}",
            update=update,
            idempotency_key=f"key-{i}",
            prompt_digest=None,
        )


def _bulk_fill(path: Path, session_id: str, size: int) -> None:
    update = _update("msg")
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO timeline (session_id, seq, message_id, payload, is_user_message,"
            " idempotency_key) VALUES (?, ?, ?, ?, 1, ?)",
            ((session_id, i + 1, f"msg_{i}", update, f"key-{i}") for i in range(size)),
        )
        conn.execute("COMMIT")
        conn.execute("ANALYZE")
    finally:
        conn.close()


async def main(n: int, dsn: str | None) -> None:
    print(f"inserts/s (sequential awaits; memory N={n * 10:,}, SQLite N={n:,})")
    with tempfile.TemporaryDirectory() as tmp:
        counter = iter(range(1_000_000))

        def sqlite(
            sync: Synchronous, *, group: bool = True
        ) -> Callable[[], AbstractAsyncContextManager[SessionStore]]:
            return lambda: SqliteStore.open(
                Path(tmp) / f"insert-{next(counter)}.db", synchronous=sync, group_commit=group
            )

        backends: list[tuple[str, Callable[[], AbstractAsyncContextManager[SessionStore]], int]] = [
            ("memory", MemoryStore, n * 10),
            ("sqlite NORMAL", sqlite("NORMAL"), n),
            ("  ungrouped", sqlite("NORMAL", group=False), n),
            ("sqlite FULL", sqlite("FULL"), max(n // 4, 100)),
        ]
        for name, factory, count in backends:
            async with factory() as store:
                plain = await _inserts_per_second(store, count, keyed=False)
                keyed = await _inserts_per_second(store, count, keyed=True)
            print(f"  {name:<14} without key {plain:>10,.0f} /s   with key {keyed:>10,.0f} /s")

        await _concurrent_table(tmp, dsn)

        print(f"find_key latency (mean of {LOOKUPS:,} lookups of random recorded keys)")
        async with MemoryStore() as memory:
            await _fill(memory, "small", SMALL)
            await _fill(memory, "big", BIG)
            small_us = await _lookup_us(memory, "small", SMALL)
            big_us = await _lookup_us(memory, "big", BIG)
        print(
            f"  {'memory':<14} {SMALL:>7,} msgs {small_us:7.1f} us   {BIG:,} msgs {big_us:7.1f} us"
        )

        path = Path(tmp) / "lookup.db"
        async with SqliteStore.open(path) as store:
            await _fill(store, "small", SMALL)
            await store.create_session(_record("big"))
        _bulk_fill(path, "big", BIG)
        async with SqliteStore.open(path) as store:
            small_us = await _lookup_us(store, "small", SMALL)
            big_us = await _lookup_us(store, "big", BIG)
        print(
            f"  {'sqlite':<14} {SMALL:>7,} msgs {small_us:7.1f} us   {BIG:,} msgs {big_us:7.1f} us"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", nargs="?", type=int, default=2_000)
    parser.add_argument("--dsn", default=os.environ.get("ACP_ONCE_TEST_POSTGRES_DSN", DEFAULT_DSN))
    parser.add_argument("--no-postgres", action="store_true", help="skip PostgreSQL")
    args = parser.parse_args()
    anyio.run(main, args.n, None if args.no_postgres else args.dsn)
