"""`acp-once demo`: what idempotency keys buy, measured under injected faults.

The reference agent runs over stdio on a SQLite store in a temporary directory. A client
submits a few hundred prompts over four sessions (some slow, `[work:...]`, some with a
side-effecting tool call, `[tool]`) while a fault injector

- kills the agent with SIGKILL at random moments,
- cuts answers: the agent dies right after committing a message, before answering (a random
  share of insertions),
- restarts the client itself, which then finds its pending submissions in its SQLite outbox.

It runs twice. With keys, the client resends with the same key and the agent inserts each
submission once. Without keys, the client does what a keyless client can: it resends after a
lost answer while it runs (duplicates, when the first attempt was inserted) and, after its own
restart, drops what was pending (losses, when it was not). Then it counts, from the agent's
store, every submission's user messages and side effects.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import orjson

from acp_once.client.outbox import Submission
from acp_once.client.recovery import Backoff
from acp_once.client.resilient import AcpClient, ClientSession, StdioAgent
from acp_once.protocol.errors import AcpError
from acp_once.rpc.errors import TransportError
from acp_once.storage import open_store

__all__ = ["DemoResult", "drain", "prompt_text", "run_demo"]

SESSIONS = 4


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What one run of the demo counted."""

    keys: bool
    submissions: int
    inserted_once: int
    inserted_twice_or_more: int
    lost: int
    duplicate_side_effects: int
    missing_side_effects: int
    seconds: float
    agent_kills: int
    cut_answers: int
    client_restarts: int


def prompt_text(i: int) -> str:
    """The text of submission `i`: unique (#i), some slow, some with a tool call."""
    text = f"submission #{i}"
    if i % 4 == 0:
        text += " [tool]"
    if i % 9 == 0:
        text += " [work:0.1]"
    return text


async def run_demo(
    *,
    keys: bool,
    submissions: int = 200,
    seed: int = 1,
    workdir: Path | None = None,
    on_progress: Callable[[int], None] | None = None,
    cut_rate: float = 0.03,
) -> DemoResult:
    """Run the demo once; see the module docstring.

    `cut_rate` is the share of insertions after which the agent dies before answering.
    """
    with tempfile.TemporaryDirectory(prefix="acp-once-demo-") as tmp:
        return await _run(Path(workdir or tmp), keys, submissions, seed, on_progress, cut_rate)


async def _run(
    workdir: Path,
    keys: bool,
    n: int,
    seed: int,
    on_progress: Callable[[int], None] | None,
    cut_rate: float,
) -> DemoResult:
    demo = _Demo(workdir, keys, n, seed, on_progress, cut_rate)
    started = time.perf_counter()
    while len(demo.done) < n:
        await demo.client_run()
    elapsed = time.perf_counter() - started
    cuts = len(demo.cut_log.read_text().split()) if demo.cut_log.exists() else 0
    return await _count(
        workdir, demo.session_ids, n, keys, elapsed, demo.kills, cuts, demo.restarts
    )


