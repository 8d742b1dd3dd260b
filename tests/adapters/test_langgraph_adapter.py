"""The LangGraph adapter: a crash after the thread stored the message, over real stdio and a real
SQLite checkpointer; the key cache's history reads, counted in-process; the thread's contents."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from langgraph.store.sqlite.aio import AsyncSqliteStore

from acp_once.adapters.langgraph import EXTRA_HINT, LangGraphAgent, LangGraphStore
from acp_once.agent.adapter import derive_message_id
from acp_once.agent.runtime import INTERRUPTED_MESSAGE
from acp_once.client import ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.protocol.errors import INVALID_PARAMS, REQUEST_CANCELLED, AcpError
from acp_once.rpc.errors import ConnectionClosed
from acp_once.storage.base import SessionMissing, SessionRecord, StorageError
from acp_once.testing import connected
from acp_once.transports.stdio import spawn
from tests.helpers import UpdateRecorder

pytestmark = pytest.mark.anyio

TIMEOUT = 60
S1 = SessionRecord("s1", "/w", (), None, 1.0, 1.0, None)  # a session of the directory tests
KEY = "5d0c1b7e-2f4a-4e8b-9c31-7a6e2d4f8b10"
INIT = {"protocolVersion": 2, "info": {"name": "tests", "version": "1"}}


class Env:
    def __init__(self, tmp: Path) -> None:
        self.db = tmp / "threads.sqlite3"
        self.effects = tmp / "effects"
        self.stderr = tmp / "agent.stderr"
        self.marker = tmp / "crashed-once"

    def command(self, *extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "acp_once",
            "agent",
            "--runtime",
            "langgraph",
            "--store",
            f"sqlite:{self.db}",
            "--side-effects",
            str(self.effects),
            *extra,
        ]

    def effect_lines(self, session_id: str) -> int:
        log = self.effects / f"{session_id}.log"
        return len(log.read_text().splitlines()) if log.exists() else 0

    @asynccontextmanager
    async def threads(self) -> AsyncIterator[LangGraphStore]:
        """The checkpointer's file opened by the test itself, to read what the agent stored."""
        async with LangGraphStore.open(f"sqlite:{self.db}") as store:
            yield store


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


@asynccontextmanager
async def stdio_agent(
    env: Env, *, crash: bool = False
) -> AsyncIterator[tuple[ClientSideConnection, UpdateRecorder]]:
    child_env = dict(os.environ)
    if crash:
        child_env["ACP_ONCE_CRASH"] = "after-insert"
        child_env["ACP_ONCE_CRASH_MARKER"] = str(env.marker)
    recorder = UpdateRecorder()
    with open(env.stderr, "ab") as errfile:  # noqa: ASYNC230 (opening a log file for the child)
        async with (
            spawn(env.command(), env=child_env, stderr=errfile.fileno()) as proc,
            ClientSideConnection(recorder, proc.frames) as conn,
        ):
            await conn.agent.initialize(s.InitializeRequest.model_validate(INIT))
            yield conn, recorder


def prompt_params(session_id: str, text: str, key: str | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}
    if key is not None:
        params["idempotencyKey"] = key
    return params


async def prompt(conn: ClientSideConnection, session_id: str, text: str, key: str | None) -> str:
    result = await conn.rpc.request("session/prompt", prompt_params(session_id, text, key))
    assert isinstance(result, dict)
    message_id = result["messageId"]
    assert isinstance(message_id, str)
    return message_id


async def resume(conn: ClientSideConnection, session_id: str, *, replay: bool = False) -> None:
    params: dict[str, Any] = {"sessionId": session_id, "cwd": "/tmp/project"}
    if replay:
        params["replayFrom"] = {"type": "start"}
    await conn.agent.resume_session(s.ResumeSessionRequest.model_validate(params))


async def checkpoints(store: LangGraphStore, session_id: str) -> int:
    config: Any = {"configurable": {"thread_id": session_id}}
    return len([c async for c in store.checkpointer.alist(config)])


# -- over stdio: the crash after the thread stored the message -------------------------------


