"""Fencing: a node whose lease was taken over cannot write; the store refuses it."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import orjson
import psycopg
import pytest
from psycopg import sql

from acp_once.storage.base import FencingError, SessionRecord
from acp_once.storage.pg_cluster import Owned, PgCluster
from acp_once.storage.postgres import Fence, PostgresStore
from acp_once.testing import connected
from tests.cluster.harness import (
    initialize,
    new_session,
    node,
    prompt,
    resume,
    until,
    until_async,
)

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT = 30


def record(sid: str) -> SessionRecord:
    now = time.time()
    return SessionRecord(sid, "/w", (), None, now, now)


async def expire(dsn: str, schema: str, sid: str) -> None:
    """Make the session's lease expire now (as if its owner had stopped renewing it)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            sql.SQL(
                "UPDATE {}.session_leases SET expires_at = now() - interval '1 second'"
                " WHERE session_id = %s"
            ).format(sql.Identifier(schema)),
            (sid,),
        )


async def test_a_taken_over_lease_fences_the_old_owner(postgres_dsn: str, schema: str) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            PostgresStore.open(postgres_dsn, schema=schema) as store_a,
            PostgresStore.open(postgres_dsn, schema=schema) as store_b,
        ):
            a = PgCluster(store_a, node_id="a", instance="a-1", lease_ttl=0.5)
            b = PgCluster(store_b, node_id="b", instance="b-1", lease_ttl=0.5)
            await a.heartbeat({})
            await b.heartbeat({})
            await store_a.create_session(record("s1"))
            owned = await a.take("s1")
            assert isinstance(owned, Owned)
            assert await b.take("s1") is None  # a live owner keeps it
            fence_a = Fence("a-1", owned.epoch)
            first = await store_a.insert_user_message(
                "s1",
                message_id="m1",
                update=b"{}",
                idempotency_key="k1",
                prompt_digest=None,
                fence=fence_a,
            )
            assert first.inserted

            # A stops renewing; its lease expires and B takes the session over
            async def expired() -> bool:
                return not (await b.lease_of("s1"))[3]

            await until_async(expired)
            taken = await b.take("s1")
            assert isinstance(taken, Owned) and taken.epoch == owned.epoch + 1
            with pytest.raises(FencingError):
                await store_a.insert_user_message(
                    "s1",
                    message_id="m2",
                    update=b"{}",
                    idempotency_key="k2",
                    prompt_digest=None,
                    fence=fence_a,
                )
            with pytest.raises(FencingError):
                await store_a.append_update("s1", b'{"x": 1}', fence=fence_a)
            # the refused writes left nothing behind, the key stays unused
            assert await store_a.count_user_messages("s1") == 1
            assert await store_a.count_user_messages("s1", idempotency_key="k2") == 0
            assert len(await store_a.read_timeline("s1")) == 1
            # A may not take it back while B holds it, and B writes under its own token
            assert await a.take("s1") is None
            second = await store_b.insert_user_message(
                "s1",
                message_id="m2",
                update=b"{}",
                idempotency_key="k2",
                prompt_digest=None,
                fence=Fence("b-1", taken.epoch),
            )
            assert second.inserted
            # a released lease fences its last owner too
            assert await b.release("s1", taken.epoch)
            with pytest.raises(FencingError):
                await store_b.append_update("s1", b"{}", fence=Fence("b-1", taken.epoch))


async def test_a_node_that_lost_its_lease_mid_turn_writes_nothing(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx", lease_ttl=60) as a,
            PostgresStore.open(postgres_dsn, schema=schema) as store_b,
            connected(a.agent) as conn,
        ):
            b = PgCluster(store_b, node_id="b", instance="b-1", lease_ttl=60)
            await b.heartbeat({})
            await initialize(conn)
            sid = await new_session(conn)
            await prompt(conn, sid, "[work:1] slow turn", "k1")
            epoch = a.coordinator.leases[sid]
            # the lease is taken over while A's turn runs (A looks dead to the others)
            await expire(postgres_dsn, schema, sid)
            taken = await b.take(sid)
            assert isinstance(taken, Owned) and taken.epoch == epoch + 1
            # A's turn ends: its retained reply and its turn marker are refused
            await until(lambda: not a.agent._sessions[sid].worker)
            entries = await store_b.read_timeline(sid)
            kinds = [orjson.loads(e.update)["sessionUpdate"] for e in entries]
            assert kinds == ["user_message"]
            # and A no longer inserts: a new prompt there is queued behind B's lease
            assert sid not in a.coordinator.leases
            await resume(conn, sid)
            async with anyio.create_task_group() as tg:
                tg.start_soon(prompt, conn, sid, "after takeover", "k2")
                await until(lambda: bool(a.coordinator._waiting))
                assert await store_b.count_user_messages(sid) == 1
                tg.cancel_scope.cancel()
