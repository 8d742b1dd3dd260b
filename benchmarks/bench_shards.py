"""A store sharded over two PostgreSQL servers beside one server, side by side in one run.

    python3 dev.py run python benchmarks/bench_shards.py [--inserts N] [--rounds R]
        [--dsn DSN] [--dsn2 DSN2]

Keyed user-message inserts from 20 and from 500 concurrent sessions (each session a task
inserting one message after the other, group commit on, as `serve` opens a store): one
`PostgresStore` on the first server, and a `ShardedStore` over both servers (its sessions
split between them by the hash of their ids). Rounds alternate between the two, so load
drifts hit both; the figures are the median round: inserts/s, and this process's CPU per insert
(what a node spends routing and merging, beside the database's own work). Then the latency of
one `list_sessions` page of 50 over 2,000 sessions: one server, and both shards merged.

The two servers share this machine's cores and disk, so the ratio says what sharding costs a
node, not what two database machines would give. DSNs: `--dsn`/`--dsn2`, else
`ACP_ONCE_TEST_POSTGRES_DSN`/`ACP_ONCE_TEST_POSTGRES_DSN2`, else 127.0.0.1:5432 and :5433;
each run uses fresh schemas, dropped after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import TYPE_CHECKING

import anyio
import orjson
import psycopg
from psycopg import sql

from acp_once.storage import SessionRecord, SessionStore
from acp_once.storage.postgres import PostgresStore
from acp_once.storage.postgres.shards import open_shards

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_DSN2 = "postgresql://postgres@127.0.0.1:5433/postgres"
SESSIONS = (20, 500)
LISTED = 2_000
PAGE = 50


def _record(session_id: str, stamp: float) -> SessionRecord:
    return SessionRecord(session_id, "/bench", (), None, stamp, stamp)


def _update(message_id: str) -> bytes:
    return orjson.dumps(
        {
            "sessionUpdate": "user_message",
            "messageId": message_id,
            "content": [{"type": "text", "text": "Run the database migration"}],
        }
    )


async def _inserts(store: SessionStore, sessions: int, total: int) -> tuple[float, float]:
    """(inserts/s, CPU µs of this process per insert) of `total` keyed inserts spread over
    `sessions` concurrent sessions."""
    sids = [f"sess_{uuid.uuid4().hex}" for _ in range(sessions)]
    for sid in sids:
        await store.create_session(_record(sid, time.time()))
    per = max(1, total // sessions)

    async def one(sid: str) -> None:
        for i in range(per):
            await store.insert_user_message(
                sid, message_id=f"m{i}", update=_update(f"m{i}"),
                idempotency_key=f"k{i}", prompt_digest=b"\x00" * 32,
            )  # fmt: skip

    cpu, start = time.process_time(), time.perf_counter()
    async with anyio.create_task_group() as tg:
        for sid in sids:
            tg.start_soon(one, sid)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return per * sessions / wall, cpu / (per * sessions) * 1e6


async def _list_latency(store: SessionStore) -> float:
    """Median ms of one page of `PAGE` (first page and pages deep in the listing)."""
    for n in range(LISTED):
        await store.create_session(_record(f"list_{n:05d}_{uuid.uuid4().hex[:6]}", 1000.0 + n))
    times = []
    cursor = None
    for _ in range(3):
        while True:
            start = time.perf_counter()
            _, cursor = await store.list_sessions(cursor=cursor, limit=PAGE)
            times.append(time.perf_counter() - start)
            if cursor is None:
                break
    return statistics.median(times) * 1e3


@contextmanager
def _schemas(dsn: str, dsn2: str) -> Iterator[Callable[[str], str]]:
    made: list[tuple[str, str]] = []

    def new(on: str) -> str:
        name = f"acp_once_bench_{uuid.uuid4().hex}"
        made.append((on, name))
        return f"{on}{'&' if '?' in on else '?'}schema={name}"

    try:
        yield new
    finally:
        for on in {dsn, dsn2}:
            with psycopg.connect(on, autocommit=True) as conn:
                for where, name in made:
                    if where == on:
                        conn.execute(
                            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
                        )


async def main(args: argparse.Namespace) -> None:
    with _schemas(args.dsn, args.dsn2) as new:

        def one() -> AbstractAsyncContextManager[SessionStore]:
            url = new(args.dsn)
            dsn, _, rest = url.partition("?schema=")
            return PostgresStore.open(dsn, schema=rest)

        def two() -> AbstractAsyncContextManager[SessionStore]:
            return open_shards([new(args.dsn), new(args.dsn2)])

        kinds: dict[str, Callable[[], AbstractAsyncContextManager[SessionStore]]] = {
            "one server": one,
            "two shards": two,
        }
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        for sessions in SESSIONS:
            rates: dict[str, list[float]] = {kind: [] for kind in kinds}
            cpus: dict[str, list[float]] = {kind: [] for kind in kinds}
            for _ in range(args.rounds):
                for kind, opener in kinds.items():
                    async with opener() as store:
                        rate, cpu = await _inserts(store, sessions, args.inserts)
                    rates[kind].append(rate)
                    cpus[kind].append(cpu)
            base = statistics.median(rates["one server"])
            for kind in kinds:
                rate = statistics.median(rates[kind])
                print(
                    f"{sessions:>4} sessions, {kind}: {rate:8,.0f} keyed inserts/s"
                    f" ({rate / base:.2f}x), {statistics.median(cpus[kind]):6.0f} µs CPU"
                    f" of this process per insert"
                )
        for kind, opener in kinds.items():
            async with opener() as store:
                latency = await _list_latency(store)
            print(f"list_sessions page of {PAGE} over {LISTED:,}, {kind}: {latency:.2f} ms")
        print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inserts", type=int, default=2_000, help="inserts per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each kind")
    parser.add_argument("--dsn", default=os.environ.get("ACP_ONCE_TEST_POSTGRES_DSN", DEFAULT_DSN))
    parser.add_argument(
        "--dsn2", default=os.environ.get("ACP_ONCE_TEST_POSTGRES_DSN2", DEFAULT_DSN2)
    )
    anyio.run(main, parser.parse_args())