@pytest.mark.slow
async def test_killed_after_the_thread_stored_the_message_the_retry_gets_the_same_id(
    env: Env,
) -> None:
    text = "migrate the database [tool]"
    with anyio.fail_after(TIMEOUT):
        async with stdio_agent(env) as (conn, rec):
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/tmp/project"))).session_id
            warmup = await prompt(conn, sid, "warm up", "warm-up-key")
            await rec.wait_for(lambda ups: any(u.get("stopReason") == "end_turn" for u in ups))
        # the agent stores the message in the LangGraph thread and dies (os._exit) before
        # anyone is answered and before the model answers
        async with stdio_agent(env, crash=True) as (conn, _):
            await resume(conn, sid)
            with pytest.raises(ConnectionClosed):
                await prompt(conn, sid, text, KEY)
        assert env.marker.exists()
        expected = derive_message_id(sid, KEY)
        async with env.threads() as threads:
            stored = await threads.thread_messages(sid)
        assert [m.id for m in stored if m.type == "human"] == [warmup, expected]
        assert stored[-1].type == "human"  # no answer: the process died first

        # restarted on the same checkpointer; the client resumes and retries with the key
        async with stdio_agent(env) as (conn, rec):
            await resume(conn, sid)
            state = [u for u in rec.updates if u["sessionUpdate"] == "state_update"][-1]
            assert state.get("stopReason") == "error"  # the interrupted turn, reported once
            assert state["error"]["message"] == INTERRUPTED_MESSAGE
            async with env.threads() as threads:
                before = await checkpoints(threads, sid)
            again = await prompt(conn, sid, text, KEY)
            assert again == expected
            assert rec.user_messages() == []  # nothing new announced (D8)
            # a fresh key on the same connection still inserts, and its turn runs
            fresh = await prompt(conn, sid, "after the crash", "a-fresh-key")
            await rec.wait_for(lambda ups: any(u.get("stopReason") == "end_turn" for u in ups))
        async with env.threads() as threads:
            stored = await threads.thread_messages(sid)
            after = await checkpoints(threads, sid)
    human = [m.id for m in stored if m.type == "human"]
    assert human.count(expected) == 1
    assert human == [warmup, expected, fresh]
    # the retry wrote nothing: only the fresh prompt's message, its answer, its end record
    assert after - before == 3
    answers = [m for m in stored if m.type == "ai"]
    assert [a.text for a in answers] == ["warm up", "after the crash"]  # the fake model echoes
    assert env.effect_lines(sid) == 0  # the retry started no second round of work (R21)


async def test_a_missing_extra_names_the_install_command(tmp_path: Path) -> None:
    blocker = (
        "import sys\n"
        "sys.modules['langgraph'] = None\n"  # as if the extra were not installed
        "sys.argv = ['acp-once', 'agent', '--runtime', 'langgraph', '--store', 'memory:']\n"
        "from acp_once.cli.app import main\n"
        "main()\n"
    )
    with anyio.fail_after(TIMEOUT):
        done = await anyio.run_process(
            [sys.executable, "-c", blocker], check=False, stdin=subprocess.DEVNULL
        )
    assert done.returncode == 2
    assert "pip install 'acp-once[langgraph]'" in done.stderr.decode()
    assert "pip install 'acp-once[langgraph]'" in EXTRA_HINT


# -- in-process (a real SQLite checkpointer file): the cache's history reads ------------------


@asynccontextmanager
async def in_process(db: Path, effects: Path) -> AsyncIterator[LangGraphAgent]:
    """One agent process: a new store object on the same file is a restart."""
    async with (
        LangGraphStore.open(f"sqlite:{db}") as threads,
        LangGraphAgent(threads, side_effects=effects) as agent,
    ):
        yield agent


@asynccontextmanager
async def client_of(
    agent: LangGraphAgent, recorder: UpdateRecorder | None = None
) -> AsyncIterator[ClientSideConnection]:
    async with connected(agent, recorder or UpdateRecorder()) as conn:
        await conn.agent.initialize(s.InitializeRequest.model_validate(INIT))
        yield conn


async def new_session(conn: ClientSideConnection) -> str:
    return (await conn.agent.new_session(s.NewSessionRequest(cwd="/tmp/project"))).session_id


