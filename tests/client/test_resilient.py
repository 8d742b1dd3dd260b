"""`AcpClient` against the reference agent over real stdio with its SQLite store."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from acp_once.client import AcpClient, OutcomeUnknown, PromptCancelled, StdioLauncher
from acp_once.client.outbox import open_outbox
from acp_once.protocol.errors import INVALID_PARAMS, AcpError
from acp_once.protocol.retry import RETRY_TABLE, Direction, MessageKind, RetryClass, may_resend
from acp_once.protocol.schema import SessionUpdateUserMessage
from acp_once.storage import open_store
from acp_once.support.backoff import Backoff

pytestmark = pytest.mark.anyio

TIMEOUT = 60
FAST = Backoff(base=0.05, factor=2.0, cap=0.5)


class Env:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.db = tmp / "agent.sqlite3"
        self.effects = tmp / "effects"
        self.outbox = f"sqlite:{tmp / 'outbox.sqlite3'}"

    def launcher(self, **env: str) -> StdioLauncher:
        command = [
            sys.executable, "-m", "acp_once", "agent",
            "--store", f"sqlite:{self.db}", "--side-effects", str(self.effects),
        ]  # fmt: skip
        return StdioLauncher(command, env={**os.environ, **env})

    async def count(self, session_id: str) -> int:
        async with open_store(f"sqlite:{self.db}") as store:
            return await store.count_user_messages(session_id)


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


async def test_prompt_returns_the_inserted_message_id_and_updates_flow(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(
            env.launcher(), outbox=env.outbox, backoff=FAST, on_unaware="refuse"
        ) as client:
            session = await client.new_session("/tmp/project")
            seen: list[dict[str, Any]] = []
            done = anyio.Event()

            async def on_update(update: Any) -> None:
                seen.append(update.model_dump(by_alias=True, exclude_unset=True))
                if seen[-1].get("stopReason") == "end_turn":
                    done.set()

            session.on_update(on_update)
            async with session.updates() as stream:
                first = await session.prompt("hello")
                second = await session.prompt("hello")  # same text, new submission
                assert first != second
                user: str | None = None
                async for n in stream:
                    if isinstance(n.update, SessionUpdateUserMessage):
                        user = n.update.message_id
                        break
                assert user == first
            await done.wait()
            assert not await client.outbox.pending()
            assert client.agent_info is not None and client.keys_trusted
    assert await env.count(session.session_id) == 2


@pytest.mark.parametrize(("use_keys", "expected"), [(True, 1), (False, 2)])
async def test_crash_after_insert_keys_insert_once_without_keys_twice(
    env: Env, use_keys: bool, expected: int
) -> None:
    """Deterministic: the agent commits the message, dies before answering, and is started
    again by the client, which resumes and resends."""
    launcher = env.launcher(
        ACP_ONCE_CRASH="after-insert", ACP_ONCE_CRASH_MARKER=str(env.tmp / "crashed")
    )
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(
            launcher, outbox=env.outbox, backoff=FAST, use_keys=use_keys
        ) as client:
            session = await client.new_session("/tmp/project")
            message_id = await session.prompt("migrate the database")
            assert message_id.startswith("msg_user_")
            assert launcher.connects == 2
            assert client.reconnects == 1
    assert (env.tmp / "crashed").exists()
    assert await env.count(session.session_id) == expected


async def test_client_restart_resends_pending_submissions_in_order(env: Env) -> None:
    launcher = env.launcher()
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(launcher, outbox=env.outbox, backoff=FAST) as client:
            session = await client.new_session("/tmp/project")
            sid = session.session_id
            inserted = await session.prompt("already inserted")
        # a previous run wrote these and died before any answer came back
        async with open_outbox(env.outbox) as outbox:
            old = await outbox.add(
                sid, orjson.dumps([{"type": "text", "text": "old"}]), now=time.time() - 7200
            )
            await outbox.complete(old.submission_id)
            first = await outbox.add(sid, orjson.dumps([{"type": "text", "text": "one"}]))
            second = await outbox.add(sid, orjson.dumps([{"type": "text", "text": "two"}]))
        recovered: list[tuple[str, str]] = []
        all_done = anyio.Event()

        async def on_recovered(sub: Any, message_id: str) -> None:
            recovered.append((sub.submission_id, message_id))
            if len(recovered) == 2:
                all_done.set()

        async with AcpClient(
            env.launcher(), outbox=env.outbox, backoff=FAST, on_recovered=on_recovered
        ) as client:
            await all_done.wait()
            assert [r[0] for r in recovered] == [first.submission_id, second.submission_id]
            assert not await client.outbox.pending()
            assert inserted not in [r[1] for r in recovered]
    assert await env.count(sid) == 3


async def test_stale_submissions_are_handed_to_the_application(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(env.launcher(), outbox=env.outbox, backoff=FAST) as client:
            sid = (await client.new_session("/tmp/project")).session_id
        async with open_outbox(env.outbox) as outbox:
            stale = await outbox.add(
                sid, orjson.dumps([{"type": "text", "text": "yesterday"}]), now=time.time() - 86400
            )
            after = await outbox.add(sid, orjson.dumps([{"type": "text", "text": "later"}]))
        handed: list[str] = []

        async def on_stale(sub: Any) -> None:
            handed.append(sub.submission_id)

        async with AcpClient(
            env.launcher(), outbox=env.outbox, backoff=FAST, on_stale=on_stale
        ) as client:
            # the stale one and the one after it (order per session) wait for the user
            assert handed == [stale.submission_id, after.submission_id]
            assert [s.submission_id for s in client.stale()] == handed
            assert await env.count(sid) == 0
            message_id = await client.resend_stale(client.stale()[0])
            assert message_id.startswith("msg_user_")
            await client.discard(client.stale()[0])
            assert not await client.outbox.pending()
    assert await env.count(sid) == 1


async def test_definite_errors_reach_the_caller_and_leave_the_outbox_clean(env: Env) -> None:
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(env.launcher(), outbox=env.outbox, backoff=FAST) as client:
            session = await client.new_session("/tmp/project")
            with pytest.raises(AcpError) as info:
                # a block kind no agent advertises (the reference agent accepts images now)
                await session.prompt([{"type": "_acp_once_unknown", "data": "aGk="}])
            assert info.value.code == INVALID_PARAMS
            assert not await client.outbox.pending()
            await session.prompt("long [work:5]")
            async with anyio.create_task_group() as tg:
                outcome: list[BaseException] = []

                async def held() -> None:
                    try:
                        await session.prompt("held")
                    except PromptCancelled as exc:
                        outcome.append(exc)

                tg.start_soon(held)
                await anyio.wait_all_tasks_blocked()
                await session.cancel()
            assert len(outcome) == 1
            assert not await client.outbox.pending()


async def test_unaware_agent_policy_refuses_automatic_resends(env: Env) -> None:
    """An agent that does not say it honours keys: with on_unaware="refuse" a lost answer is
    reported as unknown, never resent."""
    launcher = StdioLauncher(
        [sys.executable, str(Path(__file__).parent.parent / "agents" / "tiny_agent.py")]
    )
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(launcher, backoff=FAST, on_unaware="refuse") as client:
            assert not client.keys_trusted
            session = await client.new_session("/tmp")
            assert await session.prompt("hello")
            with pytest.raises(OutcomeUnknown):
                await session.prompt("die")  # the tiny agent exits with the request pending
            assert not await client.outbox.pending()


@pytest.mark.parametrize(
    "entry",
    [
        e
        for e in RETRY_TABLE
        if e.kind is MessageKind.REQUEST and e.direction is Direction.CLIENT_TO_AGENT
    ],
    ids=lambda e: e.method,
)
def test_resend_decision_for_every_client_request(entry: Any) -> None:
    keyed = may_resend(entry.method, has_key=True)
    unkeyed = may_resend(entry.method, has_key=False)
    dup_allowed = may_resend(entry.method, has_key=False, allow_duplicating=True)
    expected = {
        RetryClass.IDEMPOTENT: (True, True, True),
        RetryClass.KEYED: (True, False, False),
        RetryClass.DUPLICATING: (False, False, True),
    }.get(entry.retry_class, (False, False, False))
    assert (keyed, unkeyed, dup_allowed) == expected


async def test_requests_survive_a_failed_reconnect(env: Env) -> None:
    """Waiters that queued while the agent was down are served by a later connection, even
    when a reconnect attempt in between failed during its handshake."""
    launches = env.tmp / "launches"
    agent = (
        f"n=$(cat {launches} 2>/dev/null || echo 0); echo $((n+1)) > {launches}; "
        f'[ "$n" = 1 ] && exit 1; exec {sys.executable} -m acp_once agent '
        f"--store sqlite:{env.db} --side-effects {env.effects}"
    )
    launcher = StdioLauncher(
        ["sh", "-c", agent],
        env={
            **os.environ,
            "ACP_ONCE_CRASH": "after-insert",
            "ACP_ONCE_CRASH_MARKER": str(env.tmp / "crashed"),
        },
    )
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(launcher, outbox=env.outbox, backoff=FAST) as client:
            session = await client.new_session("/tmp/project")
            # launch 1 commits and dies, launch 2 fails at once, launch 3 answers
            assert await session.prompt("survive")
            assert launches.read_text().strip() == "3"
    assert await env.count(session.session_id) == 1
