"""A node that goes away never leaves prompts waiting forever."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from acp_once.agent.runtime import INTERRUPTED_MESSAGE
from acp_once.agent.state import unfinished_turns
from acp_once.client.connection import ClientSideConnection
from acp_once.rpc.errors import ConnectionClosed
from acp_once.storage.base import TimelineEntry
from acp_once.testing import connected
from tests.cluster.harness import (
    initialize,
    new_session,
    node,
    prompt,
    prompt_params,
    resume,
    until,
    until_async,
)
from tests.helpers import CutConnection

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT = 30


async def test_prompts_queued_by_a_node_that_stopped_are_abandoned_and_a_retry_inserts_once(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    fx = tmp_path / "fx"
    with anyio.fail_after(TIMEOUT):
        async with node(postgres_dsn, schema, "a", fx) as a, connected(a.agent) as conn_a:
            await initialize(conn_a)
            sid = await new_session(conn_a)
            await prompt(conn_a, sid, "[work:1.5] busy", "k1")
            async with node(postgres_dsn, schema, "b", fx) as b, connected(b.agent) as conn_b:
                await initialize(conn_b)
                await resume(conn_b, sid)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(prompt, conn_b, sid, "queued on b", "k2")
                    await until(lambda: bool(b.coordinator._waiting))
                    tg.cancel_scope.cancel()  # B goes away with its prompt still queued
            # B is gone: A's worker abandons B's prompt instead of inserting it
            await until(lambda: not a.agent._sessions[sid].worker)
            assert await a.store.count_user_messages(sid, idempotency_key="k2") == 0
            # the client's retry, here on A, inserts it once
            mid = await prompt(conn_a, sid, "queued on b", "k2")
            found = await a.store.find_key(sid, "k2")
            assert found is not None and found.message_id == mid
            assert await a.store.count_user_messages(sid) == 2


async def test_a_waiting_node_takes_the_session_over_when_its_owner_goes(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    fx = tmp_path / "fx"
    with anyio.fail_after(TIMEOUT):
        async with node(postgres_dsn, schema, "b", fx) as b, connected(b.agent) as conn_b:
            await initialize(conn_b)
            answers: list[str] = []

            async def queued(conn: ClientSideConnection, sid: str) -> None:
                answers.append(await prompt(conn, sid, "after the owner", "k2"))

            async with anyio.create_task_group() as tg:
                async with node(postgres_dsn, schema, "a", fx) as a, connected(a.agent) as conn_a:
                    await initialize(conn_a)
                    sid = await new_session(conn_a)
                    await resume(conn_b, sid)
                    long_turn = await prompt(conn_a, sid, "[work:30] a long turn", "k1")
                    tg.start_soon(queued, conn_b, sid)
                    await until(lambda: bool(b.coordinator._waiting))
                # A stopped mid-turn: B, waiting on its queued prompt, takes the session over
                await until(lambda: bool(answers))
            # A stopped with its lease expired, not freed: B took it over as from a dead
            # owner and closed the turn A left unfinished (reported interrupted)
            assert b.coordinator.counters["leases_taken_over"] == 1
            tail = await b.store.read_timeline_tail(sid, limit=50)
            unfinished = [turn.message_id for turn in unfinished_turns(sid, tail)]
            assert long_turn not in unfinished
            # the takeover applied the recovery policy (report): one interrupted end record
            ends = [orjson.loads(e.update) for e in tail if b'"acpOnce"' in e.update]
            ended = [u for u in ends if u["_meta"]["acpOnce"]["messageId"] == long_turn]
            assert [(u["stopReason"], u["error"]["message"]) for u in ended] == [
                ("error", INTERRUPTED_MESSAGE)
            ]
            found = await b.store.find_key(sid, "k2")
            assert found is not None and answers == [found.message_id]
            assert await b.store.count_user_messages(sid) == 2


async def test_a_takeover_in_a_request_whose_connection_closes_still_recovers(
    postgres_dsn: str, schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B takes a dead owner's session over inside a prompt's request; the client's connection
    closes while B reads the turns A left unfinished. The recovery must finish all the same:
    B now holds the lease, so nobody else would ever report or run those turns."""
    fx = tmp_path / "fx"
    with anyio.fail_after(TIMEOUT):
        async with node(postgres_dsn, schema, "b", fx) as b, connected(b.agent) as conn_b:
            await initialize(conn_b)
            async with node(postgres_dsn, schema, "a", fx) as a, connected(a.agent) as conn_a:
                await initialize(conn_a)
                sid = await new_session(conn_a)
                await resume(conn_b, sid)  # loaded on B while A owns it: nothing to recover
                long_turn = await prompt(conn_a, sid, "[work:30] a long turn", "k1")
            # A stopped mid-turn with its lease expired: the next prompt on B takes over
            reading, release = anyio.Event(), anyio.Event()
            real_tail = b.agent.store.read_timeline_tail

            async def slow_tail(session_id: str, *, limit: int = 1) -> list[TimelineEntry]:
                entries = await real_tail(session_id, limit=limit)
                if not reading.is_set():  # the recovery's read: the request is cut here
                    reading.set()
                    await release.wait()
                return entries

            monkeypatch.setattr(b.agent.store, "read_timeline_tail", slow_tail)
            async with CutConnection(b.agent, release.set) as cut:
                await resume(cut, sid)
                params: dict[str, Any] = prompt_params(sid, "after the owner", "k2")
                await cut.rpc.start_request("session/prompt", params)
                await reading.wait()

            async def recovered() -> bool:
                tail = await b.store.read_timeline_tail(sid, limit=50)
                return long_turn not in [t.message_id for t in unfinished_turns(sid, tail)]

            await until_async(recovered)
            assert b.coordinator.counters["leases_taken_over"] == 1
            # and B goes on working the session: a retry of the cut prompt is answered
            answer = await prompt(conn_b, sid, "after the owner", "k2")
            found = await b.store.find_key(sid, "k2")
            assert found is not None and found.message_id == answer
            assert await b.store.count_user_messages(sid, idempotency_key="k2") == 1


