"""Fenced appends go through group commit: the writes of many sessions share a transaction,
and a fence that no longer holds is the answer of its own write alone."""

from __future__ import annotations

import time

import anyio
import pytest

from acp_once.cluster.fence import Fence
from acp_once.cluster.sql import Owned, PgCluster
from acp_once.storage.base import FencingError, InsertOutcome, KeyRecord, SessionRecord
from acp_once.storage.postgres import PostgresStore
from tests.storage.conftest import batch_everything

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT = 30


def record(sid: str) -> SessionRecord:
    now = time.time()
    return SessionRecord(sid, "/w", (), None, now, now)


async def test_a_stale_fence_in_a_batch_fails_alone(postgres_dsn: str, schema: str) -> None:
    sessions = [f"s{n}" for n in range(6)]
    with anyio.fail_after(TIMEOUT):
        async with PostgresStore.open(postgres_dsn, schema=schema) as store:
            batch_everything(store)
            a = PgCluster(store, node_id="a", instance="a-1", lease_ttl=60)
            await a.heartbeat({})
            fences: dict[str, Fence] = {}
            for sid in sessions:
                await store.create_session(record(sid))
                owned = await a.take(sid)
                assert isinstance(owned, Owned)
                fences[sid] = Fence("a-1", owned.epoch)
            # s0's fence is stale: the lease moved on (released, then taken again)
            assert await a.release("s0", fences["s0"].epoch)
            retaken = await a.take("s0")
            assert isinstance(retaken, Owned) and retaken.epoch == fences["s0"].epoch + 1
            stats = store.group_stats
            assert stats is not None
            before = stats.batches
            results: dict[str, list[int] | FencingError] = {}

            async def append(sid: str) -> None:
                try:
                    results[sid] = await store.append_updates(
                        sid, [(b'{"n": 1}', f"{sid}-a"), (b'{"n": 2}', None)], guard=fences[sid]
                    )
                except FencingError as exc:
                    results[sid] = exc

            async with anyio.create_task_group() as tg:
                for sid in sessions:
                    tg.start_soon(append, sid)
            assert isinstance(results["s0"], FencingError)
            assert await store.read_timeline("s0") == []  # the stale owner wrote nothing
            for sid in sessions[1:]:
                assert results[sid] == [1, 2]
                entries = await store.read_timeline(sid)
                assert [(e.seq, e.message_id) for e in entries] == [(1, f"{sid}-a"), (2, None)]
            # the six writes shared fewer transactions than one each
            assert 0 < stats.batches - before < len(sessions)
            # a lone fenced append that no longer holds is refused too (nothing written)
            with pytest.raises(FencingError):
                await store.append_update("s0", b"{}", guard=fences["s0"])
            assert await store.read_timeline("s0") == []


async def test_a_stale_fenced_insert_in_a_batch_fails_alone(postgres_dsn: str, schema: str) -> None:
    sessions = [f"s{n}" for n in range(6)]
    with anyio.fail_after(TIMEOUT):
        async with PostgresStore.open(postgres_dsn, schema=schema) as store:
            batch_everything(store)
            a = PgCluster(store, node_id="a", instance="a-1", lease_ttl=60)
            await a.heartbeat({})
            fences: dict[str, Fence] = {}
            for sid in sessions:
                await store.create_session(record(sid))
                owned = await a.take(sid)
                assert isinstance(owned, Owned)
                fences[sid] = Fence("a-1", owned.epoch)
            assert await a.release("s0", fences["s0"].epoch)  # s0's fence goes stale
            stats = store.group_stats
            assert stats is not None
            before = stats.batches
            results: dict[str, InsertOutcome | FencingError] = {}

            async def insert(sid: str) -> None:
                try:
                    results[sid] = await store.insert_user_message(
                        sid,
                        message_id=f"{sid}-m",
                        update=b"{}",
                        idempotency_key="k",
                        prompt_digest=b"d",
                        guard=fences[sid],
                    )
                except FencingError as exc:
                    results[sid] = exc

            async with anyio.create_task_group() as tg:
                for sid in sessions:
                    tg.start_soon(insert, sid)
            assert isinstance(results["s0"], FencingError)
            assert await store.count_user_messages("s0") == 0
            for sid in sessions[1:]:
                assert results[sid] == InsertOutcome(f"{sid}-m", True, b"d")
                assert await store.find_key(sid, "k") == KeyRecord(f"{sid}-m", b"d")
            assert 0 < stats.batches - before < len(sessions)
            # the key again, in a batch: the recorded message, nothing written twice
            again = await store.insert_user_message(
                "s1", message_id="other", update=b"{}", idempotency_key="k",
                prompt_digest=b"d", guard=fences["s1"],
            )  # fmt: skip
            assert again == InsertOutcome("s1-m", False, b"d")
            assert await store.count_user_messages("s1", idempotency_key="k") == 1
