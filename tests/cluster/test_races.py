"""The owner inserts a queued prompt while the same key is withdrawn and arrives again elsewhere.

Both races are provoked deterministically: the owner's insert is held at a chosen point by an
event (wrapping its `PgCluster` methods), the other node acts, then the insert goes on. Neither
race is a failure: no ERROR record (nor traceback) is logged, and every request gets the answer
a single node would give.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg import sql

from acp_once.agent.runtime import Turn, TurnContext
from acp_once.client.connection import ClientSideConnection
from acp_once.cluster.sql import QueuedPrompt
from acp_once.protocol import schema as s
from acp_once.protocol.errors import AcpError
from acp_once.storage.base import InsertOutcome
from acp_once.testing import connected
from tests.cluster.harness import (
    Node,
    initialize,
    new_session,
    node,
    prompt,
    prompt_params,
    resume,
    until,
    until_async,
)

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT = 30


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@asynccontextmanager
async def two_nodes_on_a_session(
    postgres_dsn: str, schema: str, fx: Path, hold: Callable[[QueuedPrompt], Awaitable[None]]
) -> AsyncIterator[tuple[Node, Node, ClientSideConnection, ClientSideConnection, str]]:
    """Nodes A and B with a client each, on one session (created on A, resumed on B). A has
    read each queued prompt it is about to insert when it calls `hold` with it, which may
    wait: the race happens there."""
    async with (
        node(postgres_dsn, schema, "a", fx) as a,
        node(postgres_dsn, schema, "b", fx) as b,
        connected(a.agent) as conn_a,
        connected(b.agent) as conn_b,
    ):
        original = a.coordinator.pg.next_prompt

        async def next_prompt(session_id: str) -> QueuedPrompt | None:
            found = await original(session_id)
            if found is not None:
                await hold(found)
            return found

        a.coordinator.pg.next_prompt = next_prompt  # type: ignore[method-assign]
        await initialize(conn_a)
        await initialize(conn_b)
        sid = await new_session(conn_a)
        await resume(conn_b, sid)
        yield a, b, conn_a, conn_b, sid


async def test_withdrawn_then_resent_while_the_owner_picks_it_up(
    postgres_dsn: str, schema: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The owner has read the queued prompt and is about to insert it; meanwhile the request
    is cancelled on its node (withdrawn: -32800) and the same key arrives again there. The
    owner's insert finds the row withdrawn, writes nothing and logs no error; the new request
    is inserted once."""
    caplog.set_level(logging.DEBUG, logger="acp_once")
    fx = tmp_path / "fx"
    picked = anyio.Event()
    go = anyio.Event()

    async def hold(found: QueuedPrompt) -> None:
        if not picked.is_set():
            picked.set()  # read, not inserted yet: hold the owner here
            await go.wait()

    with anyio.fail_after(TIMEOUT):
        async with two_nodes_on_a_session(postgres_dsn, schema, fx, hold) as (
            a,
            b,
            conn_a,
            conn_b,
            sid,
        ):
            turn_ends = anyio.Event()

            async def run_turn(turn: Turn, ctx: TurnContext) -> str:
                # A's turns run until the test ends them: B's prompt must be queued behind a
                # running turn (after it, B would take the free lease and insert it itself)
                await turn_ends.wait()
                return "end_turn"

            a.agent.run_turn = run_turn  # type: ignore[method-assign,assignment]
            await prompt(conn_a, sid, "busy", "k1")  # A owns the session, its turn runs
            first = await conn_b.rpc.start_request(
                "session/prompt", prompt_params(sid, "second", "k2")
            )
            await until(lambda: b.coordinator.stats()["prompts_held"] == 1)  # B queued it
            turn_ends.set()
            await picked.wait()  # A's turn ended and it read B's queued prompt
            await first.cancel()
            with pytest.raises(AcpError) as caught:
                await first.result()
            assert caught.value.code == -32800
            results: list[str] = []
            async with anyio.create_task_group() as tg:

                async def again() -> None:
                    results.append(await prompt(conn_b, sid, "second", "k2"))

                tg.start_soon(again)
                await until(lambda: len(b.coordinator._waiting) == 1)  # queued anew
                go.set()
            found = await a.store.find_key(sid, "k2")
            assert found is not None and results == [found.message_id]
            assert await a.store.count_user_messages(sid, idempotency_key="k2") == 1
            assert await a.store.count_user_messages(sid) == 2
            assert not a.coordinator.gone
    assert not errors_logged(caplog)
    assert any("prompt.gone" in r.getMessage() for r in caplog.records)  # the race happened


