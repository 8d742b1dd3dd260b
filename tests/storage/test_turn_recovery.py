"""The turn's life on real stores (SQLite files, PostgreSQL): end records and recovery.

Each test builds the state a process left behind (a user message with its key and no end
record: the process died mid-turn) or runs real turns, then starts fresh agents on the same
store and checks what they store, run and replay (A3, A10). These are the deterministic tests
of the code mutants of `verification/turns.pml` (verification/mutants/turns.toml).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from acp_once.agent import Extension, StopReason
from acp_once.agent.reference import ReferenceAgent
from acp_once.agent.runtime import INTERRUPTED_MESSAGE, Turn, TurnContext
from acp_once.agent.state import (
    QUEUED,
    RERUN,
    STARTED,
    TURN_MARKER,
    marker,
    new_id,
    wire_digest,
)
from acp_once.client import ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.storage import SessionStore, SqliteStore
from acp_once.storage.base import SessionRecord
from acp_once.storage.postgres import PostgresStore
from acp_once.testing import connected
from tests.helpers import UpdateRecorder, initialize_request

pytestmark = pytest.mark.anyio

KEY = "turn-recovery-key"
TIMEOUT = 20

Opener = Callable[[], AbstractAsyncContextManager[SessionStore]]


@pytest.fixture(params=["sqlite", "postgres"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """Opens the same store again at each call (a restarted process)."""
    if request.param == "sqlite":
        return lambda: SqliteStore.open(tmp_path / "sessions.db")
    dsn: str = request.getfixturevalue("postgres_dsn")
    schema = request.getfixturevalue("new_schema")()
    return lambda: PostgresStore.open(dsn, schema=schema)


class Counting(ReferenceAgent):
    """The reference agent, recording each turn it starts and whether its message's "run
    again" marker was stored by then."""

    def __init__(self, store: SessionStore, *, side_effects: Path, **kw: Any) -> None:
        super().__init__(store, side_effects=side_effects, **kw)
        self.started: list[str] = []
        self.marked_before: list[bool] = []
        self.started_marked: list[bool] = []
        self.release = anyio.Event()

    async def run_turn(self, turn: Turn, emit: TurnContext) -> StopReason | Extension:
        self.started.append(turn.message_id)
        tail = await self.store.read_timeline_tail(turn.session_id, limit=50)
        stored = [e.update for e in tail]
        self.marked_before.append(marker(RERUN, turn.message_id) in stored)
        self.started_marked.append(marker(STARTED, turn.message_id) in stored)
        if "hold" in turn.text:
            await self.release.wait()
        return await super().run_turn(turn, emit)


@asynccontextmanager
async def fresh(
    store: SessionStore, tmp_path: Path, **kw: Any
) -> AsyncIterator[tuple[Counting, ClientSideConnection, UpdateRecorder]]:
    recorder = UpdateRecorder()
    async with (
        Counting(store, side_effects=tmp_path / "effects", **kw) as agent,
        connected(agent, recorder) as conn,
    ):
        await conn.agent.initialize(initialize_request("t"))
        yield agent, conn, recorder


async def resume_replaying(conn: ClientSideConnection, sid: str) -> None:
    await conn.agent.resume_session(
        s.ResumeSessionRequest.model_validate(
            {"sessionId": sid, "cwd": "/w", "replayFrom": {"type": "start"}}
        )
    )


async def left_mid_turn(
    store: SessionStore, text: str, *, reran: bool = False, markers: tuple[str, ...] = ()
) -> tuple[str, str]:
    """A session whose process died during the turn of its one message (after running it
    again once, with `reran`; with the other `markers` its turn had): the message and its key
    stored, no end record."""
    now = time.time()
    sid = new_id("sess")
    await store.create_session(SessionRecord(sid, "/w", (), None, now, now))
    mid = new_id("msg_user")
    content = [{"type": "text", "text": text}]
    update = {"sessionUpdate": "user_message", "messageId": mid, "content": content}
    await store.insert_user_message(
        sid,
        message_id=mid,
        update=orjson.dumps(update),
        idempotency_key=KEY,
        prompt_digest=wire_digest(content),
    )
    for state in (RERUN,) * reran + markers:
        await store.append_update(sid, marker(state, mid))
    return sid, mid


