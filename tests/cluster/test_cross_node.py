"""Two and three in-process nodes on one schema: held prompts, retries and updates cross nodes."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from acp_once.client.connection import ClientSideConnection
from acp_once.protocol.errors import AcpError
from acp_once.testing import connected
from tests.cluster.harness import initialize, new_session, node, prompt, resume, until
from tests.helpers import UpdateRecorder, user_texts

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT = 30


async def test_held_prompt_retried_on_another_node_gets_the_same_message(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    recorder_b = UpdateRecorder()
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx") as a,
            node(postgres_dsn, schema, "b", tmp_path / "fx") as b,
            connected(a.agent) as conn_a,
            connected(b.agent, recorder_b) as conn_b,
        ):
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            first = await prompt(conn_a, sid, "[work:1] first", "k1")
            assert sid in a.coordinator.leases  # A works on the session now
            results: dict[str, str] = {}

            async def send(conn: ClientSideConnection, label: str, text: str, key: str) -> None:
                results[label] = await prompt(conn, sid, text, key)

            async with anyio.create_task_group() as tg:
                tg.start_soon(send, conn_a, "second@a", "second", "k2")
                # the held prompt is queued in PostgreSQL before B's retry arrives
                await until(lambda: bool(a.coordinator._waiting))
                tg.start_soon(send, conn_b, "second@b", "second", "k2")
                tg.start_soon(send, conn_b, "third@b", "third", "k3")
            assert results["second@a"] == results["second@b"]
            assert len(set(results.values()) | {first}) == 3
            # a retry of an inserted prompt on another node answers the recorded id
            assert await prompt(conn_b, sid, "[work:1] first", "k1") == first
            store = a.store
            assert await store.count_user_messages(sid) == 3
            for key in ("k1", "k2", "k3"):
                assert await store.count_user_messages(sid, idempotency_key=key) == 1
            # the updates of A's turns reached B's client, in order
            expected = ["[work:1] first", "second", "third"]
            await recorder_b.wait_for(lambda ups: user_texts(ups) == expected)
            await recorder_b.wait_for(
                lambda ups: any(
                    u["sessionUpdate"] == "agent_message" and u["content"][0]["text"] == "third"
                    for u in ups
                )
            )
            for n in recorder_b.notifications:  # keys never travel in updates
                assert "k2" not in json.dumps(n) and "idempotencyKey" not in json.dumps(n)


async def test_withdrawing_a_held_prompt_on_one_node_answers_every_waiter(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx") as a,
            node(postgres_dsn, schema, "b", tmp_path / "fx") as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            await prompt(conn_a, sid, "[work:1] busy", "k1")
            errors: list[int] = []

            async def held_on_b() -> None:
                try:
                    await prompt(conn_b, sid, "held", "k2")
                except AcpError as exc:
                    errors.append(exc.code)

            async with anyio.create_task_group() as tg:
                tg.start_soon(held_on_b)
                await until(lambda: bool(b.coordinator._waiting))
                call = await conn_a.rpc.start_request(
                    "session/prompt",
                    {
                        "sessionId": sid,
                        "prompt": [{"type": "text", "text": "held"}],
                        "idempotencyKey": "k2",
                    },
                )
                await until(lambda: bool(a.coordinator._waiting))
                await call.cancel()
                with pytest.raises(AcpError) as caught:
                    await call.result()
                assert caught.value.code == -32800
            assert errors == [-32800]
            assert await a.store.count_user_messages(sid, idempotency_key="k2") == 0


async def test_big_updates_cross_nodes_and_keys_never_travel_in_notifications(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    recorder_b = UpdateRecorder()
    payloads: list[str] = []
    big = "x" * 20_000  # beyond the NOTIFY payload limit: travels through session_events
    secret = "private-key-7f3a"
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx") as a,
            node(postgres_dsn, schema, "b", tmp_path / "fx") as b,
            a.coordinator.pg.listen(postgres_dsn) as notifies,
            connected(a.agent) as conn_a,
            connected(b.agent, recorder_b) as conn_b,
        ):
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)

            async def collect() -> None:
                while True:
                    async for payload in notifies(0.5):
                        payloads.append(payload)  # noqa: PERF401 (as each arrives)

            async with anyio.create_task_group() as tg:
                tg.start_soon(collect)
                first = await prompt(conn_a, sid, f"[work:0.5] {big}", secret)
                async with anyio.create_task_group() as inner:
                    inner.start_soon(prompt, conn_a, sid, "held", secret + "-2")
                    inner.start_soon(prompt, conn_b, sid, "forwarded", secret + "-3")
                assert await prompt(conn_b, sid, f"[work:0.5] {big}", secret) == first
                await recorder_b.wait_for(
                    lambda ups: any(
                        u["sessionUpdate"] == "agent_message"
                        and u["content"][0]["text"] == f"[work:0.5] {big}"
                        for u in ups
                    )
                )
                await recorder_b.wait_for(lambda ups: "forwarded" in user_texts(ups))
                tg.cancel_scope.cancel()
            assert payloads  # the nodes did talk through PostgreSQL
            assert any('"e":' in p for p in payloads)  # the big update went by reference
            assert not any(secret in p for p in payloads)
            assert b.coordinator.counters["dedup_hits"] >= 1


async def test_steer_policy_inserts_a_prompt_from_another_node_during_the_turn(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    fx = tmp_path / "fx"
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", fx, policy="steer") as a,
            node(postgres_dsn, schema, "b", fx, policy="steer") as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            await prompt(conn_a, sid, "[work:3] long", "k1")
            steered = await prompt(conn_b, sid, "steered in", "k2")
            # answered (inserted) while A's turn still runs, by A, which owns the session
            assert a.agent._sessions[sid].running
            assert b.coordinator.counters["forwarded"] == 1
            found = await a.store.find_key(sid, "k2")
            assert found is not None and found.message_id == steered
