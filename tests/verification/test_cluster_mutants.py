"""The cluster model's mutants (verification/cluster.pml, `MUTANT_*`) played on two real
nodes on PostgreSQL (WITHDRAW_RECORDED: test_cluster_counterexamples.py).

Each test follows the counterexample SPIN prints for the model with one guard removed, holding
the nodes at the trace's steps (a turn held open by an event, a stalled lease renewal, a lost
NOTIFY, the owner held after reading a queued row), and asserts the property that mutant breaks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.agent import StopReason
from acp_once.agent.runtime import Turn, TurnContext
from acp_once.client.connection import ClientSideConnection
from acp_once.cluster.sql import QueuedPrompt
from acp_once.protocol.errors import REQUEST_CANCELLED, AcpError
from acp_once.rpc.connection import PendingCall
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
from tests.cluster.test_fencing import expire
from tests.cluster.test_races import two_nodes_on_a_session

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT = 20


def hold_turns(n: Node) -> anyio.Event:
    """Node `n`'s turns run until the returned event is set: a turn is running there."""
    gate = anyio.Event()

    async def run_turn(turn: Turn, ctx: TurnContext) -> StopReason:
        await gate.wait()
        return "end_turn"

    n.agent.run_turn = run_turn  # type: ignore[method-assign,assignment]
    return gate


async def outcome(call: PendingCall) -> str:
    try:
        return str((await call.result())["messageId"])
    except AcpError as exc:
        return f"error {exc.code}"


async def send(conn: ClientSideConnection, sid: str, text: str, key: str) -> PendingCall:
    return await conn.rpc.start_request("session/prompt", prompt_params(sid, text, key))


