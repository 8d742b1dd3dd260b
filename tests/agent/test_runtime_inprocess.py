"""The session runtime with several connections to one agent process, in memory.

On stdio a new connection means a new process; here one agent serves many connections at once,
as it does behind the remote transports: retries on a new connection, sessions active on two
connections, held prompts whose connection ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.agent import Extension, StopReason
from acp_once.agent.reference import ReferenceAgent
from acp_once.agent.runtime import Turn, TurnContext
from acp_once.agent.state import unfinished_turns
from acp_once.client import Client, ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.protocol.errors import (
    INTERNAL_ERROR,
    REQUEST_CANCELLED,
    RESOURCE_NOT_FOUND,
    AcpError,
)
from acp_once.storage import InsertOutcome, MemoryStore, SessionStore, StorageError
from acp_once.testing import connected
from tests.cluster.harness import until
from tests.helpers import CutConnection, UpdateRecorder, initialize_request

pytestmark = pytest.mark.anyio

KEY = "retry-key-1"


@asynccontextmanager
async def reference(
    tmp_path: Path,
    store: SessionStore | None = None,
    agent_class: type[ReferenceAgent] = ReferenceAgent,
    **kw: Any,
) -> AsyncIterator[ReferenceAgent]:
    async with (
        MemoryStore() as memory,
        agent_class(store or memory, side_effects=tmp_path / "effects", **kw) as agent,
    ):
        yield agent


@asynccontextmanager
async def client(
    agent: ReferenceAgent, recorder: Client | None = None
) -> AsyncIterator[ClientSideConnection]:
    async with connected(agent, recorder) as conn:
        await conn.agent.initialize(initialize_request("t"))
        yield conn


@asynccontextmanager
async def session_on(
    tmp_path: Path,
    store: SessionStore,
    recorder: Client | None = None,
    agent_class: type[ReferenceAgent] = ReferenceAgent,
) -> AsyncIterator[tuple[ClientSideConnection, str]]:
    """A reference agent (or `agent_class`) on `store`, a client connection to it and a new
    session's id."""
    async with (
        reference(tmp_path, store, agent_class) as agent,
        client(agent, recorder) as conn,
    ):
        yield conn, (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id


def params(sid: str, text: str, key: str | None = KEY) -> dict[str, Any]:
    p: dict[str, Any] = {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}
    if key is not None:
        p["idempotencyKey"] = key
    return p


async def prompt(conn: ClientSideConnection, sid: str, text: str, key: str | None = KEY) -> str:
    result = await conn.rpc.request("session/prompt", params(sid, text, key))
    return str(result["messageId"])


async def resume(conn: ClientSideConnection, sid: str) -> None:
    await conn.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/w"))


async def test_t2_retry_after_resume_on_a_new_connection(tmp_path: Path) -> None:
    with anyio.fail_after(10):
        async with reference(tmp_path) as agent:
            async with client(agent) as first:
                sid = (await first.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
                original = await prompt(first, sid, "deploy [tool]")
            # the first connection dropped; the answer is "lost"
            async with client(agent) as second:
                with pytest.raises(AcpError) as info:
                    await prompt(second, sid, "deploy [tool]")
                assert info.value.code == RESOURCE_NOT_FOUND
                assert info.value.data == {"sessionId": sid}
                await resume(second, sid)
                assert await prompt(second, sid, "deploy [tool]") == original
            assert await agent.store.count_user_messages(sid) == 1


async def test_updates_go_to_every_connection_the_session_is_active_on(tmp_path: Path) -> None:
    a_rec, b_rec = UpdateRecorder(), UpdateRecorder()
    with anyio.fail_after(10):
        async with (
            reference(tmp_path) as agent,
            client(agent, a_rec) as a,
            client(agent, b_rec) as b,
        ):
            sid = (await a.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
            await resume(b, sid)
            message_id = await prompt(b, sid, "hello")
            # a retry from the other connection is recognised there too (R33)
            assert await prompt(a, sid, "hello") == message_id
            for rec in (a_rec, b_rec):
                users = [
                    u["messageId"] for u in rec.updates if u["sessionUpdate"] == "user_message"
                ]
                assert users == [message_id]


async def test_concurrent_requests_with_one_new_key_insert_once(tmp_path: Path) -> None:
    answers: list[str] = []
    with anyio.fail_after(10):
        async with reference(tmp_path) as agent, client(agent) as conn:
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id

            async def one() -> None:
                answers.append(await prompt(conn, sid, "same"))

            async with anyio.create_task_group() as tg:
                for _ in range(50):
                    tg.start_soon(one)
            assert len(answers) == 50 and len(set(answers)) == 1
            assert await agent.store.count_user_messages(sid) == 1


async def test_held_prompt_coalesced_across_connections_withdrawn_by_either(tmp_path: Path) -> None:
    with anyio.fail_after(10):
        async with reference(tmp_path) as agent, client(agent) as a, client(agent) as b:
            sid = (await a.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
            await resume(b, sid)
            await prompt(a, sid, "busy [work:5]", key=None)
            original = await a.rpc.start_request("session/prompt", params(sid, "held"))
            retry = await b.rpc.start_request("session/prompt", params(sid, "held"))
            await retry.cancel()  # D7: the RFD says every pending request for the key
            for call in (original, retry):
                with pytest.raises(AcpError) as info:
                    await call.result()
                assert info.value.code == REQUEST_CANCELLED
            assert await agent.store.count_user_messages(sid, idempotency_key=KEY) == 0


async def test_held_prompt_of_a_dropped_connection_is_withdrawn_and_retry_inserts_once(
    tmp_path: Path,
) -> None:
    """D11: nobody is left to hear the answer, so the held prompt is dropped, key unused."""
    with anyio.fail_after(10):
        async with reference(tmp_path) as agent:
            async with client(agent) as a:
                sid = (await a.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
                await prompt(a, sid, "busy [work:0.5]", key=None)
                await a.rpc.start_request("session/prompt", params(sid, "held [tool]"))
            async with client(agent) as b:
                await resume(b, sid)
                first = await prompt(b, sid, "held [tool]")
                assert await prompt(b, sid, "held [tool]") == first
            assert await agent.store.count_user_messages(sid, idempotency_key=KEY) == 1


async def test_held_prompt_kept_while_a_waiter_remains_on_a_live_connection(tmp_path: Path) -> None:
    with anyio.fail_after(10):
        async with reference(tmp_path) as agent, client(agent) as b:
            async with client(agent) as a:
                sid = (await a.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
                await resume(b, sid)
                await prompt(a, sid, "busy [work:0.3]", key=None)
                await a.rpc.start_request("session/prompt", params(sid, "held"))
                retry = await b.rpc.start_request("session/prompt", params(sid, "held"))
            # connection a is gone; b still waits, so the prompt stays held and is inserted
            message_id = (await retry.result())["messageId"]
            assert await prompt(b, sid, "held") == message_id
            assert await agent.store.count_user_messages(sid, idempotency_key=KEY) == 1


async def test_a_stored_prompt_whose_connection_closes_before_its_answer_still_runs(
    tmp_path: Path,
) -> None:
    """R27: once inserting, insertion wins. The connection closes after the commit, while the
    handler waits in `after_insert` (the engine cancels a closed connection's handlers): the
    turn must run all the same, and a keyed retry elsewhere gets the stored id. Before the
    fix the message stayed stored with no turn, and the retry got its id as if all was well."""

    class Slow(ReferenceAgent):
        release = anyio.Event()
        stored = anyio.Event()
        finished = anyio.Event()
        ran: list[str]

        async def after_insert(self, session_id: str, message_id: str) -> None:
            self.stored.set()
            await self.release.wait()

        async def run_turn(self, turn: Turn, emit: TurnContext) -> StopReason | Extension:
            self.ran.append(turn.message_id)
            try:
                return await super().run_turn(turn, emit)
            finally:
                self.finished.set()

    with anyio.fail_after(10):
        async with MemoryStore() as store, Slow(store, side_effects=tmp_path / "fx") as agent:
            agent.ran = []
            agent.release, agent.stored, agent.finished = (
                anyio.Event(),
                anyio.Event(),
                anyio.Event(),
            )
            async with CutConnection(agent, agent.release.set) as first:
                sid = (await first.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
                await first.rpc.start_request("session/prompt", params(sid, "deploy [tool]"))
                await agent.stored.wait()
            # the connection was cut before the answer (its handler cancelled, then released)
            await agent.finished.wait()
            stored = await store.find_key(sid, KEY)
            assert stored is not None and agent.ran == [stored.message_id]
            agent.stored = anyio.Event()
            async with client(agent) as second:
                await resume(second, sid)
                assert await prompt(second, sid, "deploy [tool]") == stored.message_id
            assert await store.count_user_messages(sid) == 1
            assert (tmp_path / "fx" / f"{sid}.log").read_text().split() == [stored.message_id]


async def test_turns_dropped_by_a_close_whose_connection_closes_are_still_marked(
    tmp_path: Path,
) -> None:
    """session/close drops the turns not started yet and closes their markers; a request cut
    half-way must still close them all (an unmarked turn counts as interrupted, and a restart
    with `resume_interrupted` would run work the user cancelled)."""

    class SlowMarks(MemoryStore):
        marking = anyio.Event()
        release = anyio.Event()
        armed = False

        async def append_update(
            self, session_id: str, update: bytes, *, message_id: str | None = None
        ) -> int:
            seq = await super().append_update(session_id, update, message_id=message_id)
            if self.armed and b'"idle"' in update and not self.marking.is_set():
                self.marking.set()
                await self.release.wait()
            return seq

    with anyio.fail_after(10):
        async with (
            SlowMarks() as store,
            ReferenceAgent(store, side_effects=tmp_path / "fx", policy="steer") as agent,
        ):
            store.marking, store.release = anyio.Event(), anyio.Event()
            async with CutConnection(agent, store.release.set) as first:
                sid = (await first.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
                await prompt(first, sid, "long [work:5]", key=None)
                # steered in while the long turn runs: inserted, their turns not started
                queued = [await prompt(first, sid, f"next {i}", f"k{i}") for i in range(3)]
                store.armed = True
                await first.rpc.start_request("session/close", {"sessionId": sid})
                await store.marking.wait()
            # cut while the close marks the dropped turns
            tail = await store.read_timeline_tail(sid, limit=100)
            unfinished = [t.message_id for t in unfinished_turns(sid, tail)]
            assert not set(queued) & set(unfinished)


class FailingTurns(ReferenceAgent):
    """Every turn fails (no final emit: the worker ends it and marks it)."""

    async def run_turn(self, turn: Any, emit: Any) -> StopReason:
        raise RuntimeError("model unavailable")


async def test_turn_failure_after_insertion_is_an_error_stop_not_an_error_answer(
    tmp_path: Path,
) -> None:
    rec = UpdateRecorder()
    with anyio.fail_after(10):
        async with (
            MemoryStore() as store,
            session_on(tmp_path, store, rec, FailingTurns) as (conn, sid),
        ):
            message_id = await prompt(conn, sid, "hello")
            assert message_id.startswith("msg_user_")
            await rec.wait_for(lambda ups: any(u.get("stopReason") == "error" for u in ups))
            errors = [u for u in rec.updates if u.get("stopReason") == "error"]
            assert errors[0]["error"]["code"] == -32603


class LostAnswerStore(MemoryStore):
    """Stores the next user message, then fails as if its commit's answer was lost (PostgreSQL's
    connection cut at COMMIT): the message is stored, the caller hears an error."""

    lose_next = False

    async def insert_user_message(self, session_id: str, **fields: Any) -> InsertOutcome:
        outcome = await super().insert_user_message(session_id, **fields)
        if self.lose_next:
            self.lose_next = False
            raise StorageError("connection lost at COMMIT: it may or may not have been stored")
        return outcome


async def test_a_keyed_insert_whose_commit_answer_was_lost_is_answered_and_its_turn_runs(
    tmp_path: Path,
) -> None:
    """The store raised, but the message was stored: the runtime finds it (by its key, or
    unkeyed at the end of the timeline), answers the prompt with its id and runs its turn now,
    rather than answering an error and leaving the stored message's turn to the next recovery
    (a keyed retry would get the id meanwhile)."""
    rec = UpdateRecorder()
    with anyio.fail_after(10):
        async with LostAnswerStore() as store, session_on(tmp_path, store, rec) as (conn, sid):
            store.lose_next = True
            mid = await prompt(conn, sid, "deploy [tool]")
            stored = await store.find_key(sid, KEY)
            assert stored is not None and stored.message_id == mid
            await rec.wait_for(lambda ups: any(u.get("stopReason") == "end_turn" for u in ups))
            assert (tmp_path / "effects" / f"{sid}.log").read_text().split() == [mid]
            assert await prompt(conn, sid, "deploy [tool]") == mid  # a retry: nothing new
            assert await store.count_user_messages(sid) == 1
            # unkeyed, it is found at the end of the timeline
            store.lose_next = True
            other = await prompt(conn, sid, "no key [tool]", key=None)
            await rec.wait_for(lambda ups: sum(u.get("stopReason") == "end_turn" for u in ups) == 2)
            assert (tmp_path / "effects" / f"{sid}.log").read_text().split() == [mid, other]
            assert await store.count_user_messages(sid) == 2


async def test_an_insert_that_raised_and_stored_nothing_is_answered_with_an_error(
    tmp_path: Path,
) -> None:
    class Failing(MemoryStore):
        async def insert_user_message(self, session_id: str, **fields: Any) -> InsertOutcome:
            raise StorageError("the database is gone")

    with anyio.fail_after(10):
        async with Failing() as store, session_on(tmp_path, store) as (conn, sid):
            for key in (KEY, None):
                with pytest.raises(AcpError) as info:
                    await prompt(conn, sid, "deploy [tool]", key=key)
                assert info.value.code == INTERNAL_ERROR
            assert await store.count_user_messages(sid) == 0
            assert not (tmp_path / "effects" / f"{sid}.log").exists()


class MarkerFailsStore(MemoryStore):
    """Fails every write of a turn's end marker (the retained "idle" one)."""

    async def append_update(
        self, session_id: str, update: bytes, *, message_id: str | None = None
    ) -> int:
        if b'"acpOnce"' in update and b'"idle"' in update:  # a turn's end record
            raise StorageError("disk full")
        return await super().append_update(session_id, update, message_id=message_id)


async def test_a_store_failing_to_mark_a_turn_ended_does_not_stop_the_agent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The marker is written by the session's worker after the turn: its failure is logged and
    the turn left unmarked (a restart reports it interrupted); the agent, its connections and
    the session go on (it took the whole agent down)."""
    rec = UpdateRecorder()

    def stops(updates: list[dict[str, Any]]) -> int:
        return sum(1 for u in updates if u.get("stopReason") == "error")

    with anyio.fail_after(10):
        async with (
            MarkerFailsStore() as store,
            session_on(tmp_path, store, rec, FailingTurns) as (conn, sid),
        ):
            first = await prompt(conn, sid, "hello")
            await rec.wait_for(lambda ups: stops(ups) == 1)
            second = await prompt(conn, sid, "again", key="k2")
            await rec.wait_for(lambda ups: stops(ups) == 2)
            assert first != second
            assert await store.count_user_messages(sid) == 2
            tail = await store.read_timeline_tail(sid, limit=100)
            assert [t.message_id for t in unfinished_turns(sid, tail)] == [first, second]
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert f"session {sid}: the end of the turn of {first} was not stored (StorageError)" in logged


class GatedInsertStore(MemoryStore):
    """Holds the user message whose text is `gated` at its insert until `go` is set."""

    def __init__(self, gated: str) -> None:
        super().__init__()
        self.gated = gated
        self.reached = anyio.Event()
        self.go = anyio.Event()

    async def insert_user_message(self, session_id: str, **fields: Any) -> InsertOutcome:
        if self.gated.encode() in fields["update"]:
            self.reached.set()
            await self.go.wait()
        return await super().insert_user_message(session_id, **fields)


class HeldTurns(ReferenceAgent):
    """A turn whose prompt says "hold" runs until `release` is set."""

    release: anyio.Event

    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason | Extension:
        if "hold" in turn.text:
            await self.release.wait()
        return await super().run_turn(turn, ctx)


async def test_a_prompt_inserted_while_the_worker_waits_for_the_lock_still_runs(
    tmp_path: Path,
) -> None:
    """Steer policy: a prompt is being inserted (holding the session lock) when the running
    turn ends. The worker, out of turns, waits for the lock; the insert queues its turn and
    finds the worker already started. The worker must run that turn, not stop."""
    recorder = UpdateRecorder()
    store = GatedInsertStore("second")
    with anyio.fail_after(10):
        async with (
            store,
            HeldTurns(store, side_effects=tmp_path / "fx", policy="steer") as agent,
            client(agent, recorder) as conn,
        ):
            agent.release = anyio.Event()
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
            await prompt(conn, sid, "first hold", key=None)
            second = await conn.rpc.start_request("session/prompt", params(sid, "second"))
            await store.reached.wait()  # the second prompt's insert holds the lock
            agent.release.set()  # the first turn ends; its worker finds no turn and waits
            await recorder.wait_for(lambda ups: any(u.get("stopReason") for u in ups))
            store.go.set()
            message_id = (await second.result())["messageId"]
            await recorder.wait_for(
                lambda ups: sum(1 for u in ups if u.get("stopReason") == "end_turn") == 2
            )
            texts = [
                u["content"][0]["text"]
                for u in recorder.updates
                if u.get("sessionUpdate") == "agent_message"
            ]
            assert any("second" in t for t in texts), texts
            assert message_id in recorder.user_messages()


async def test_one_key_held_in_two_sessions_inserts_in_each(tmp_path: Path) -> None:
    """Keys are scoped per session (RFD): each session has its own table of pending keys.
    Trace (hold policy): a turn runs in each of two sessions; a prompt with key k is held in
    session a, then the same prompt with the same key in session b; the turns end. Property:
    b's prompt does not join a's: two inserts, one per session, two different message ids,
    and each session's key finds its own message."""
    with anyio.fail_after(10):
        async with (
            MemoryStore() as store,
            HeldTurns(store, side_effects=tmp_path / "fx") as agent,
            client(agent) as conn,
        ):
            agent.release = anyio.Event()
            a, b = [
                (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
                for _ in range(2)
            ]
            for sid in (a, b):
                await prompt(conn, sid, "busy hold", key=None)  # its turn runs until release
            held = {
                sid: await conn.rpc.start_request("session/prompt", params(sid, "same"))
                for sid in (a, b)
            }
            await anyio.wait_all_tasks_blocked()  # both held behind their session's turn
            agent.release.set()
            answers = {sid: str((await call.result())["messageId"]) for sid, call in held.items()}
            assert answers[a] != answers[b]
            for sid in (a, b):
                assert await store.count_user_messages(sid, idempotency_key=KEY) == 1
                found = await store.find_key(sid, KEY)
                assert found is not None and found.message_id == answers[sid]


async def test_one_live_only_key_in_two_sessions_runs_in_each(tmp_path: Path) -> None:
    """Keys are scoped per session (RFD): the keys of live-only commands (not stored, kept in
    memory while the session is active) too. Trace: `/status` with key k in session a, then
    in session b, then both again. Property: b's command is not answered from a's: two
    message ids, each retry answered with its own session's, and the command ran once in each
    session."""
    rec = UpdateRecorder()

    def ran(sid: str) -> int:
        return sum(
            1
            for n in rec.notifications
            if n["sessionId"] == sid
            and n["update"]["sessionUpdate"] == "agent_message"
            and n["update"]["content"][0]["text"] == "command /status done"
        )

    with anyio.fail_after(10):
        async with reference(tmp_path) as agent, client(agent, rec) as conn:
            a, b = [
                (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
                for _ in range(2)
            ]
            answers = {sid: await prompt(conn, sid, "/status") for sid in (a, b)}
            assert answers[a] != answers[b]
            for sid in (a, b):
                assert await prompt(conn, sid, "/status") == answers[sid]
            await rec.wait_for(lambda _: ran(a) >= 1 and ran(b) >= 1)
            assert (ran(a), ran(b)) == (1, 1)
            for sid in (a, b):
                assert await agent.store.count_user_messages(sid) == 0  # live-only: not stored


async def test_session_cancel_during_an_insert_answers_the_message_id(tmp_path: Path) -> None:
    """R27, insertion wins. Trace: a keyed prompt is inserted at once, and its insert waits in
    the store; session/cancel arrives and is handled; the insert goes on and commits.
    Property: the prompt is answered with its message id (an error would say the key is
    unused while its message is stored), the message is stored once, and a retry gets it."""
    store = GatedInsertStore("deploy")
    with anyio.fail_after(10):
        async with (
            store,
            ReferenceAgent(store, side_effects=tmp_path / "fx") as agent,
            client(agent) as conn,
        ):
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
            call = await conn.rpc.start_request("session/prompt", params(sid, "deploy"))
            await store.reached.wait()  # inserting: the store holds its insert
            await conn.agent.cancel(s.CancelSessionNotification(session_id=sid))
            await anyio.wait_all_tasks_blocked()  # the cancel was handled
            store.go.set()
            message_id = str((await call.result())["messageId"])
            assert await prompt(conn, sid, "deploy") == message_id
            assert await store.count_user_messages(sid, idempotency_key=KEY) == 1
            found = await store.find_key(sid, KEY)
            assert found is not None and found.message_id == message_id


async def test_session_cancel_during_the_insert_of_a_held_prompt_answers_its_id(
    tmp_path: Path,
) -> None:
    """R27, insertion wins, for a held prompt. Trace (hold policy): a turn runs; a keyed prompt
    is held behind it; the turn ends and the worker inserts the held prompt, whose insert waits
    in the store; session/cancel arrives and is handled; the insert goes on and commits.
    Property: the prompt is answered with its message id, not -32800; stored once; a retry
    gets the same id."""
    store = GatedInsertStore("second")
    with anyio.fail_after(10):
        async with (
            store,
            HeldTurns(store, side_effects=tmp_path / "fx") as agent,
            client(agent) as conn,
        ):
            agent.release = anyio.Event()
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
            await prompt(conn, sid, "first hold", key=None)  # its turn runs until release
            call = await conn.rpc.start_request("session/prompt", params(sid, "second"))
            await anyio.wait_all_tasks_blocked()  # held behind the running turn
            assert not store.reached.is_set()  # not inserting yet
            agent.release.set()  # the turn ends; the worker inserts the held prompt
            await store.reached.wait()
            await conn.agent.cancel(s.CancelSessionNotification(session_id=sid))
            await anyio.wait_all_tasks_blocked()  # the cancel was handled
            store.go.set()
            message_id = str((await call.result())["messageId"])
            assert await prompt(conn, sid, "second") == message_id
            assert await store.count_user_messages(sid, idempotency_key=KEY) == 1
            found = await store.find_key(sid, KEY)
            assert found is not None and found.message_id == message_id


async def test_a_notification_with_invalid_params_is_a_warning_not_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by the fuzz suite: `session/cancel` with a number as its sessionId was dropped,
    as it must be, but logged as an ERROR with the ValidationError's traceback."""
    with anyio.fail_after(10):
        async with reference(tmp_path) as agent, client(agent) as conn:
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
            await conn.rpc.notify("session/cancel", {"sessionId": 1.5})
            message_id = await prompt(conn, sid, "still here")
            assert message_id.startswith("msg_user_")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("invalid params" in r.getMessage() for r in caplog.records)


async def test_a_resend_of_a_used_key_covered_by_a_later_session_cancel_gets_its_id(
    tmp_path: Path,
) -> None:
    """Found by the agent model (mutant MARK_FIRST). A keyed prompt is inserted; its answer is
    lost; the client's resend of the key arrives, then a session/cancel on the same connection
    (the user pressed stop) that covers the resend. The resend must be answered with the id of
    the stored message: -32800 would tell the client the key is unused (R19), and a client
    that submits again under a new key would insert the prompt twice."""
    with anyio.fail_after(20):
        async with reference(tmp_path) as agent, client(agent) as conn:
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
            first = await prompt(conn, sid, "deploy")
            session = agent._sessions[sid]
            # the resend and the cancel are both in before the resend takes the session lock
            async with session.inbox.lock:
                resend = await conn.rpc.start_request("session/prompt", params(sid, "deploy"))
                await conn.rpc.notify("session/cancel", {"sessionId": sid})
                await until(lambda: bool(session.inbox.cancel_marks), interval=0.005)
            assert (await resend.result())["messageId"] == first
            # an unkeyed prompt it covers is still refused, and nothing new was stored
            async with session.inbox.lock:
                unkeyed = await conn.rpc.start_request("session/prompt", params(sid, "x", None))
                marks = dict(session.inbox.cancel_marks)
                await conn.rpc.notify("session/cancel", {"sessionId": sid})
                await until(lambda: session.inbox.cancel_marks != marks, interval=0.005)
            with pytest.raises(AcpError) as info:
                await unkeyed.result()
            assert info.value.code == REQUEST_CANCELLED
            assert await agent.store.count_user_messages(sid) == 1


class Gathered(ReferenceAgent):
    """Every turn waits until `want` turns run at once."""

    want: int
    running: int
    all_running: anyio.Event

    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason | Extension:
        self.running += 1
        if self.running == self.want:
            self.all_running.set()
        await self.all_running.wait()
        return await super().run_turn(turn, ctx)


def _parked(agent: ReferenceAgent) -> int:
    """How many turn workers wait for their next turn."""
    pool = agent._pool
    assert pool is not None
    return len(pool._idle)


def _turn_tasks() -> set[asyncio.Task[Any]]:
    return {task for task in asyncio.all_tasks() if task.get_name() == "turn"}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_turn_workers_of_many_busy_sessions_are_reused(tmp_path: Path) -> None:
    """Twenty sessions' turns at once, twice: the second wave runs in the tasks of the first
    (parked, not ended), so a server whose sessions all prompt starts no task per turn."""
    sessions = 20
    with anyio.fail_after(20):
        async with (
            MemoryStore() as store,
            Gathered(store, side_effects=tmp_path / "fx") as agent,
            client(agent) as conn,
        ):
            sids = [
                (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
                for _ in range(sessions)
            ]
            waves: list[set[asyncio.Task[Any]]] = []
            for wave in range(2):
                agent.want, agent.running, agent.all_running = sessions, 0, anyio.Event()
                async with anyio.create_task_group() as tg:
                    for sid in sids:
                        tg.start_soon(prompt, conn, sid, f"wave {wave}", f"{sid}-{wave}")
                await agent.all_running.wait()
                await until(lambda: _parked(agent) == sessions)
                waves.append(_turn_tasks())
            assert waves[0] == waves[1]