async def test_the_cache_is_filled_once_per_session_and_retries_do_not_read_again(
    tmp_path: Path,
) -> None:
    db, effects = tmp_path / "threads.sqlite3", tmp_path / "effects"
    with anyio.fail_after(TIMEOUT):
        async with in_process(db, effects) as agent, client_of(agent) as conn:
            sid, other = await new_session(conn), await new_session(conn)
            old = [await prompt(conn, sid, f"before {i}", f"old-{i}") for i in range(3)]
            await prompt(conn, other, "in the other session", "old-0")
            # new sessions were empty: the first keyed prompt read an empty history once
            assert agent.threads.history_reads == {sid: 1, other: 1}

        async with in_process(db, effects) as agent, client_of(agent) as conn:
            reads = agent.threads.history_reads
            await resume(conn, sid)
            assert reads[sid] == 0  # resuming reads no key history
            first = await prompt(conn, sid, "after restart", "new-1")
            assert reads[sid] == 1  # the first keyed prompt after the restart fills the cache
            assert await prompt(conn, sid, "before 1", "old-1") == old[1]  # found in it
            assert await prompt(conn, sid, "after restart", "new-1") == first  # added on insert
            await prompt(conn, sid, "another", "new-2")
            await prompt(conn, sid, "no key", None)
            assert reads[sid] == 1  # retries and new prompts after the fill: no second read
            assert reads[other] == 0  # per session
            await resume(conn, other)
            # two first keyed prompts at once share one read
            async with anyio.create_task_group() as tg:
                for i in range(2):
                    tg.start_soon(prompt, conn, other, f"concurrent {i}", f"c-{i}")
            assert reads[other] == 1
            stored = await agent.threads.thread_messages(sid)
    human = [m.id for m in stored if m.type == "human"]
    assert human[:4] == [*old, first]
    assert len(human) == len(set(human)) == 6


async def test_a_replay_from_the_start_fills_the_cache_without_another_read(
    tmp_path: Path,
) -> None:
    db, effects = tmp_path / "threads.sqlite3", tmp_path / "effects"
    with anyio.fail_after(TIMEOUT):
        async with in_process(db, effects) as agent, client_of(agent) as conn:
            sid = await new_session(conn)
            first = await prompt(conn, sid, "hello", KEY)
        async with in_process(db, effects) as agent, client_of(agent) as conn:
            await resume(conn, sid, replay=True)
            assert await prompt(conn, sid, "hello", KEY) == first
            assert agent.threads.history_reads[sid] == 0


async def test_the_thread_holds_langchain_messages_with_the_derived_ids(tmp_path: Path) -> None:
    db, effects = tmp_path / "threads.sqlite3", tmp_path / "effects"
    recorder = UpdateRecorder()
    with anyio.fail_after(TIMEOUT):
        async with in_process(db, effects) as agent, client_of(agent, recorder) as conn:
            sid = await new_session(conn)
            keyed = await prompt(conn, sid, "echo me [tool]", KEY)
            plain = await prompt(conn, sid, "and me", None)
            live = await prompt(conn, sid, "/status", "live-key")
            assert await prompt(conn, sid, "/status", "live-key") == live
            await recorder.wait_for(
                lambda ups: sum(u.get("sessionUpdate") == "agent_message" for u in ups) == 3
            )
            stored = await agent.threads.thread_messages(sid)
    assert keyed == derive_message_id(sid, KEY)
    assert plain != keyed
    # announced under the ids the prompts were answered with; the command is live only
    assert recorder.user_messages() == [keyed, plain, live]
    assert [(m.type, m.text) for m in stored] == [
        ("human", "echo me [tool]"),
        ("ai", "echo me [tool]"),
        ("human", "and me"),
        ("ai", "and me"),
    ]
    assert [m.id for m in stored if m.type == "human"] == [keyed, plain]
    assert effects.joinpath(f"{sid}.log").read_text().split() == [keyed]


async def test_steered_prompts_during_a_turn_lose_no_write(tmp_path: Path) -> None:
    """A LangGraph thread has one writer at a time: prompts stored while the turn's graph runs
    must all survive (two writers from one checkpoint would drop one of them)."""
    recorder = UpdateRecorder()
    with anyio.fail_after(TIMEOUT):
        async with (
            LangGraphStore.open(f"sqlite:{tmp_path / 'threads.sqlite3'}") as threads,
            LangGraphAgent(threads, side_effects=tmp_path / "effects", policy="steer") as agent,
            client_of(agent, recorder) as conn,
        ):
            sid = await new_session(conn)
            await prompt(conn, sid, "long [work:0.5]", None)
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(prompt, conn, sid, f"steered {i}", f"k-{i}")
            await recorder.wait_for(
                lambda ups: (
                    sum(u["sessionUpdate"] == "agent_message" for u in ups) == 9
                    and ups[-1].get("state") == "idle"
                )
            )
            stored = await threads.thread_messages(sid)
            tail = await threads.read_timeline_tail(sid, limit=100)
    assert sum(m.type == "human" for m in stored) == 9
    assert sum(m.type == "ai" for m in stored) == 9
    ends = [e for e in tail if b'"acpOnce"' in e.update]
    assert len(ends) == 9  # every turn stored its end record (A10)
    assert [e.seq for e in tail] == list(range(1, len(tail) + 1))