class _Demo:
    """The state of one demo run: what was submitted, and the faults injected so far."""

    def __init__(
        self,
        workdir: Path,
        keys: bool,
        n: int,
        seed: int,
        on_progress: Callable[[int], None] | None,
        cut_rate: float,
    ) -> None:
        self.keys = keys
        self.n = n
        self.rng = random.Random(seed)
        self.run_id = uuid.UUID(int=self.rng.getrandbits(128))
        self.on_progress = on_progress
        self.cut_log = workdir / "cut-answers.log"
        env = {
            **os.environ,
            "ACP_ONCE_CRASH": "after-insert",
            "ACP_ONCE_CRASH_RATE": str(cut_rate),
            "ACP_ONCE_CRASH_SEED": str(seed),
            "ACP_ONCE_CRASH_LOG": str(self.cut_log),
        }
        command = [
            sys.executable, "-m", "acp_once", "agent",
            "--store", f"sqlite:{workdir / 'agent.sqlite3'}",
            "--side-effects", str(workdir / "effects"),
            "--interrupted", "continue",
        ]  # fmt: skip
        self.launcher = StdioAgent(command, env=env, stderr=subprocess.DEVNULL)
        self.outbox = f"sqlite:{workdir / 'outbox.sqlite3'}"
        self.done: dict[int, str] = {}
        self.session_ids: list[str] = []
        self.kills = 0
        self.restarts = 0
        self.restart_points = (
            sorted(self.rng.sample(range(n // 5, n - n // 5), 2)) if n >= 20 else []
        )

    def record(self, i: int, message_id: str) -> None:
        if i not in self.done:
            self.done[i] = message_id
            if self.on_progress is not None:
                self.on_progress(1)

    async def on_recovered(self, submission: Submission, message_id: str) -> None:
        self.record(_index(submission), message_id)

    async def client_run(self) -> None:
        """One life of the client process: until it is "restarted" or everything is done."""
        client = AcpClient(
            self.launcher,
            outbox=self.outbox,
            backoff=Backoff(base=0.02, factor=2.0, cap=0.3),
            use_keys=self.keys,
            on_unaware="trust",
            on_recovered=self.on_recovered if self.keys else None,
        )
        async with client:
            if not self.keys:
                # a keyless client cannot tell what its pending input became: it drops it
                for submission in await client.outbox.pending():
                    self.record(_index(submission), "")
                    await client.outbox.complete(submission.submission_id)
            if not self.session_ids:
                for _ in range(SESSIONS):
                    self.session_ids.append((await client.new_session("/tmp/demo")).session_id)
            sessions = [await client.resume_session(sid, "/tmp/demo") for sid in self.session_ids]
            restart_at = next((p for p in self.restart_points if p > len(self.done)), None)
            restart = anyio.CancelScope()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.killer, client)
                with restart:
                    async with anyio.create_task_group() as workers:
                        for k, session in enumerate(sessions):
                            workers.start_soon(self.submitter, k, session, restart, restart_at)
                tg.cancel_scope.cancel()
            if restart.cancel_called:
                self.restarts += 1
                self.restart_points = [p for p in self.restart_points if p > len(self.done)]
            else:
                await drain(client, self.session_ids)

    async def submitter(
        self, k: int, session: ClientSession, restart: anyio.CancelScope, restart_at: int | None
    ) -> None:
        for i in range(k, self.n, SESSIONS):
            if i in self.done:
                continue
            key = str(uuid.uuid5(self.run_id, str(i))) if self.keys else None
            try:
                message_id = await session.prompt(prompt_text(i), idempotency_key=key)
            except (AcpError, TransportError):
                message_id = ""  # refused or unknown: the store says what happened
            self.record(i, message_id)
            if restart_at is not None and len(self.done) >= restart_at:
                restart.cancel()  # the client process "dies" here

    async def killer(self, client: AcpClient) -> None:
        while True:
            await client.wait_connected()
            await anyio.sleep(self.rng.uniform(0.2, 1.0))  # a random moment: the fault
            proc = self.launcher.current
            if proc is not None:
                proc.process.kill()
                self.kills += 1
                await proc.process.wait()


def _index(submission: Submission) -> int:
    blocks = orjson.loads(submission.prompt)
    text = str(blocks[0]["text"])
    return int(text.split("#", 1)[1].split()[0])


async def drain(client: AcpClient, session_ids: list[str]) -> None:
    """Wait until every session's earlier turns have run: a last prompt per session
    ("drain <session id>") whose echo comes after all of them, since a session's turns run in
    order. Works with agents that echo the prompt (the reference agent)."""
    for sid in session_ids:
        session = client.session(sid)
        assert session is not None
        marker = f"drain {sid}"
        async with session.updates() as stream:
            await session.prompt(marker)
            async for n in stream:
                update = n.update.model_dump(by_alias=True, exclude_unset=True)
                content = update.get("content") or [{}]
                if (
                    update.get("sessionUpdate") == "agent_message"
                    and content[0].get("text") == marker
                ):
                    break


async def _count(
    workdir: Path,
    session_ids: list[str],
    n: int,
    keys: bool,
    elapsed: float,
    kills: int,
    cuts: int,
    restarts: int,
) -> DemoResult:
    copies: dict[int, list[str]] = {i: [] for i in range(n)}
    async with open_store(f"sqlite:{workdir / 'agent.sqlite3'}") as store:
        for sid in session_ids:
            after = 0
            while page := await store.read_timeline(sid, after_seq=after):
                for entry in page:
                    update = orjson.loads(entry.update)
                    if update.get("sessionUpdate") != "user_message" or entry.message_id is None:
                        continue
                    text = str((update.get("content") or [{}])[0].get("text", ""))
                    if text.startswith("submission #"):
                        copies[int(text.split("#", 1)[1].split()[0])].append(entry.message_id)
                after = page[-1].seq
    effects: dict[str, int] = {}
    for log in (workdir / "effects").glob("*.log"):
        for line in log.read_text(encoding="utf-8").split():
            effects[line] = effects.get(line, 0) + 1
    duplicate_effects = missing_effects = 0
    for i, ids in copies.items():
        if "[tool]" not in prompt_text(i) or not ids:
            continue
        total = sum(effects.get(m, 0) for m in ids)
        duplicate_effects += max(0, total - 1)
        missing_effects += int(total == 0)
    return DemoResult(
        keys=keys,
        submissions=n,
        inserted_once=sum(1 for ids in copies.values() if len(ids) == 1),
        inserted_twice_or_more=sum(1 for ids in copies.values() if len(ids) > 1),
        lost=sum(1 for ids in copies.values() if not ids),
        duplicate_side_effects=duplicate_effects,
        missing_side_effects=missing_effects,
        seconds=elapsed,
        agent_kills=kills,
        cut_answers=cuts,
        client_restarts=restarts,
    )
