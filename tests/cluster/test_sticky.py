"""Sticky leases: a node keeps a session's lease while the session is active and for
`lease_grace` seconds after, renewing it in the background, and picks up prompts other nodes
queue for it while it idles; a stalled owner loses it and its stale write is fenced.

Every wait is bounded; the background loops' periods are set so that the step a test waits
for is the only one that can make it pass (a long `poll_interval` where the NOTIFY must do
it, a lost NOTIFY where the poll must).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg import sql

from acp_once.storage.postgres import store as postgres_store
from acp_once.storage.postgres.connection import run_batch
from acp_once.testing import connected
from tests.cluster.harness import (
    Node,
    initialize,
    new_session,
    node,
    prompt,
    resume,
    until,
)
from tests.cluster.test_fencing import expire

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT = 20
QUIET = 30.0
"""A `poll_interval` no test waits that long for: the step must come from elsewhere."""


@contextmanager
def statements_sent() -> Iterator[list[str]]:
    """The text of every statement sent (any connection) inside the block: by psycopg's
    cursors and by the PostgreSQL store's batches (`run_batch`)."""
    sent: list[str] = []
    execute = psycopg.AsyncCursor.execute
    batch = run_batch

    async def recording_batch(conn: Any, statements: Any, **kwargs: Any) -> Any:
        sent.extend(" ".join(query.as_string(None).split()) for query, _ in statements)
        return await batch(conn, statements, **kwargs)

    async def recording(cur: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        text = query if isinstance(query, str) else query.as_string(cur.connection)
        sent.append(" ".join(str(text).split()))
        return await execute(cur, query, *args, **kwargs)

    psycopg.AsyncCursor.execute = recording  # type: ignore[method-assign,assignment]
    vars(postgres_store)["run_batch"] = recording_batch  # the name the store calls
    try:
        yield sent
    finally:
        psycopg.AsyncCursor.execute = execute  # type: ignore[method-assign]
        vars(postgres_store)["run_batch"] = batch


def drop_wakeups(n: Node) -> None:
    """Node `n` never hears a wake-up NOTIFY (lost): only its poll can find queued prompts."""
    heard = n.coordinator._on_notify

    async def lossy(payload: str) -> None:
        if '"k":"w"' not in payload.replace(" ", ""):
            await heard(payload)

    n.coordinator._on_notify = lossy  # type: ignore[method-assign]


async def idle(n: Node, sid: str) -> None:
    """Until `n`'s worker of `sid` stopped and `n` keeps the lease (bounded by the caller)."""
    await until(lambda: sid in n.coordinator.idle_since)


async def test_a_kept_lease_costs_the_next_prompt_no_lease_statement(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            node(
                postgres_dsn, schema, "a", tmp_path / "fx", lease_ttl=60, poll_interval=QUIET
            ) as a,
            connected(a.agent) as conn,
        ):
            await initialize(conn)
            sid = await new_session(conn)
            await prompt(conn, sid, "first", "k1")  # takes the lease
            await idle(a, sid)
            epoch = a.coordinator.leases[sid]
            with statements_sent() as sent:
                await prompt(conn, sid, "second", "k2")
                await idle(a, sid)
            assert a.coordinator.leases[sid] == epoch  # kept, not taken again
            lease_writes = [
                s
                for s in sent
                if f'"{schema}".session_leases SET' in s
                or f'INTO "{schema}".session_leases' in s
                or "prompt_queue" in s
            ]
            assert lease_writes == []
            # the fenced insert (lookup and insert in one statement) and the turn's writes
            inserts = [s for s in sent if f'INSERT INTO "{schema}".timeline' in s]
            assert inserts and any("FOR SHARE" in s for s in inserts)
            assert await a.store.count_user_messages(sid) == 2


async def test_an_idle_owner_inserts_a_prompt_queued_on_another_node_on_its_notify(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    fx = tmp_path / "fx"
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", fx, lease_ttl=60, poll_interval=QUIET) as a,
            node(postgres_dsn, schema, "b", fx, lease_ttl=60, poll_interval=QUIET) as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            await prompt(conn_a, sid, "first", "k1")
            await idle(a, sid)  # A keeps the lease, its worker stopped
            answer = await prompt(conn_b, sid, "second", "k2")  # queued by B, A wakes
            found = await a.store.find_key(sid, "k2")
            assert found is not None and answer == found.message_id
            assert sid in a.coordinator.leases and sid not in b.coordinator.leases
            assert b.coordinator.counters["forwarded"] == 1
            assert await a.store.count_user_messages(sid) == 2


async def test_an_idle_owner_that_missed_the_notify_finds_the_queued_prompt_by_polling(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    fx = tmp_path / "fx"
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", fx, lease_ttl=60, poll_interval=0.1) as a,
            node(postgres_dsn, schema, "b", fx, lease_ttl=60, poll_interval=QUIET) as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            drop_wakeups(a)
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            await prompt(conn_a, sid, "first", "k1")
            await idle(a, sid)
            answer = await prompt(conn_b, sid, "second", "k2")
            found = await a.store.find_key(sid, "k2")
            assert found is not None and answer == found.message_id
            assert sid in a.coordinator.leases and sid not in b.coordinator.leases
            assert await a.store.count_user_messages(sid) == 2


async def test_a_kept_lease_is_released_after_its_grace(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            node(
                postgres_dsn,
                schema,
                "a",
                tmp_path / "fx",
                lease_ttl=60,
                lease_grace=0.3,
                poll_interval=0.1,
            ) as a,
            connected(a.agent) as conn,
        ):
            await initialize(conn)
            sid = await new_session(conn)
            await prompt(conn, sid, "first", "k1")
            epoch = a.coordinator.leases[sid]
            # counted once the release statement returned (the lease is dropped before it)
            await until(lambda: a.coordinator.counters["leases_released"] == 1)
            assert sid not in a.coordinator.leases
            owner, _, _, live = await a.coordinator.pg.lease_of(sid)
            assert owner is None and not live  # free in the database too
            await prompt(conn, sid, "second", "k2")  # taken again
            assert a.coordinator.leases[sid] == epoch + 1


async def test_a_kept_lease_is_not_released_while_prompts_are_queued(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    """The grace ends while another node's prompt waits for the owner (its wake-up and its
    poll both missed): the release is refused, and the owner inserts the prompt."""
    fx = tmp_path / "fx"
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", fx, lease_ttl=60, poll_interval=0.1) as a,
            node(postgres_dsn, schema, "b", fx, lease_ttl=60, poll_interval=0.1) as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            drop_wakeups(a)

            async def nothing_queued(sessions: Any) -> list[str]:
                return []

            a.coordinator.pg.queued_sessions = nothing_queued  # type: ignore[method-assign]
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            await prompt(conn_a, sid, "first", "k1")
            await idle(a, sid)
            async with anyio.create_task_group() as tg:
                answers: list[str] = []

                async def on_b() -> None:
                    answers.append(await prompt(conn_b, sid, "second", "k2"))

                tg.start_soon(on_b)
                await until(lambda: b.coordinator.stats()["prompts_held"] == 1)
                a.coordinator.idle_since[sid] = -math.inf  # its grace is over now
            found = await a.store.find_key(sid, "k2")
            assert found is not None and answers == [found.message_id]
            assert sid in a.coordinator.leases and sid not in b.coordinator.leases
            assert a.coordinator.counters["leases_released"] == 0
            assert await a.store.count_user_messages(sid) == 2


async def test_a_stalled_owner_loses_its_kept_lease_and_its_stale_write_is_fenced(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    """A keeps the lease idle and stalls (no renewal); it expires, B takes the session over
    for a prompt. A prompt then sent to A meets B's fence (nothing written under A's old
    epoch) and is placed again: queued for B, which inserts it, once."""
    fx = tmp_path / "fx"
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", fx, lease_ttl=60, poll_interval=0.1) as a,
            node(postgres_dsn, schema, "b", fx, lease_ttl=60, poll_interval=0.1) as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):

            async def stalled(leases: dict[str, int]) -> set[str]:
                return set()  # A renews nothing and notices nothing

            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            await prompt(conn_a, sid, "first", "k1")
            await idle(a, sid)
            epoch = a.coordinator.leases[sid]
            a.coordinator.pg.renew = stalled  # type: ignore[method-assign]
            await expire(postgres_dsn, schema, sid)
            await prompt(conn_b, sid, "on b", "k2")  # B takes the expired lease over
            assert b.coordinator.leases[sid] == epoch + 1
            assert a.coordinator.leases.get(sid) == epoch  # A still believes it owns it
            answer = await prompt(conn_a, sid, "on a", "k3")
            assert a.coordinator.counters["fenced"] >= 1  # A's stale write was refused
            assert sid not in a.coordinator.leases
            found = await b.store.find_key(sid, "k3")
            assert found is not None and answer == found.message_id
            assert b.coordinator.counters["leases_taken_over"] == 1
            for key in ("k1", "k2", "k3"):
                assert await b.store.count_user_messages(sid, idempotency_key=key) == 1


async def test_a_renewal_that_finds_the_lease_lost_drops_it(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx", lease_ttl=0.6, lease_grace=60) as a,
            connected(a.agent) as conn,
        ):
            await initialize(conn)
            sid = await new_session(conn)
            await prompt(conn, sid, "first", "k1")
            await idle(a, sid)
            # another owner has it now (taken over while A looked dead)
            async with await psycopg.AsyncConnection.connect(
                postgres_dsn, autocommit=True
            ) as admin:
                await admin.execute(
                    sql.SQL(
                        "UPDATE {}.session_leases SET owner = 'elsewhere', epoch = epoch + 1,"
                        " expires_at = now() + interval '1 hour' WHERE session_id = %s"
                    ).format(sql.Identifier(schema)),
                    (sid,),
                )
            await until(lambda: sid not in a.coordinator.leases)  # the next renewal
            assert a.coordinator.counters["leases_lost"] == 1
            assert sid not in a.coordinator.idle_since