async def waiting_on_locks(dsn: str, *patterns: str) -> bool:
    """Every statement whose text matches a LIKE pattern waits on a lock (pg_stat_activity)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for pattern in patterns:
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND query LIKE %s",
                (pattern,),
            )
            row = await cur.fetchone()
            if row is None or row[0] == 0:
                return False
    return True


async def test_a_withdrawal_during_the_owners_insert_waits_and_insertion_wins(
    postgres_dsn: str, schema: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The owner's insert statement holds the lease row and the queued row (it waits on the
    session row, which the test holds locked); a cancel on the node that queued it waits for
    the insert and finds it inserted (R27), and a retry with the key that arrives meanwhile
    joins the same prompt: both requests get the one message id."""
    caplog.set_level(logging.DEBUG, logger="acp_once")
    fx = tmp_path / "fx"
    picked = anyio.Event()
    go = anyio.Event()

    async def hold(found: QueuedPrompt) -> None:
        if not picked.is_set():
            picked.set()
            await go.wait()  # until the test holds the session row

    with anyio.fail_after(TIMEOUT):
        async with (
            two_nodes_on_a_session(postgres_dsn, schema, fx, hold) as (a, b, conn_a, conn_b, sid),
            await psycopg.AsyncConnection.connect(postgres_dsn) as blocker,
        ):
            await prompt(conn_a, sid, "[work:0.2] busy", "k1")
            first = await conn_b.rpc.start_request(
                "session/prompt", prompt_params(sid, "second", "k2")
            )
            await picked.wait()
            await blocker.execute(
                sql.SQL("SELECT 1 FROM {}.sessions WHERE session_id = %s FOR UPDATE").format(
                    sql.Identifier(schema)
                ),
                (sid,),
            )
            go.set()
            # A's insert locked the queued row and waits on the session row
            await until_async(lambda: waiting_on_locks(postgres_dsn, f"%{schema}%timeline%"))
            await first.cancel()
            # B's withdrawal waits for A's insert (on the lease row the insert holds)
            await until_async(
                lambda: waiting_on_locks(postgres_dsn, f"%{schema}%session_leases%NO KEY UPDATE%")
            )
            results: list[str] = []
            async with anyio.create_task_group() as tg:

                async def retry(conn: ClientSideConnection) -> None:
                    results.append(await prompt(conn, sid, "second", "k2"))

                tg.start_soon(retry, conn_b)
                pending = b.agent._sessions[sid].pending_by_key["k2"]
                await until(lambda: len(pending.waiters) == 2)  # joined the held prompt
                await blocker.rollback()  # A's insert goes on
            assert (await first.result())["messageId"] == results[0]
            found = await a.store.find_key(sid, "k2")
            assert found is not None and found.message_id == results[0]
            assert await a.store.count_user_messages(sid, idempotency_key="k2") == 1
    assert not errors_logged(caplog)


