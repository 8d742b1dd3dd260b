"""The agent model's mutants (verification/agent.pml, `MUTANT_*`) played on the real runtime.

Each test plays the sequence of events of the counterexample SPIN prints for one mutant (the
model with one guard removed) against `SessionAgent` on a real store, holding the code at the
step the trace interleaves with events, and asserts the property that mutant breaks. On the
real code the property holds; with the guard removed (docs/verification.md says how each was
shown) the test fails. A "crash" is the agent and its connections torn down at that step, and
a new `SessionAgent` on the same store object (which keeps what was committed) is the restart.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from acp_once.agent import StopReason
from acp_once.agent.runtime import SessionAgent, Turn, TurnContext
from acp_once.client import ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.protocol.errors import INTERNAL_ERROR, REQUEST_CANCELLED, AcpError
from acp_once.rpc.connection import PendingCall
from acp_once.storage import InsertOutcome, MemoryStore, StorageError
from acp_once.testing import connected
from tests.cluster.harness import until, until_async
from tests.helpers import initialize_request

pytestmark = pytest.mark.anyio

TIMEOUT = 10
KEY = "K"


class GatedAgent(SessionAgent):
    """A turn whose text contains "[block]" runs until `gate` is set: a turn is running for as
    long as the trace needs (`session.running`, which decides hold or insert)."""

    def __init__(self, store: MemoryStore, **kw: Any) -> None:
        super().__init__(store, **kw)
        self.gate = anyio.Event()

    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason:
        if "[block]" in turn.text:
            await self.gate.wait()
        return "end_turn"


def params(sid: str, text: str, key: str | None = KEY) -> dict[str, Any]:
    p: dict[str, Any] = {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}
    if key is not None:
        p["idempotencyKey"] = key
    return p


async def open_session(conn: ClientSideConnection) -> str:
    await conn.agent.initialize(initialize_request("t"))
    return (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id


async def join(conn: ClientSideConnection, sid: str) -> None:
    """Another connection of the client: initialize, resume the session."""
    await conn.agent.initialize(initialize_request("t"))
    await conn.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/w"))


async def outcome(call: PendingCall) -> str:
    """The answer as one comparable value: the message id, or "error CODE"."""
    try:
        return str((await call.result())["messageId"])
    except AcpError as exc:
        return f"error {exc.code}"


async def stored_id(store: MemoryStore, sid: str, key: str = KEY) -> str | None:
    found = await store.find_key(sid, key)
    return None if found is None else found.message_id


# -- KEY_APART -------------------------------------------------------------------------------


class DiesInInsert(MemoryStore):
    """With `die`, the next insert never returns: the process dies during it or right after
    its commit (the caller never hears the outcome)."""

    die = False

    async def insert_user_message(self, session_id: str, **fields: Any) -> InsertOutcome:
        outcome = await super().insert_user_message(session_id, **fields)
        if self.die:
            await anyio.sleep_forever()
        return outcome


async def test_key_apart_a_crash_at_the_commit_then_a_resend_inserts_nothing_new() -> None:
    """KEY_APART (P1, at most one message per key). Trace: the prompt is inserted at once; the
    store writes its message; the agent is killed before anything else happens (in the
    mutant: before the key's own transaction); the restarted agent gets the client's resend
    with the same key, inserted at once again. The resend must find the key with the message:
    one user message in the session, and the answer carries its id."""
    with anyio.fail_after(TIMEOUT):
        async with DiesInInsert() as store:
            async with GatedAgent(store) as first, connected(first) as conn:
                sid = await open_session(conn)
                store.die = True
                await conn.rpc.start_request("session/prompt", params(sid, "deploy"))
                # the message is in the store (the commit landed, or its first half did)

                async def written() -> bool:
                    return await store.count_user_messages(sid) == 1

                await until_async(written, interval=0.005)
            # killed: the connection and the agent are gone, the store keeps what committed
            store.die = False
            async with GatedAgent(store) as second, connected(second) as conn:
                await join(conn, sid)
                answer = await outcome(
                    await conn.rpc.start_request("session/prompt", params(sid, "deploy"))
                )
                assert await store.count_user_messages(sid) == 1
                assert answer == await stored_id(store, sid)


# -- RETRY_EARLY -----------------------------------------------------------------------------


class HeldThenFails(MemoryStore):
    """The next insert waits for `go`, then fails having stored nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = True
        self.reached = anyio.Event()
        self.go = anyio.Event()

    async def insert_user_message(self, session_id: str, **fields: Any) -> InsertOutcome:
        if self.fail:
            self.fail = False
            self.reached.set()
            await self.go.wait()
            raise StorageError("the database is gone")
        return await super().insert_user_message(session_id, **fields)


async def test_retry_early_a_retry_during_the_insert_is_not_answered_before_the_commit() -> None:
    """RETRY_EARLY (P2, a success answer carries the stored id). Trace: attempt 1 is being
    inserted (the store call in flight); the client's retry with the key arrives on another
    connection; the insert fails, storing nothing (attempt 1 gets -32603). The retry must not
    have been answered with the id being inserted: it waits (the session lock) and is then
    inserted itself, so its answer is the id the store has."""
    with anyio.fail_after(TIMEOUT):
        async with (
            HeldThenFails() as store,
            GatedAgent(store) as agent,
            connected(agent) as a,
            connected(agent) as b,
        ):
            sid = await open_session(a)
            await join(b, sid)
            first = await a.rpc.start_request("session/prompt", params(sid, "deploy"))
            await store.reached.wait()  # the insert is in flight
            retry = await b.rpc.start_request("session/prompt", params(sid, "deploy"))
            lock = agent._sessions[sid].inbox.lock
            # the retry waits for the insert (or, wrongly, was answered already)
            await until(lambda: lock.waiting() == 1 or retry.done, 0.005)
            assert not retry.done
            store.go.set()
            assert await outcome(first) == f"error {INTERNAL_ERROR}"
            assert await outcome(retry) == await stored_id(store, sid)
            assert await store.count_user_messages(sid) == 1
            later = await outcome(
                await b.rpc.start_request("session/prompt", params(sid, "deploy"))
            )
            assert later == await stored_id(store, sid)
            assert await store.count_user_messages(sid) == 1


# -- WITHDRAW_ONE ----------------------------------------------------------------------------


async def test_withdraw_one_a_cancel_answers_every_request_of_the_held_prompt() -> None:
    """WITHDRAW_ONE (P3, -32800 only for a key that stays unused). Trace (hold policy): a turn
    runs; the prompt with key K is held; the client's retry with K on another connection
    joins it; $/cancel_request of the first request withdraws the prompt. Both requests must
    get -32800, and the prompt is never inserted when the turn ends; a later send inserts."""
    with anyio.fail_after(TIMEOUT):
        async with (
            MemoryStore() as store,
            GatedAgent(store, policy="hold") as agent,
            connected(agent) as a,
            connected(agent) as b,
        ):
            sid = await open_session(a)
            await join(b, sid)
            busy = await outcome(
                await a.rpc.start_request("session/prompt", params(sid, "[block] busy", None))
            )
            assert busy.startswith("msg")
            first = await a.rpc.start_request("session/prompt", params(sid, "deploy"))
            await until(lambda: KEY in agent._sessions[sid].pending_by_key, interval=0.005)
            retry = await b.rpc.start_request("session/prompt", params(sid, "deploy"))
            pending = agent._sessions[sid].pending_by_key[KEY]
            await until(lambda: len(pending.waiters) == 2, interval=0.005)
            assert pending.state == "held"
            await first.cancel()
            assert await outcome(first) == f"error {REQUEST_CANCELLED}"
            # the retry is answered by the same withdrawal, before the turn ends (bounded:
            # a retry left waiting would be inserted, and answered, only after the turn)
            with anyio.move_on_after(2):
                await until(lambda: retry.done, interval=0.005)
            agent.gate.set()
            assert await outcome(retry) == f"error {REQUEST_CANCELLED}"
            assert await store.count_user_messages(sid, idempotency_key=KEY) == 0
            later = await outcome(
                await b.rpc.start_request("session/prompt", params(sid, "deploy"))
            )
            assert later == await stored_id(store, sid)
            assert await store.count_user_messages(sid, idempotency_key=KEY) == 1


# -- WITHDRAW_INSERTING ----------------------------------------------------------------------


class HeldInsert(MemoryStore):
    """The insert of the key `KEY` waits for `go` before it commits."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = anyio.Event()
        self.go = anyio.Event()

    async def insert_user_message(self, session_id: str, **fields: Any) -> InsertOutcome:
        if fields.get("idempotency_key") == KEY:
            self.reached.set()
            await self.go.wait()
        return await super().insert_user_message(session_id, **fields)


async def test_withdraw_inserting_a_cancel_during_the_insert_loses_to_it() -> None:
    """WITHDRAW_INSERTING (P3, a withdrawn prompt is never inserted). Trace (hold policy): the
    prompt is held behind a turn; the turn ends and the worker inserts it (the store call in
    flight); $/cancel_request for its request arrives; the insert commits. Insertion wins
    (R27): the request is answered with the stored id, not -32800 for a stored prompt."""
    with anyio.fail_after(TIMEOUT):
        async with (
            HeldInsert() as store,
            GatedAgent(store, policy="hold") as agent,
            connected(agent) as a,
        ):
            sid = await open_session(a)
            await outcome(
                await a.rpc.start_request("session/prompt", params(sid, "[block] busy", None))
            )
            call = await a.rpc.start_request("session/prompt", params(sid, "deploy"))
            await until(lambda: KEY in agent._sessions[sid].pending_by_key, interval=0.005)
            pending = agent._sessions[sid].pending_by_key[KEY]
            assert pending.state == "held"
            request = pending.waiters[0][1]
            assert request is not None
            agent.gate.set()  # the turn ends: the worker inserts the held prompt
            await store.reached.wait()
            assert str(pending.state) == "inserting"  # mypy narrowed it to "held" above
            await call.cancel()
            await until(lambda: request.cancel_requested, interval=0.005)  # the agent has it
            store.go.set()
            answer = await outcome(call)
            assert await store.count_user_messages(sid, idempotency_key=KEY) == 1
            assert answer == await stored_id(store, sid)


# -- NO_LOOKUP -------------------------------------------------------------------------------


class LostAnswer(MemoryStore):
    """The next insert commits, then raises as if the commit's answer was lost (PostgreSQL's
    connection cut at COMMIT)."""

    lose = True

    async def insert_user_message(self, session_id: str, **fields: Any) -> InsertOutcome:
        outcome = await super().insert_user_message(session_id, **fields)
        if self.lose:
            self.lose = False
            raise StorageError("connection lost at COMMIT")
        return outcome


async def test_no_lookup_a_failed_insert_that_landed_is_answered_with_its_id() -> None:
    """NO_LOOKUP (P3, -32603 only for a key that stays unused). Trace: the insert's commit
    lands but the store raises. The runtime must look the key up: the request is answered
    with the stored id, and a retry gets the same id without a second message."""
    with anyio.fail_after(TIMEOUT):
        async with LostAnswer() as store, GatedAgent(store) as agent, connected(agent) as a:
            sid = await open_session(a)
            answer = await outcome(await a.rpc.start_request("session/prompt", params(sid, "x")))
            assert answer == await stored_id(store, sid)
            retry = await outcome(await a.rpc.start_request("session/prompt", params(sid, "x")))
            assert retry == answer
            assert await store.count_user_messages(sid) == 1


# -- NO_UNIQUE -------------------------------------------------------------------------------


async def test_no_unique_an_overlapping_attempt_after_the_insert_is_answered_by_the_key() -> None:
    """NO_UNIQUE (P1). Trace (steer policy): attempt 1 is inserted and answered, its turn
    runs; the client's overlapping attempt with the same key (sent on another connection
    before the answer came) arrives and, not held, goes straight to the store's insert (no
    lookup first). The store's unique (session, key) must answer it as recorded: the same id,
    one user message."""
    with anyio.fail_after(TIMEOUT):
        async with (
            MemoryStore() as store,
            GatedAgent(store, policy="steer") as agent,
            connected(agent) as a,
            connected(agent) as b,
        ):
            sid = await open_session(a)
            await join(b, sid)
            text = "[block] deploy"
            first = await outcome(await a.rpc.start_request("session/prompt", params(sid, text)))
            assert agent._sessions[sid].running  # its turn runs: steer inserts at once
            second = await outcome(await b.rpc.start_request("session/prompt", params(sid, text)))
            agent.gate.set()
            assert first == second == await stored_id(store, sid)
            assert await store.count_user_messages(sid) == 1