async def test_a_load_whose_connection_closes_while_claiming_the_session_still_recovers(
    postgres_dsn: str, schema: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B loads (resumes) a session a dead owner left with an unfinished turn; the client's
    connection closes while B claims the lease. B has registered the session by then, so the
    recovery must finish: no later load on B would look for those turns again."""
    fx = tmp_path / "fx"
    with anyio.fail_after(TIMEOUT):
        async with node(postgres_dsn, schema, "a", fx) as a, connected(a.agent) as conn_a:
            await initialize(conn_a)
            sid = await new_session(conn_a)
            long_turn = await prompt(conn_a, sid, "[work:30] a long turn", "k1")
        async with node(postgres_dsn, schema, "b", fx) as b:
            claiming, release = anyio.Event(), anyio.Event()
            real_take = b.coordinator.pg.take

            async def slow_take(session_id: str) -> Any:
                owned = await real_take(session_id)
                if not claiming.is_set():  # the load's claim: the request is cut here
                    claiming.set()
                    await release.wait()
                return owned

            monkeypatch.setattr(b.coordinator.pg, "take", slow_take)
            async with anyio.create_task_group() as tg, CutConnection(b.agent, release.set) as cut:

                async def resume_unanswered() -> None:
                    with contextlib.suppress(ConnectionClosed):  # it is cut
                        await resume(cut, sid)

                tg.start_soon(resume_unanswered)
                await claiming.wait()

            async def recovered() -> bool:
                tail = await b.store.read_timeline_tail(sid, limit=50)
                return long_turn not in [t.message_id for t in unfinished_turns(sid, tail)]

            await until_async(recovered)
            async with connected(b.agent) as conn_b:  # and the session works on B
                await initialize(conn_b)
                await resume(conn_b, sid)
                answer = await prompt(conn_b, sid, "after the owner", "k2")
                found = await b.store.find_key(sid, "k2")
                assert found is not None and found.message_id == answer