async def test_take_unexpired_a_live_owners_lease_is_not_taken(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    """TAKE_UNEXPIRED (C5, no turn on two nodes at once). Trace: A owns the session and runs a
    turn; the client's prompt arrives on B. B must not take A's live lease (nor run a turn):
    it queues the prompt, which A inserts when its turn ends."""
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx") as a,
            node(postgres_dsn, schema, "b", tmp_path / "fx") as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            gate = hold_turns(a)
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            await outcome(await send(conn_a, sid, "busy", "k1"))  # A owns it, its turn runs
            on_b = await send(conn_b, sid, "second", "k2")
            # B queued it (waits on the row), or, wrongly, took the lease and inserted it
            await until(lambda: b.coordinator.stats()["prompts_held"] == 1 or on_b.done)
            assert sid not in b.coordinator.leases and not on_b.done
            assert await a.store.count_user_messages(sid, idempotency_key="k2") == 0
            gate.set()  # A's turn ends: A inserts the queued prompt
            answer = await outcome(on_b)
            found = await a.store.find_key(sid, "k2")
            assert found is not None and answer == found.message_id
            assert await a.store.count_user_messages(sid) == 2


async def test_no_poll_a_lost_notify_still_answers_the_queued_prompt(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    """NO_POLL (C6, the client gets the id). Trace: B queues the prompt behind A's turn; A
    inserts it; the NOTIFY of the outcome to B is lost. B's poll must still answer the
    request with the message id."""
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx") as a,
            node(postgres_dsn, schema, "b", tmp_path / "fx") as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            gate = hold_turns(a)
            heard = b.coordinator._on_notify

            async def lossy(payload: str) -> None:
                if '"k":"o"' not in payload.replace(" ", ""):  # outcomes never reach B
                    await heard(payload)

            b.coordinator._on_notify = lossy  # type: ignore[method-assign]
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            await outcome(await send(conn_a, sid, "busy", "k1"))
            on_b = await send(conn_b, sid, "second", "k2")
            await until(lambda: b.coordinator.stats()["prompts_held"] == 1)
            gate.set()
            # bounded well below TIMEOUT: the poll runs every 0.2 s
            answer: Any = None
            with anyio.move_on_after(5):
                answer = await outcome(on_b)
            found = await a.store.find_key(sid, "k2")
            assert found is not None and answer == found.message_id


async def test_no_fence_a_stale_owners_insert_is_refused(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    """NO_FENCE (C4, a write succeeds only under the current lease). Trace: A owns the
    session; A stalls past the TTL (its renewals stop) and its lease expires; B takes the
    session over and inserts; A, still believing it owns the lease, inserts a prompt sent to
    it. A's write must be refused: nothing stored for its key under A's lease; the prompt is
    placed again (queued for B, which inserts it once its turn ends)."""
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx", policy="steer") as a,
            node(postgres_dsn, schema, "b", tmp_path / "fx") as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            gate = hold_turns(a)
            # B's turn runs until the end too: B keeps the lease it took (an idle owner
            # releases it) while the test reads it
            gate_b = hold_turns(b)

            async def stalled(leases: dict[str, int]) -> set[str]:
                await anyio.sleep_forever()  # A stalls: it neither renews nor learns
                raise AssertionError

            a.coordinator.pg.renew = stalled  # type: ignore[method-assign]
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            await outcome(await send(conn_a, sid, "busy", "k1"))  # A owns it
            epoch_a = a.coordinator.leases[sid]
            await expire(postgres_dsn, schema, sid)  # past the TTL
            took = await outcome(await send(conn_b, sid, "taken over", "k2"))
            assert took.startswith("msg") and sid in b.coordinator.leases
            assert a.coordinator.leases.get(sid) == epoch_a  # A has not noticed
            stale = await send(conn_a, sid, "stale", "k3")
            # A's write is refused, and the prompt waits in the queue for B (its turn runs)
            await until(lambda: a.coordinator.stats()["prompts_held"] == 1 or stale.done)
            assert a.coordinator.counters["fenced"] >= 1 and not stale.done
            assert await a.store.count_user_messages(sid, idempotency_key="k3") == 0
            owner, _, epoch, live = await b.coordinator.pg.lease_of(sid)
            assert epoch == b.coordinator.leases[sid] != epoch_a  # the takeover bumped it
            assert owner == b.coordinator.instance and live
            gate.set()
            gate_b.set()
            answer = await outcome(stale)  # B inserts it after its turn
            found = await b.store.find_key(sid, "k3")
            assert found is not None and answer == found.message_id
            assert await b.store.count_user_messages(sid, idempotency_key="k3") == 1


async def test_row_unguarded_a_withdrawn_row_read_by_the_owner_is_not_inserted(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    """ROW_UNGUARDED (C1 at most one message per key, C2 a withdrawn key stays unused).
    Trace: A owns the session and runs a turn; B queues a prompt behind it; A's turn ends and
    A reads B's queued row; B's request is cancelled (its row withdrawn: -32800); A goes on
    and inserts. A's insert must require the row still queued: nothing is stored for the
    key, and a later send with it inserts it once."""
    picked, go = anyio.Event(), anyio.Event()

    async def hold(found: QueuedPrompt) -> None:
        if found.key == "k2" and not picked.is_set():
            picked.set()  # A read the row, not inserted yet: hold A here
            await go.wait()

    with anyio.fail_after(TIMEOUT):
        async with two_nodes_on_a_session(postgres_dsn, schema, tmp_path / "fx", hold) as (
            a,
            b,
            conn_a,
            conn_b,
            sid,
        ):
            gate = hold_turns(a)
            tried = anyio.Event()
            insert_queued = a.coordinator._insert_queued

            async def insert_queued_once(sid: str, queued: QueuedPrompt, insert: Any) -> None:
                try:
                    await insert_queued(sid, queued, insert)
                finally:
                    tried.set()  # A's insert of the row it read is over, whatever it did

            a.coordinator._insert_queued = insert_queued_once  # type: ignore[method-assign]
            await outcome(await send(conn_a, sid, "busy", "k1"))  # A owns it, its turn runs
            on_b = await send(conn_b, sid, "second", "k2")
            await until(lambda: b.coordinator.stats()["prompts_held"] == 1)  # queued behind A
            gate.set()  # A's turn ends: A reads B's row and is held before inserting it
            await picked.wait()
            await on_b.cancel()
            assert await outcome(on_b) == f"error {REQUEST_CANCELLED}"
            go.set()
            await tried.wait()
            assert await a.store.find_key(sid, "k2") is None  # withdrawn: the key is unused
            assert await a.store.count_user_messages(sid, idempotency_key="k2") == 0
            again = await prompt(conn_b, sid, "second", "k2")
            found = await a.store.find_key(sid, "k2")
            assert found is not None and again == found.message_id
            assert await a.store.count_user_messages(sid, idempotency_key="k2") == 1
            assert await a.store.count_user_messages(sid) == 2


# -- liveness: NO_QUEUE_INSERT, NO_ANSWER, NO_TAKEOVER ----------------------------------------


class Polls:
    """Counts node `n`'s finished polls (`_maintain` -> `_poll`, every `poll_interval`): the
    safety net behind NOTIFY that answers rows and takes expired leases over."""

    def __init__(self, n: Node) -> None:
        self.finished = 0
        poll = n.coordinator._poll

        async def counted() -> None:
            await poll()
            self.finished += 1

        n.coordinator._poll = counted  # type: ignore[method-assign]

    async def one_whole(self) -> None:
        """Until a poll that began after this call has finished (the one running now may have
        read the rows before; bounded by the caller's fail_after)."""
        start = self.finished
        await until(lambda: self.finished >= start + 2)


async def test_no_queue_insert_the_owner_inserts_a_prompt_queued_behind_its_turn(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    """NO_QUEUE_INSERT (liveness: a queued prompt whose request waits is inserted). Trace: A
    owns the session and runs a turn; B queues a prompt behind it; A's turn ends. A's worker
    must insert B's queued prompt before it stops (an owner never goes idle with a prompt
    queued: it cannot release the lease, so nobody else would insert it); B's request then
    gets the prompt's id."""
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx") as a,
            node(postgres_dsn, schema, "b", tmp_path / "fx") as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            gate = hold_turns(a)
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            await outcome(await send(conn_a, sid, "busy", "k1"))  # A owns it, its turn runs
            session = a.agent._sessions[sid]
            assert session.worker
            on_b = await send(conn_b, sid, "second", "k2")
            await until(lambda: b.coordinator.stats()["prompts_held"] == 1)  # queued behind A
            gate.set()  # A's turn ends: its worker goes on to the queue
            await until(lambda: not session.worker)  # A's worker is done
            found = await a.store.find_key(sid, "k2")
            assert found is not None, "the owner stopped with the prompt still queued"
            assert await outcome(on_b) == found.message_id
            assert await a.store.count_user_messages(sid) == 2


async def test_no_answer_a_request_waiting_on_an_inserted_row_is_answered(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    """NO_ANSWER (liveness: every request waiting on a queued prompt gets an answer). Trace: A
    owns the session and runs a turn; B queues a prompt behind it; A's turn ends and A inserts
    it (the same statement settles the row `inserted`). B must answer its request: once a
    whole poll of B's has run after the insert (whether or not the NOTIFY came first), B waits
    on no row, and the request gets the message id."""
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx") as a,
            node(postgres_dsn, schema, "b", tmp_path / "fx") as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            gate = hold_turns(a)
            polls = Polls(b)
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            await outcome(await send(conn_a, sid, "busy", "k1"))  # A owns it, its turn runs
            on_b = await send(conn_b, sid, "second", "k2")
            await until(lambda: b.coordinator.stats()["prompts_held"] == 1)  # queued behind A
            gate.set()  # A's turn ends: A inserts B's prompt

            async def inserted() -> bool:
                return await a.store.find_key(sid, "k2") is not None

            await until_async(inserted)
            await polls.one_whole()
            assert b.coordinator.stats()["prompts_held"] == 0, "B still waits on an inserted row"
            found = await a.store.find_key(sid, "k2")
            assert found is not None and await outcome(on_b) == found.message_id


async def test_no_takeover_a_prompt_queued_behind_a_dead_owner_is_inserted(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    """NO_TAKEOVER (liveness: a prompt queued behind an owner that died is inserted). Trace: A
    owns the session and runs a turn; B queues a prompt behind it; A stalls (its renewals
    stop, its turn never ends) and its lease expires. B's poll finds its row queued under an
    expired lease: after a whole poll of B's following the expiry, B must have taken the lease
    over, and it inserts the prompt: B's request gets the id."""
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx") as a,
            node(postgres_dsn, schema, "b", tmp_path / "fx") as b,
            connected(a.agent) as conn_a,
            connected(b.agent) as conn_b,
        ):
            gate = hold_turns(a)

            async def stalled(leases: dict[str, int]) -> set[str]:
                await anyio.sleep_forever()  # A stalls: it neither renews nor learns
                raise AssertionError

            a.coordinator.pg.renew = stalled  # type: ignore[method-assign]
            polls = Polls(b)
            await initialize(conn_a)
            await initialize(conn_b)
            sid = await new_session(conn_a)
            await resume(conn_b, sid)
            await outcome(await send(conn_a, sid, "busy", "k1"))  # A owns it, its turn runs
            on_b = await send(conn_b, sid, "second", "k2")
            await until(lambda: b.coordinator.stats()["prompts_held"] == 1)  # queued behind A
            await expire(postgres_dsn, schema, sid)  # A's lease runs out
            await polls.one_whole()
            # B took the lease (it may have inserted the prompt and let the lease go since)
            assert b.coordinator.counters["leases_taken_over"] == 1, "B did not take it over"
            answer = await outcome(on_b)
            found = await a.store.find_key(sid, "k2")
            assert found is not None and answer == found.message_id
            gate.set()