def end(message_id: str, reason: str = "end_turn") -> dict[str, Any]:
    record: dict[str, Any] = {"sessionUpdate": "state_update", "state": "idle"}
    record["stopReason"] = reason
    if reason == "error":
        record["error"] = {"code": -32603, "message": INTERRUPTED_MESSAGE}
    record["_meta"] = {"acpOnce": {"messageId": message_id}}
    return record


async def stored_ends(store: SessionStore, sid: str) -> list[dict[str, Any]]:
    updates = [orjson.loads(e.update) for e in await store.read_timeline(sid)]
    return [u for u in updates if u["sessionUpdate"] == "state_update"]


def ends_seen(recorder: UpdateRecorder) -> list[dict[str, Any]]:
    return [u for u in recorder.updates if u["sessionUpdate"] == "state_update" and "_meta" in u]


async def test_report_stores_the_interrupted_end_once_and_every_resume_replays_it(
    opener: Opener, tmp_path: Path
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with opener() as store:
            sid, mid = await left_mid_turn(store, "deploy [tool]")
        for _ in range(3):  # three restarts
            async with opener() as store, fresh(store, tmp_path) as (agent, conn, rec):
                await resume_replaying(conn, sid)
                kinds = [u["sessionUpdate"] for u in rec.updates]
                assert kinds == ["user_message", "state_update", "state_update"]
                assert rec.updates[1:] == [end(mid, "error"), end(mid, "error")]
                assert agent.started == []  # report: never run again
                assert await stored_ends(store, sid) == [end(mid, "error")]


async def test_continue_runs_an_unfinished_turn_again_after_storing_its_marker(
    opener: Opener, tmp_path: Path
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with opener() as store:
            sid, mid = await left_mid_turn(store, "deploy [tool]")
        async with (
            opener() as store,
            fresh(store, tmp_path, resume_interrupted=True) as (agent, conn, rec),
        ):
            await resume_replaying(conn, sid)
            await rec.wait_for(lambda ups: end(mid) in ups)
            assert agent.started == [mid]
            assert agent.marked_before == [True]  # at most once: the marker came first
        async with opener() as store, fresh(store, tmp_path, resume_interrupted=True) as again:
            await resume_replaying(again[1], sid)
            assert again[0].started == []  # it ended: never run again
            assert await stored_ends(store, sid) == [end(mid)]
            timeline = [orjson.loads(e.update) for e in await store.read_timeline(sid)]
    markers = [u for u in timeline if u["sessionUpdate"] == TURN_MARKER]
    assert markers == [{"sessionUpdate": TURN_MARKER, "state": RERUN, "messageId": mid}]
    assert (tmp_path / "effects" / f"{sid}.log").read_text().split() == [mid]


async def test_continue_reports_a_turn_that_already_ran_again_once(
    opener: Opener, tmp_path: Path
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with opener() as store:
            sid, mid = await left_mid_turn(store, "deploy [tool]", reran=True)
        async with (
            opener() as store,
            fresh(store, tmp_path, resume_interrupted=True) as (agent, conn, rec),
        ):
            await resume_replaying(conn, sid)
            assert agent.started == []
            assert ends_seen(rec) == [end(mid, "error"), end(mid, "error")]
            assert await stored_ends(store, sid) == [end(mid, "error")]


@pytest.mark.parametrize("interrupted", ["report", "continue"])
async def test_a_turn_that_ended_is_neither_reported_nor_run_again(
    opener: Opener, tmp_path: Path, interrupted: str
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with opener() as store, fresh(store, tmp_path) as (_, conn, rec):
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
            params = {"sessionId": sid, "prompt": [{"type": "text", "text": "deploy [tool]"}]}
            mid = (await conn.rpc.request("session/prompt", params))["messageId"]
            await rec.wait_for(lambda ups: end(mid) in ups)
        rerun = interrupted == "continue"
        async with opener() as store, fresh(store, tmp_path, resume_interrupted=rerun) as again:
            await resume_replaying(again[1], sid)
            assert again[0].started == []
            assert ends_seen(again[2]) == [end(mid), end(mid)]  # replayed, then the snapshot
            assert await stored_ends(store, sid) == [end(mid)]
    assert (tmp_path / "effects" / f"{sid}.log").read_text().split() == [mid]


async def test_a_cancel_ends_the_running_turn_then_each_queued_one_that_never_runs(
    opener: Opener, tmp_path: Path
) -> None:
    """Steer policy: two prompts inserted during a turn, queued; `session/cancel` ends the
    running turn `cancelled`, then the two queued ones, each once, live and in the store, and
    neither runs afterwards (A10, R57)."""
    with anyio.fail_after(TIMEOUT):
        async with opener() as store:
            async with fresh(store, tmp_path, policy="steer") as (agent, conn, rec):
                sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id

                async def send(text: str) -> str:
                    params = {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}
                    return str((await conn.rpc.request("session/prompt", params))["messageId"])

                ids = [await send("hold")]
                await rec.wait_for(lambda ups: any(u.get("state") == "running" for u in ups))
                ids += [await send("queued 1"), await send("queued 2")]
                await conn.agent.cancel(s.CancelSessionNotification(session_id=sid))
                expected = [end(mid, "cancelled") for mid in ids]
                await rec.wait_for(lambda ups: len(ends_seen(rec)) >= 3)
                assert ends_seen(rec) == expected
                # a later turn runs, and the dropped ones stay dropped
                later = await send("later")
                await rec.wait_for(lambda ups: end(later) in ups)
                assert agent.started == [ids[0], later]
                assert await stored_ends(store, sid) == [*expected, end(later)]
            # a restart finds nothing unfinished
            async with fresh(store, tmp_path, resume_interrupted=True) as again:
                await resume_replaying(again[1], sid)
                assert again[0].started == []
                assert await stored_ends(store, sid) == [*expected, end(later)]


@pytest.mark.parametrize("started", [False, True], ids=["queued", "queued-then-started"])
async def test_a_queued_turn_that_never_started_is_simply_run_after_a_restart(
    opener: Opener, tmp_path: Path, started: bool
) -> None:
    """Its QUEUED marker without a STARTED one: the process died before the turn started, so
    even the report policy runs it (nothing ran); with its STARTED marker it is reported."""
    markers = (QUEUED, STARTED) if started else (QUEUED,)
    with anyio.fail_after(TIMEOUT):
        async with opener() as store:
            sid, mid = await left_mid_turn(store, "deploy [tool]", markers=markers)
        async with opener() as store, fresh(store, tmp_path) as (agent, conn, rec):
            await resume_replaying(conn, sid)
            if started:
                assert agent.started == []
                assert await stored_ends(store, sid) == [end(mid, "error")]
            else:
                await rec.wait_for(lambda ups: end(mid) in ups)
                assert agent.started == [mid]
                assert agent.started_marked == [True]  # stored before it ran
                assert await stored_ends(store, sid) == [end(mid)]


async def test_a_turn_inserted_behind_another_is_marked_queued_then_started(
    opener: Opener, tmp_path: Path
) -> None:
    """Steer policy: a prompt inserted while a turn runs gets its QUEUED marker; its STARTED
    marker is stored before its turn runs. The first turn, which started at once, has
    neither."""
    with anyio.fail_after(TIMEOUT):
        async with opener() as store, fresh(store, tmp_path, policy="steer") as (agent, conn, rec):
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id

            async def send(text: str) -> str:
                params = {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}
                return str((await conn.rpc.request("session/prompt", params))["messageId"])

            first = await send("hold")
            await rec.wait_for(lambda ups: any(u.get("state") == "running" for u in ups))
            second = await send("queued")
            agent.release.set()
            await rec.wait_for(lambda ups: end(second) in ups)
            assert agent.started == [first, second]
            assert agent.started_marked == [False, True]
            timeline = [orjson.loads(e.update) for e in await store.read_timeline(sid)]
    markers = [(u["state"], u["messageId"]) for u in timeline if u["sessionUpdate"] == TURN_MARKER]
    assert markers == [(QUEUED, second), (STARTED, second)]


def test_new_ids_are_unique_across_threads_and_in_a_forked_child() -> None:
    import multiprocessing
    import threading

    ids: list[str] = []

    def make() -> None:
        ids.extend(new_id("msg_user") for _ in range(2_000))

    threads = [threading.Thread(target=make) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(ids) == 8_000 and len(set(ids)) == 8_000
    assert all(len(i) == len("msg_user_") + 32 for i in ids)
    # a forked child does not hand out what the parent has yet to hand out
    new_id("msg_user")  # the parent holds unused random bytes
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        child = pool.apply(new_id, ("msg_user",))
    assert child != new_id("msg_user")
