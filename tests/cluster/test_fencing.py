"""Fencing: a node whose lease was taken over cannot write; the store refuses it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import orjson
import psycopg
import pytest
from psycopg import sql

from acp_once.cluster.fence import Fence, QueueRowGone
from acp_once.cluster.sql import Owned, PgCluster, Queued
from acp_once.storage.base import FencingError, InsertOutcome, SessionRecord
from acp_once.storage.postgres import PostgresStore
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
                guard=fence_a,
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
                    guard=fence_a,
                )
            with pytest.raises(FencingError):
                await store_a.append_update("s1", b'{"x": 1}', guard=fence_a)
            with pytest.raises(FencingError):
                await store_a.append_updates("s1", [(b'{"x": 2}', None)], guard=fence_a)
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
                guard=Fence("b-1", taken.epoch),
            )
            assert second.inserted
            seqs = await store_b.append_updates(
                "s1", [(b'{"y": 1}', "a1"), (b'{"y": 2}', None)], guard=Fence("b-1", taken.epoch)
            )
            assert [e.seq for e in (await store_b.read_timeline("s1"))[-2:]] == seqs
            # a released lease fences its last owner too
            assert await b.release("s1", taken.epoch)
            with pytest.raises(FencingError):
                await store_b.append_update("s1", b"{}", guard=Fence("b-1", taken.epoch))


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


async def test_taking_a_lease_abandons_the_prompts_of_dead_nodes_only(
    postgres_dsn: str, schema: str
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with PostgresStore.open(postgres_dsn, schema=schema) as store:
            a = PgCluster(store, node_id="a", instance="a-1", lease_ttl=60)
            b = PgCluster(store, node_id="b", instance="b-1", lease_ttl=60)
            await a.heartbeat({})
            await b.heartbeat({})
            await store.create_session(record("s1"))
            await store.create_session(record("s2"))
            for sid in ("s1", "s2"):
                assert isinstance(await a.take(sid), Owned)
            # s1: one prompt queued by B (alive) and one by a node that never beat (dead)
            queued = await b.admit("s1", "k1", b"d", b"[]", epoch=None)
            assert isinstance(queued, Queued)
            async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as c:
                await c.execute(
                    sql.SQL(
                        "INSERT INTO {}.prompt_queue (session_id, prompt_digest, content, origin)"
                        " VALUES ('s1', 'd', '[]', 'dead-1'), ('s2', 'd', '[]', 'dead-1')"
                    ).format(sql.Identifier(schema))
                )
            for sid in ("s1", "s2"):
                await expire(postgres_dsn, schema, sid)
            s1 = await b.take("s1")
            s2 = await b.take("s2")
            assert isinstance(s1, Owned) and s1.backlog and s1.took_over
            assert isinstance(s2, Owned) and not s2.backlog and s2.took_over
            async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as c:
                cur = await c.execute(
                    sql.SQL(
                        "SELECT session_id, origin, state FROM {}.prompt_queue ORDER BY id"
                    ).format(sql.Identifier(schema))
                )
                rows = await cur.fetchall()
            assert rows == [
                ("s1", "b-1", "queued"),
                ("s1", "dead-1", "abandoned"),
                ("s2", "dead-1", "abandoned"),
            ]


async def test_a_fenced_insert_settles_its_queued_prompt_in_the_same_statement(
    postgres_dsn: str, schema: str
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            PostgresStore.open(postgres_dsn, schema=schema) as store,
            PostgresStore.open(postgres_dsn, schema=schema) as other,
        ):
            a = PgCluster(store, node_id="a", instance="a-1", lease_ttl=60)
            b = PgCluster(other, node_id="b", instance="b-1", lease_ttl=60)
            await a.heartbeat({})
            await b.heartbeat({})
            await store.create_session(record("s1"))
            owned = await a.take("s1")
            assert isinstance(owned, Owned)
            rows = []
            for key in ("k1", "k2", "k3"):
                queued = await b.admit("s1", key, b"d-" + key.encode(), b"[]", epoch=None)
                assert isinstance(queued, Queued)
                rows.append(queued.row)

            def fence(row: int) -> Fence:
                return Fence("a-1", owned.epoch, row=row, channel=a.channel)

            notes: list[dict[str, object]] = []
            async with a.listen(postgres_dsn) as notifies:
                first = await store.insert_user_message(
                    "s1",
                    message_id="m1",
                    update=b"{}",
                    idempotency_key="k1",
                    prompt_digest=b"d-k1",
                    guard=fence(rows[0]),
                )
                assert first == InsertOutcome("m1", True, b"d-k1")
                # k2's row is a retry of k1 with another prompt: recorded, not the same
                again = await store.insert_user_message(
                    "s1",
                    message_id="m2",
                    update=b"{}",
                    idempotency_key="k1",
                    prompt_digest=b"d-k2",
                    guard=fence(rows[1]),
                )
                assert again == InsertOutcome("m1", False, b"d-k1")
                # k3's row was withdrawn: the insert writes nothing
                assert await b.withdraw(rows[2])
                with pytest.raises(QueueRowGone):
                    await store.insert_user_message(
                        "s1",
                        message_id="m3",
                        update=b"{}",
                        idempotency_key="k3",
                        prompt_digest=b"d-k3",
                        guard=fence(rows[2]),
                    )
                while len(notes) < 3:
                    async for payload in notifies(1.0):
                        notes.append(orjson.loads(payload))  # noqa: PERF401
            outcomes = [(n["r"], n["st"], n["m"], n["p"]) for n in notes if n["k"] == "o"]
            assert outcomes == [
                (rows[0], "inserted", "m1", True),
                (rows[1], "recorded", "m1", False),
                (rows[2], "withdrawn", None, None),
            ]
            assert await store.count_user_messages("s1") == 1
            assert await store.count_user_messages("s1", idempotency_key="k3") == 0


async def test_a_stale_owner_refused_for_a_key_another_node_inserted_answers_its_id(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    """Issue 28, bug 2. Node A owns the session and is about to insert key K (its first
    attempt, held just before the fenced insert); A stalls (its renewals stop) and its lease
    expires; the client's resend of K on node B takes the session over and inserts K. When A's
    late insert is then refused by the fence, A must look K up and answer with B's message id:
    an error would tell the client that K is unused, and it is not (R19)."""
    fx = tmp_path / "fx"
    reached, go = anyio.Event(), anyio.Event()
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", fx, lease_ttl=1.0) as a,
            node(postgres_dsn, schema, "b", fx, lease_ttl=1.0) as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            original = a.store.insert_user_message

            async def held_insert(session_id: str, **fields: Any) -> InsertOutcome:
                if fields.get("idempotency_key") == "K" and not reached.is_set():
                    reached.set()
                    await go.wait()
                return await original(session_id, **fields)

            async def stalled(leases: dict[str, int]) -> set[str]:
                return set()  # A renews nothing and notices nothing: a stalled owner

            a.store.insert_user_message = held_insert  # type: ignore[method-assign]
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            first = await conn_a.rpc.start_request(
                "session/prompt", {"sessionId": sid, "prompt": [{"type": "text", "text": "deploy"}],
                                   "idempotencyKey": "K"},
            )  # fmt: skip
            await reached.wait()  # A took the lease and is about to insert K
            a.coordinator.pg.renew = stalled  # type: ignore[method-assign]
            await expire(postgres_dsn, schema, sid)
            resent = await prompt(conn_b, sid, "deploy", "K")  # B takes over and inserts K
            assert sid in b.coordinator.leases
            assert await b.store.count_user_messages(sid, idempotency_key="K") == 1
            go.set()  # A's late insert meets B's fence
            answer = await first.result()
            assert answer["messageId"] == resent
            assert await b.store.count_user_messages(sid) == 1
