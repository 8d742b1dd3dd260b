"""Three `acp-once serve` processes on loopback ports sharing one PostgreSQL schema.

Clients spread over the nodes submit prompts (some held behind `[work:...]`, some with a
`[tool]` side effect), connections are cut before the answer, retries go to a different node
than the original, and one node is killed with SIGKILL and later restarted. At the end: one
user message per submission, every answer for a key carries that message's id, and each
`[tool]` side effect ran once per submission.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import orjson
import pytest

from acp_once.client import Client, ClientSideConnection
from acp_once.protocol.errors import AcpError
from acp_once.rpc.errors import TransportError
from acp_once.storage.postgres import PostgresStore
from acp_once.transports.websocket import connect_websocket
from tests.cluster.harness import (
    ServeNode,
    initialize,
    new_session,
    prompt,
    prompt_params,
    resume,
    serve_nodes,
    until,
    until_async,
)

pytestmark = [pytest.mark.anyio, pytest.mark.postgres, pytest.mark.slow]

SESSIONS = 3
PER_SESSION = 12
RACE_TRIALS = 40  # same-key races over real processes (1,000 run in-process)


@dataclass
class Submission:
    session: str
    key: str
    text: str
    origin: int
    cut: bool
    answers: list[str] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)


@asynccontextmanager
async def open_conn(n: ServeNode, sid: str | None = None) -> AsyncIterator[ClientSideConnection]:
    async with (
        connect_websocket(n.ws, open_timeout=2, ping_interval=None) as frames,
        ClientSideConnection(Client(), frames) as conn,
    ):
        await initialize(conn)
        if sid is not None:
            await resume(conn, sid)
        yield conn


async def submit(nodes: list[ServeNode], sub: Submission) -> None:
    """Send until answered: first to the origin (cut right after sending, for some), then
    to the other nodes in turn, with the same key each time."""
    others = [i for i in range(len(nodes)) if i != sub.origin]
    attempt = 0
    while True:
        target = sub.origin if attempt == 0 else others[(attempt - 1) % len(others)]
        sub.attempts.append(target)
        try:
            with anyio.fail_after(20):
                async with open_conn(nodes[target], sub.session) as conn:
                    if attempt == 0 and sub.cut:
                        await conn.rpc.start_request(
                            "session/prompt", prompt_params(sub.session, sub.text, sub.key)
                        )
                        # leaving the block drops the connection: the answer is lost
                    else:
                        sub.answers.append(await prompt(conn, sub.session, sub.text, sub.key))
                        return
        except (TransportError, OSError, TimeoutError):
            pass
        except AcpError as exc:  # -32800: withdrawn with its dropped connection, not inserted
            assert exc.code == -32800, exc
        attempt += 1
        await anyio.sleep(0.05)  # retry pacing (a client's backoff), not a synchronisation


async def test_three_nodes_cut_connections_retries_elsewhere_and_a_sigkill(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    extra = ("--lease-ttl", "1.5", "--interrupted", "continue")
    with anyio.fail_after(240):
        async with serve_nodes(tmp_path, postgres_dsn, schema, 3, *extra) as nodes:
            sessions = []
            for i in range(SESSIONS):
                async with open_conn(nodes[i]) as conn:
                    sessions.append(await new_session(conn))
            subs = []
            for j, sid in enumerate(sessions):
                for i in range(PER_SESSION):
                    text = f"s{j} #{i}"
                    if i % 3 == 0:
                        text += " [work:0.4]"
                    if i % 4 == 1:
                        text += " [tool]"
                    subs.append(Submission(sid, f"{sid}-{i}", text, (i + j) % 3, i % 3 == 1))
            # n2 starts a long turn on the second session: it owns it when it is killed, so
            # the prompts queued behind that turn (from every node) see a takeover
            warmup = Submission(sessions[1], "warmup", "s1 warmup [work:4]", 1, False)
            await submit(nodes, warmup)
            killed = anyio.Event()

            def answered() -> int:
                return sum(1 for x in subs if x.answers)

            async def chaos() -> None:
                await until(lambda: answered() >= len(subs) // 6)
                await nodes[1].kill()  # n2 dies with work held and running
                killed.set()
                await until(lambda: answered() >= len(subs) // 2)
                await nodes[1].start()  # a new instance of n2 on the same port

            async with anyio.create_task_group() as tg:
                tg.start_soon(chaos)
                for sub in subs:
                    tg.start_soon(submit, nodes, sub)
            assert killed.is_set() and nodes[1].starts == 2
            await nodes[1].ready()
            # one more submission per session on a node that was not killed: a session whose
            # owner died idle is taken over here, so its unfinished turns run (their tools)
            for j, sid in enumerate(sessions):
                final = Submission(sid, f"{sid}-final", f"s{j} final", 2, False)
                await submit(nodes, final)
                subs.append(final)
            subs.append(warmup)

            async with PostgresStore.open(postgres_dsn, schema=schema, migrate=False) as store:
                for sub in subs:
                    assert sub.answers, sub
                    found = await store.find_key(sub.session, sub.key)
                    assert found is not None, sub
                    assert set(sub.answers) == {found.message_id}, sub
                    assert (
                        await store.count_user_messages(sub.session, idempotency_key=sub.key) == 1
                    )
                for j, sid in enumerate(sessions):
                    warm = 1 if j == 1 else 0
                    assert await store.count_user_messages(sid) == PER_SESSION + 1 + warm
                # retries went elsewhere than the original
                assert any(len(set(s.attempts)) > 1 for s in subs)
                tools = {
                    sid: {
                        (await store.find_key(s.session, s.key)).message_id  # type: ignore[union-attr]
                        for s in subs
                        if s.session == sid and "[tool]" in s.text
                    }
                    for sid in sessions
                }

            def effects_done() -> bool:
                return all(set(lines(tmp_path, sid)) == tools[sid] for sid in sessions)

            with anyio.move_on_after(60):
                await until(effects_done, 0.1)
            if not effects_done():
                # say which tool turns never ran, and what the timeline holds after them
                async with PostgresStore.open(postgres_dsn, schema=schema, migrate=False) as store:
                    report = await missing_effects(store, tmp_path, tools)
                pytest.fail(f"tool turns never ran:\n{report}")
            for sid in sessions:
                ran = lines(tmp_path, sid)
                assert len(ran) == len(set(ran)) == len(tools[sid])  # each tool once
            assert "a background step failed" not in "".join(n.log() for n in nodes)
            # a surviving node took the dead owner's session over
            taken = f"lease.taken session={sessions[1]}"
            assert taken in nodes[0].log() + nodes[2].log()

            # the ops endpoint shows every node instance, the dead one too
            async with httpx.AsyncClient() as http:
                status = (await http.get(f"{nodes[0].http}/ops/status", timeout=10)).json()
            names = sorted(n["node"] for n in status["nodes"])
            assert names.count("n1") == 1 and names.count("n3") == 1
            assert sum(1 for n in status["nodes"] if n["node"] == "n2" and n["alive"]) == 1
            assert sum(n.get("dedup_hits", 0) for n in status["nodes"]) > 0
            # and `acp-once status URL` prints it
            shown = await anyio.run_process(
                [sys.executable, "-m", "acp_once", "status", nodes[2].http], check=False
            )
            out = shown.stdout.decode()
            assert shown.returncode == 0, shown.stderr.decode()
            assert "n1" in out and "n3" in out and "sessions owned" in out


async def missing_effects(store: PostgresStore, tmp: Path, tools: dict[str, set[str]]) -> str:
    """Each tool message without its side effect: the timeline from it on (kinds and states),
    so a failure says whether the turn started, ended, or was never queued."""
    out = []
    for sid, wanted in tools.items():
        timeline = await store.read_timeline(sid)
        for message_id in sorted(wanted - set(lines(tmp, sid))):
            at = next(i for i, e in enumerate(timeline) if e.message_id == message_id)
            kinds = [
                f"{u.get('sessionUpdate')}:{u.get('state') or u.get('messageId') or ''}"
                for u in (orjson.loads(e.update) for e in timeline[at:])
            ]
            out.append(f"{sid} {message_id}: {kinds}")
    return "\n".join(out)


def lines(tmp: Path, sid: str) -> list[str]:
    path = tmp / "effects" / f"{sid}.log"
    return path.read_text().split() if path.exists() else []


async def test_same_key_races_over_three_processes(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    with anyio.fail_after(240):
        async with serve_nodes(tmp_path, postgres_dsn, schema, 3) as nodes:
            async with (
                open_conn(nodes[0]) as c1,
                open_conn(nodes[1]) as c2,
                open_conn(nodes[2]) as c3,
            ):
                conns = [c1, c2, c3]
                sid = await new_session(c1)
                await resume(c2, sid)
                await resume(c3, sid)
                answers: dict[str, list[str]] = {}

                async def attempt(key: str, i: int) -> None:
                    mid = await prompt(conns[i % 3], sid, f"race {key}", key)
                    answers.setdefault(key, []).append(mid)

                for t in range(RACE_TRIALS):
                    async with anyio.create_task_group() as tg:
                        for i in range(8):
                            tg.start_soon(attempt, f"race-{t}", i + t)

            async with PostgresStore.open(postgres_dsn, schema=schema, migrate=False) as store:

                async def all_counted() -> bool:
                    return await store.count_user_messages(sid) == RACE_TRIALS

                await until_async(all_counted)
                for key, mids in answers.items():
                    found = await store.find_key(sid, key)
                    assert found is not None and set(mids) == {found.message_id}
                    assert len(mids) == 8
