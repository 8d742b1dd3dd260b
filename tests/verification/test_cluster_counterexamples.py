"""The cluster model's counterexamples (verification/cluster.pml) played on real nodes.

Each test follows the trace SPIN printed for one property, with events holding the real code
at the step the trace interleaves; the assertion is the property itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg import sql

from acp_once.agent import StopReason
from acp_once.agent.runtime import Turn, TurnContext
from acp_once.cluster.sql import QueuedPrompt
from acp_once.protocol.errors import AcpError
from acp_once.storage.base import InsertOutcome
from acp_once.testing import connected
from tests.cluster.harness import (
    initialize,
    new_session,
    node,
    prompt_params,
    resume,
    until,
    until_async,
)

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT = 30


async def one_queued(dsn: str, schema: str) -> bool:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            sql.SQL("SELECT count(*) FROM {}.prompt_queue WHERE state = 'queued'").format(
                sql.Identifier(schema)
            )
        )
        row = await cur.fetchone()
        return row is not None and int(row[0]) == 1


async def test_a_queued_retry_is_not_withdrawn_after_its_key_was_inserted_elsewhere(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    """C3 (cluster.pml, found by SPIN): two attempts with one key overlap. A takes the free
    lease and is about to insert; B sees A's live lease and queues its attempt; A inserts the
    key. A $/cancel_request of B's attempt must not answer -32800 ("withdrawn before
    insertion"): the prompt is inserted, so B's request gets its message id (R27).

    Every step is held by an event, so the withdrawal always meets B's row still queued: A's
    insert waits for `go`; A's turn waits for `turn_ends`; A reads the queue only after
    `queue_open`. Without the last hold, A's worker, started by the NOTIFY that B queued a
    prompt, could take B's row right after A's insert and settle it `recorded` before the
    cancel arrived: the withdrawal then found nothing queued, and the trace passed on the old
    code too (1 run in 7 at first, 7 in 10 when measured again)."""
    fx = tmp_path / "fx"
    reached, go = anyio.Event(), anyio.Event()
    turn_ends, queue_open = anyio.Event(), anyio.Event()
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", fx) as a,
            node(postgres_dsn, schema, "b", fx) as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            original = a.store.insert_user_message

            async def held_insert(session_id: str, **fields: Any) -> InsertOutcome:
                # A store that waits before its (fenced) insert: the trace's step between
                # A taking the lease and A's write
                if fields.get("idempotency_key") == "K" and not reached.is_set():
                    reached.set()
                    await go.wait()
                return await original(session_id, **fields)

            async def run_turn(turn: Turn, ctx: TurnContext) -> StopReason:
                await turn_ends.wait()  # A's turn of K runs until the trace is played
                return "end_turn"

            next_prompt = a.coordinator.pg.next_prompt

            async def closed_queue(session_id: str) -> QueuedPrompt | None:
                # the owner reads the queue (after its turn, or woken by B's NOTIFY) only
                # once B's withdrawal was answered: the trace has no owner step there
                await queue_open.wait()
                return await next_prompt(session_id)

            a.store.insert_user_message = held_insert  # type: ignore[method-assign]
            a.agent.run_turn = run_turn  # type: ignore[method-assign,assignment]
            a.coordinator.pg.next_prompt = closed_queue  # type: ignore[method-assign]
            try:
                await initialize(conn_a)
                await initialize(conn_b)
                sid = await new_session(conn_a)
                await resume(conn_b, sid)
                on_a = await conn_a.rpc.start_request(
                    "session/prompt", prompt_params(sid, "deploy", "K")
                )
                await reached.wait()  # A owns the lease and is about to insert K
                on_b = await conn_b.rpc.start_request(
                    "session/prompt", prompt_params(sid, "deploy", "K")
                )
                # B queued its attempt (state in the database: polled, bounded by
                # fail_after) and waits on it: from that moment its $/cancel_request
                # withdraws (a cancel that came earlier, while B was still admitting, would
                # not be seen by the prompt)
                await until_async(lambda: one_queued(postgres_dsn, schema))
                await until(lambda: b.coordinator.stats()["prompts_held"] == 1)
                assert await a.store.count_user_messages(sid, idempotency_key="K") == 0
                go.set()
                message_id = (await on_a.result())["messageId"]
                assert await a.store.count_user_messages(sid, idempotency_key="K") == 1
                assert await one_queued(postgres_dsn, schema)  # B's row: still queued
                await on_b.cancel()
                try:
                    answer = (await on_b.result())["messageId"]
                except AcpError as exc:
                    answer = f"error {exc.code}"
                assert answer == message_id
            finally:
                queue_open.set()
                turn_ends.set()
            # the owner drains the queue (B's row is settled: nothing to insert) and lets go
            await until(lambda: sid not in a.coordinator.leases)
            assert await a.store.count_user_messages(sid, idempotency_key="K") == 1