async def test_an_insert_whose_caller_is_cancelled_still_returns_its_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`SessionStore.insert_user_message`: a caller cancelled while the thread is written
    learns that it was (else the runtime would never start the message's turn)."""
    written, release = anyio.Event(), anyio.Event()
    async with LangGraphStore.open("memory:") as threads:
        await threads.create_session(SessionRecord("s1", "/w", (), None, 1.0, 1.0))
        real = threads.graph.aupdate_state

        async def slow_update(*args: Any, **kwargs: Any) -> Any:
            result = await real(*args, **kwargs)
            written.set()
            await release.wait()  # the write is done; its acknowledgement is slow
            return result

        monkeypatch.setattr(threads.graph, "aupdate_state", slow_update)
        scope = anyio.CancelScope()
        outcomes: list[Any] = []

        async def victim() -> None:
            with scope:
                update = orjson.dumps({"content": [{"type": "text", "text": "hi"}]})
                outcomes.append(
                    await threads.insert_user_message(
                        "s1",
                        message_id="m1",
                        update=update,
                        idempotency_key=KEY,
                        prompt_digest=None,
                    )
                )
                await anyio.sleep_forever()  # the cancellation lands here

        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(victim)
                await written.wait()
                scope.cancel()
                await anyio.wait_all_tasks_blocked()
                assert outcomes == []  # still finishing the insert, not abandoned
                release.set()
        assert scope.cancelled_caught
        assert [o.inserted for o in outcomes] == [True]
        assert outcomes[0].message_id == derive_message_id("s1", KEY)


async def test_the_memory_runtime_and_session_management(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            LangGraphStore.open("memory:") as threads,
            LangGraphAgent(threads, side_effects=tmp_path / "effects") as agent,
            client_of(agent) as conn,
        ):
            sid = await new_session(conn)
            first = await prompt(conn, sid, "hi", KEY)
            fork = await conn.agent.fork_session(
                s.ForkSessionRequest(session_id=sid, cwd="/tmp/project")
            )
            in_fork = await prompt(conn, fork.session_id, "hi", KEY)
            assert in_fork == derive_message_id(fork.session_id, KEY) != first
            assert await threads.count_user_messages(fork.session_id) == 2
            listed = await conn.agent.list_sessions(s.ListSessionsRequest(cwd="/tmp/project"))
            assert {x.session_id for x in listed.sessions} == {sid, fork.session_id}
            await conn.agent.delete_session(s.DeleteSessionRequest(session_id=sid))
            assert await threads.thread_messages(sid) == []
            assert await threads.get_session(sid) is None
            listed = await conn.agent.list_sessions(s.ListSessionsRequest())
            assert [x.session_id for x in listed.sessions] == [fork.session_id]
    with pytest.raises(ValueError):
        async with LangGraphStore.open("postgresql://nowhere"):
            pass


@pytest.mark.slow
async def test_probes_over_stdio_commands_cancel_and_privacy(env: Env) -> None:
    secret = "SECRET-KEY-7c2e91"
    with anyio.fail_after(TIMEOUT):
        async with stdio_agent(env) as (conn, rec):
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/tmp/project"))).session_id
            # a locally handled command: live only, its key remembered while the session is active
            live = await prompt(conn, sid, "/status", secret + "-live")
            assert await prompt(conn, sid, "/status", secret + "-live") == live
            # a held prompt refused by session/cancel leaves its key unused (T5)
            await prompt(conn, sid, "long [work:5]", None)
            held = await conn.rpc.start_request(
                "session/prompt", prompt_params(sid, "held [tool]", secret + "-held")
            )
            await conn.agent.cancel(s.CancelSessionNotification(session_id=sid))
            with pytest.raises(AcpError) as info:
                await held.result()
            assert info.value.code == REQUEST_CANCELLED
            inserted = await prompt(conn, sid, "held [tool]", secret + "-held")
            assert await prompt(conn, sid, "held [tool]", secret + "-held") == inserted
            await rec.wait_for(lambda ups: any(u.get("status") == "completed" for u in ups))
            # an invalid key is refused and inserts nothing
            with pytest.raises(AcpError) as info:
                bad = {**prompt_params(sid, "x"), "idempotencyKey": ""}
                await conn.rpc.request("session/prompt", bad)
            assert info.value.code == INVALID_PARAMS
            await conn.agent.list_sessions(s.ListSessionsRequest())
        async with stdio_agent(env) as (conn, rec):
            await resume(conn, sid, replay=True)
            replayed = rec.user_messages()
            assert live not in replayed  # not retained
            assert await prompt(conn, sid, "held [tool]", secret + "-held") == inserted
            frames = orjson.dumps(rec.notifications)
    assert inserted == derive_message_id(sid, secret + "-held")
    assert replayed.count(inserted) == 1
    assert secret.encode() not in frames
    assert secret not in env.stderr.read_text()
    assert env.effect_lines(sid) == 1
    async with env.threads() as threads:
        assert await threads.count_user_messages(sid, idempotency_key=secret + "-held") == 1
        assert await threads.count_user_messages(sid) == 2


@pytest.mark.parametrize("url", ["memory:", "sqlite"])
async def test_the_timeline_interleaves_messages_and_events_in_order(
    tmp_path: Path, url: str
) -> None:
    if url == "sqlite":
        url = f"sqlite:{tmp_path / 'threads.sqlite3'}"
    with anyio.fail_after(TIMEOUT):
        async with LangGraphStore.open(url) as store:
            await store.create_session(SessionRecord("sess_t", "/tmp", (), None, 1.0, 1.0))

            def user(text: str) -> bytes:
                content = [{"type": "text", "text": text}]
                return orjson.dumps({"sessionUpdate": "user_message", "content": content})

            first = await store.insert_user_message(
                "sess_t",
                message_id="p1",
                update=user("one"),
                idempotency_key=KEY,
                prompt_digest=b"d",
            )
            marker = orjson.dumps({"sessionUpdate": "_acp_once_turn", "state": "idle"})
            assert await store.append_update("sess_t", marker) == 2
            answer = {
                "sessionUpdate": "agent_message",
                "messageId": "a1",
                "content": [{"type": "text", "text": "reply"}],
            }
            assert await store.append_update("sess_t", orjson.dumps(answer), message_id="a1") == 3
            retry = await store.insert_user_message(
                "sess_t",
                message_id="p2",
                update=user("one"),
                idempotency_key=KEY,
                prompt_digest=b"d",
            )
            second = await store.insert_user_message(
                "sess_t",
                message_id="p3",
                update=user("two"),
                idempotency_key=None,
                prompt_digest=None,
            )
            timeline = await store.read_timeline("sess_t")
            page = await store.read_timeline("sess_t", after_seq=2, limit=1)
            with pytest.raises(SessionMissing):
                await store.append_update("sess_missing", marker)
            assert (await store.find_key("sess_t", KEY)) is not None
            assert await store.find_key("sess_t", "unused") is None
            record = await store.get_session("sess_t")
    assert first.inserted and first.message_id == derive_message_id("sess_t", KEY)
    assert not retry.inserted and retry.message_id == first.message_id
    assert second.inserted and second.message_id not in ("p3", first.message_id)
    kinds = [orjson.loads(e.update)["sessionUpdate"] for e in timeline]
    assert kinds == ["user_message", "_acp_once_turn", "agent_message", "user_message"]
    assert [e.seq for e in timeline] == [1, 2, 3, 4]
    assert [e.message_id for e in timeline] == [first.message_id, None, "a1", second.message_id]
    assert orjson.loads(timeline[0].update)["content"] == [{"type": "text", "text": "one"}]
    assert [e.seq for e in page] == [3]
    assert record is not None and record.updated_at > 1.0  # every write bumps it


async def test_a_directory_read_and_write_that_meet_never_fail_on_sqlites_write_lock(
    tmp_path: Path,
) -> None:
    """LangGraph's store runs operations that callers start together as one transaction, reads
    first. When another connection to the file committed after those reads, the transaction
    could not become a writer and failed at once with "database is locked" (a -32603 seen in
    CI). Each directory operation is now its own transaction, and a write starts as a writer."""
    db = tmp_path / "threads.sqlite3"
    with anyio.fail_after(TIMEOUT):
        async with LangGraphStore.open(f"sqlite:{db}") as threads:
            await threads.create_session(S1)
            await threads.create_session(dataclasses.replace(S1, session_id="s2"))
            # another writer (the checkpointer's connection, say) has written, not committed
            other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
            other.execute("BEGIN IMMEDIATE")
            other.execute("CREATE TABLE other_writer (x)")

            def commit_at_first_write(statement: str) -> None:
                # called on the store's connection as a statement starts: the other writer
                # commits just before the directory's first write
                if other.in_transaction and statement.lstrip().upper().startswith("INSERT"):
                    other.execute("COMMIT")

            assert isinstance(threads.directory, AsyncSqliteStore)
            await threads.directory.conn.set_trace_callback(commit_at_first_write)
            seen: list[str | None] = []

            async def reads() -> None:
                for _ in range(2):  # the second starts together with update_session's write
                    found = await threads.get_session("s2")
                    seen.append(None if found is None else found.session_id)

            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(functools.partial(threads.update_session, "s1", title="t"))
                    tg.start_soon(reads)
            finally:
                other.close()
            assert seen == ["s2", "s2"]
            updated = await threads.get_session("s1")
            assert updated is not None and updated.title == "t"


async def test_a_directory_operation_whose_caller_is_cancelled_leaves_the_store_usable(
    tmp_path: Path,
) -> None:
    """A caller cancelled just as its directory read began its transaction (a turn cancelled
    mid-step): the read completes, so the connection is not left inside a transaction that
    fails every later operation ("cannot start a transaction within a transaction")."""
    db = tmp_path / "threads.sqlite3"
    with anyio.fail_after(TIMEOUT):
        async with LangGraphStore.open(f"sqlite:{db}") as threads:
            await threads.create_session(S1)
            assert isinstance(threads.directory, AsyncSqliteStore)
            loop = asyncio.get_running_loop()
            with anyio.CancelScope() as scope:

                def cancel_at_begin(statement: str) -> None:
                    if statement.strip().upper() == "BEGIN":  # on the store's own thread
                        loop.call_soon_threadsafe(scope.cancel)

                await threads.directory.conn.set_trace_callback(cancel_at_begin)
                await threads.get_session("s1")
                await anyio.sleep_forever()  # the cancel reaches us at the latest here
            await threads.directory.conn.set_trace_callback(lambda statement: None)
            assert scope.cancel_called
            await threads.update_session("s1", title="t")
            updated = await threads.get_session("s1")
            assert updated is not None and updated.title == "t"


async def test_sqlite_failures_reach_callers_as_storage_errors(tmp_path: Path) -> None:
    """The store interface promises `StorageError`: LangGraph's SQLite parts raise
    `sqlite3.Error`, which the adapter turns into one, without the values it was given."""
    db = tmp_path / "threads.sqlite3"
    with anyio.fail_after(TIMEOUT):
        async with LangGraphStore.open(f"sqlite:{db}") as threads:
            await threads.create_session(S1)
            secret = orjson.dumps({"sessionUpdate": "user_message", "content": []})
            await threads.insert_user_message(
                "s1",
                message_id="m1",
                update=secret,
                idempotency_key="private-key-1",
                prompt_digest=None,
            )
            other = sqlite3.connect(db, isolation_level=None)
            try:
                other.execute("DROP TABLE checkpoints")  # the thread's history is gone
                with pytest.raises(StorageError) as lost_thread:
                    await threads.read_timeline("s1")
                with pytest.raises(StorageError) as lost_insert:
                    await threads.insert_user_message(
                        "s1",
                        message_id="m2",
                        update=secret,
                        idempotency_key="private-key-2",
                        prompt_digest=None,
                    )
                other.execute("DROP TABLE store")  # and the session directory
                with pytest.raises(StorageError) as lost_directory:
                    await threads.get_session("s1")
            finally:
                other.close()
    assert "no such table: checkpoints" in str(lost_thread.value)
    assert "no such table: store" in str(lost_directory.value)
    assert "s1" not in str(lost_directory.value)  # LangGraph's own error quotes the query's values
    assert "private-key" not in str(lost_insert.value)
