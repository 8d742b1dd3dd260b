"""Storage throughput and key-lookup latency of the memory and SQLite stores.

    python3 dev.py run python benchmarks/bench_store.py [N]

Prints user-message inserts per second (sequential awaits, with and without an idempotency
key) for `MemoryStore` and for `SqliteStore` with `synchronous=NORMAL` and `FULL`, then the
latency of `find_key` in a session of 10 messages and in one of 100,000. The SQLite history
of 100,000 messages is written in one raw batch (the schema's own INSERT), because this
benchmark measures the lookup, not the insert; every lookup goes through the interface.
"""

from __future__ import annotations

import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import orjson

from acp_once.storage import MemoryStore, SessionRecord, SessionStore, SqliteStore

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractAsyncContextManager

    from acp_once.storage.sqlite import Synchronous

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


async def main(n: int) -> None:
    print(f"inserts/s (sequential awaits; memory N={n * 10:,}, SQLite N={n:,})")
    with tempfile.TemporaryDirectory() as tmp:
        counter = iter(range(1_000_000))

        def sqlite(sync: Synchronous) -> Callable[[], AbstractAsyncContextManager[SessionStore]]:
            return lambda: SqliteStore.open(
                Path(tmp) / f"insert-{next(counter)}.db", synchronous=sync
            )

        backends: list[tuple[str, Callable[[], AbstractAsyncContextManager[SessionStore]], int]] = [
            ("memory", MemoryStore, n * 10),
            ("sqlite NORMAL", sqlite("NORMAL"), n),
            ("sqlite FULL", sqlite("FULL"), max(n // 4, 100)),
        ]
        for name, factory, count in backends:
            async with factory() as store:
                plain = await _inserts_per_second(store, count, keyed=False)
                keyed = await _inserts_per_second(store, count, keyed=True)
            print(f"  {name:<14} without key {plain:>10,.0f} /s   with key {keyed:>10,.0f} /s")

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
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 2_000)