@pytest.mark.parametrize("withdrawal", ["cancel_request", "session_cancel"])
async def test_a_withdrawal_waits_for_the_owners_direct_insert_of_the_same_key(
    postgres_dsn: str, schema: str, tmp_path: Path, withdrawal: str
) -> None:
    """C3 with the insert in flight (docs/verification.md, "a withdrawal answered -32800 for a
    key another attempt inserted"). Trace: A's attempt with key K takes the free lease and
    starts its fenced insert of K (no queued row: the direct path); B's attempt with K sees
    A's lease and queues a row; A's insert statement holds the lease row FOR SHARE and waits
    on the session row, which the test holds locked; B's request is cancelled
    ($/cancel_request, `PgCluster.withdraw`), or B's client sends session/cancel
    (`PgCluster.cancel_session`); then the session row is let go and A's insert commits.
    Property (R27, and an error answer means the key is unused): B's request is answered A's
    message id, or, if it is answered with an error, K is not stored. The withdrawal must wait
    for the insert in flight (it locks the lease row first): a withdrawal that does not wait
    finds K not yet committed and answers -32800 for a key that is then inserted."""
    fx = tmp_path / "fx"
    reached, go, queue_open = anyio.Event(), anyio.Event(), anyio.Event()

    async def hold(found: QueuedPrompt) -> None:
        await queue_open.wait()  # the owner takes B's row only once the trace is played

    with anyio.fail_after(TIMEOUT):
        async with (
            two_nodes_on_a_session(postgres_dsn, schema, fx, hold) as (a, b, conn_a, conn_b, sid),
            await psycopg.AsyncConnection.connect(postgres_dsn) as blocker,
        ):
            original = a.store.insert_user_message

            async def held_insert(session_id: str, **fields: Any) -> InsertOutcome:
                # A waits before its fenced insert: the step between taking the lease and
                # writing, where B queues its attempt
                if fields.get("idempotency_key") == "K" and not reached.is_set():
                    reached.set()
                    await go.wait()
                return await original(session_id, **fields)

            a.store.insert_user_message = held_insert  # type: ignore[method-assign]
            try:
                on_a = await conn_a.rpc.start_request(
                    "session/prompt", prompt_params(sid, "deploy", "K")
                )
                await reached.wait()  # A owns the lease and is about to insert K
                on_b = await conn_b.rpc.start_request(
                    "session/prompt", prompt_params(sid, "deploy", "K")
                )
                await until(lambda: b.coordinator.stats()["prompts_held"] == 1)  # B queued it
                await blocker.execute(
                    sql.SQL("SELECT 1 FROM {}.sessions WHERE session_id = %s FOR UPDATE").format(
                        sql.Identifier(schema)
                    ),
                    (sid,),
                )
                go.set()
                # A's insert statement holds the lease row and waits on the session row
                await until_async(
                    lambda: waiting_on_locks(postgres_dsn, f"%{schema}%session_leases%FOR SHARE%")
                )
                answered = anyio.Event()
                answers: list[str] = []

                async def b_answer() -> None:
                    try:
                        answers.append(str((await on_b.result())["messageId"]))
                    except AcpError as exc:
                        answers.append(f"error {exc.code}")
                    answered.set()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(b_answer)
                    if withdrawal == "cancel_request":
                        await on_b.cancel()
                    else:
                        await conn_b.agent.cancel(s.CancelSessionNotification(session_id=sid))
                    # B's withdrawal waits for A's insert (on the lease row it holds), or,
                    # not waiting, has answered already
                    await until_async(lambda: _answered_or_waiting(answered, postgres_dsn, schema))
                    await blocker.rollback()  # A's insert goes on and commits
                message_id = str((await on_a.result())["messageId"])
                stored = await a.store.count_user_messages(sid, idempotency_key="K")
                if answers[0].startswith("error"):
                    assert stored == 0, f"B answered {answers[0]} for a key that is stored"
                assert stored == 1
                assert answers == [message_id]
            finally:
                queue_open.set()
                go.set()


async def _answered_or_waiting(answered: anyio.Event, dsn: str, schema: str) -> bool:
    return answered.is_set() or await waiting_on_locks(
        dsn, f"%{schema}%session_leases%NO KEY UPDATE%"
    )
