"""`acp-once demo`: what idempotency keys buy, measured under injected faults.

The reference agent runs over stdio on a SQLite store in a temporary directory (or, with
`transport="ws"` or `"http"`, as an `acp-once serve` subprocess on a free loopback port, which a
small supervisor restarts whenever it dies, the client connecting with `WebSocketLauncher` or
`HttpLauncher`). A client submits a few hundred prompts over four sessions (some slow,
`[work:...]`, some with a side-effecting tool call, `[tool]`) while a fault injector

- kills the agent with SIGKILL at random moments,
- cuts answers: the agent dies right after committing a message, before answering (a random
  share of insertions),
- restarts the client itself, which then finds its pending submissions in its SQLite outbox,
- over WebSocket also drops the client's connection without killing the server (a network
  failure: the answers in flight are lost, the server lives on).

It runs twice. With keys, the client resends with the same key and the agent inserts each
submission once. Without keys, the client does what a keyless client can: it resends after a
lost answer while it runs (duplicates, when the first attempt was inserted) and, after its own
restart, drops what was pending (losses, when it was not). Then it counts, from the agent's
store, every submission's user messages and side effects.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
import anyio.abc
import orjson

from acp_once.client import AcpClient, ClientSession, HttpLauncher, StdioLauncher, WebSocketLauncher
from acp_once.client.outbox import Submission
from acp_once.protocol.errors import AcpError
from acp_once.rpc.errors import TransportError
from acp_once.storage import open_store
from acp_once.support.backoff import Backoff

__all__ = ["DemoResult", "drain", "prompt_text", "run_demo"]

SESSIONS = 4

Transport = Literal["stdio", "ws", "http"]


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
    dropped_connections: int = 0
    """WebSocket connections dropped with the server still running (ws only)."""
    transport: Transport = "stdio"


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
    transport: Transport = "stdio",
) -> DemoResult:
    """Run the demo once; see the module docstring.

    `cut_rate` is the share of insertions after which the agent dies before answering.
    `transport`: "stdio" (the agent is the client's subprocess), "ws" or "http" (`acp-once
    serve` as a supervised subprocess, the client over WebSocket or Streamable HTTP).
    """
    if transport not in ("stdio", "ws", "http"):
        raise ValueError(f"unknown transport {transport!r}: stdio, ws or http")
    with tempfile.TemporaryDirectory(prefix="acp-once-demo-") as tmp:
        demo = _Demo(Path(workdir or tmp), keys, submissions, seed, on_progress, cut_rate)
        if transport != "stdio":
            return await _run_remote(demo, transport)
        launcher = StdioLauncher(
            demo.agent_command("agent"), env=demo.env, stderr=subprocess.DEVNULL
        )
        return await _run(demo, launcher)


async def _run(
    demo: _Demo, launcher: StdioLauncher | WebSocketLauncher | HttpLauncher
) -> DemoResult:
    demo.launcher = launcher
    started = time.perf_counter()
    while len(demo.done) < demo.n:
        await demo.client_run()
    elapsed = time.perf_counter() - started
    if demo.server is not None:
        await demo.server.stop()
    cuts = len(demo.cut_log.read_text().split()) if demo.cut_log.exists() else 0
    result = await _count(
        demo.workdir, demo.session_ids, demo.n, demo.keys, elapsed, demo.kills, cuts, demo.restarts
    )
    if demo.server is None:
        return result
    transport: Transport = "http" if isinstance(launcher, HttpLauncher) else "ws"
    return dataclasses.replace(result, dropped_connections=demo.drops, transport=transport)


async def _run_remote(demo: _Demo, transport: Transport) -> DemoResult:
    server = _ServerSupervisor(demo.agent_command("serve"), demo.env)
    demo.server = server
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(server.run)
            try:
                launcher = (
                    HttpLauncher(server.url.replace("ws://", "http://", 1))
                    if transport == "http"
                    else WebSocketLauncher(server.url)
                )
                result = await _run(demo, launcher)
            finally:
                tg.cancel_scope.cancel()  # kills a server still running (an error above)
    finally:
        server.sock.close()
    return result


class _ServerSupervisor:
    """`acp-once serve` as a subprocess, started again whenever it dies (killed by the fault
    injector, or exiting after a cut answer) until `stop()`.

    The listening socket is the supervisor's: bound once on a free loopback port and passed to
    every server process (`--fd`). A client may connect at any moment, even while the server
    is down: it waits in the backlog until the next server process accepts it.
    """

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port: int = self.sock.getsockname()[1]
        self.url = f"ws://127.0.0.1:{self.port}/acp"
        self.command = [*command, "--fd", str(self.sock.fileno())]
        self.env = env
        self.starts = 0
        self.process: anyio.abc.Process | None = None
        self._exited = anyio.Event()
        self._stopping = False

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        while not self._stopping:
            process = await anyio.open_process(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(self.sock.fileno(),),
            )
            self.process, exited = process, anyio.Event()
            self._exited = exited
            self.starts += 1
            if self.starts == 1:
                task_status.started()
            try:
                await process.wait()
            finally:
                if process.returncode is None:  # cancelled: never leave a server behind
                    process.kill()
                    with anyio.CancelScope(shield=True):
                        await process.wait()
                exited.set()

    async def kill(self) -> None:
        """SIGKILL the running server and wait until it has exited (it is started again)."""
        process, exited = self.process, self._exited
        if process is not None and process.returncode is None:
            process.kill()
        await exited.wait()

    async def stop(self) -> None:
        """Stop the server for good (SIGTERM, then SIGKILL after 10 s)."""
        self._stopping = True
        process, exited = self.process, self._exited
        if process is not None and process.returncode is None:
            process.terminate()
            with anyio.move_on_after(10):
                await exited.wait()
                return
            process.kill()
        await exited.wait()


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
        self.workdir = workdir
        self.keys = keys
        self.n = n
        self.rng = random.Random(seed)
        self.run_id = uuid.UUID(int=self.rng.getrandbits(128))
        self.on_progress = on_progress
        self.cut_log = workdir / "cut-answers.log"
        self.env = {
            **os.environ,
            "ACP_ONCE_CRASH": "after-insert",
            "ACP_ONCE_CRASH_RATE": str(cut_rate),
            "ACP_ONCE_CRASH_SEED": str(seed),
            "ACP_ONCE_CRASH_LOG": str(self.cut_log),
        }
        self.launcher: StdioLauncher | WebSocketLauncher | HttpLauncher | None = None
        self.server: _ServerSupervisor | None = None
        self.outbox = f"sqlite:{workdir / 'outbox.sqlite3'}"
        self.done: dict[int, str] = {}
        self.session_ids: list[str] = []
        self.kills = 0
        self.drops = 0
        self.restarts = 0
        self.restart_points = (
            sorted(self.rng.sample(range(n // 5, n - n // 5), 2)) if n >= 20 else []
        )

    def agent_command(self, command: Literal["agent", "serve"]) -> list[str]:
        """`acp-once agent` (stdio) or `acp-once serve` (WebSocket) on the demo's store."""
        return [
            sys.executable, "-m", "acp_once", command,
            "--store", f"sqlite:{self.workdir / 'agent.sqlite3'}",
            "--side-effects", str(self.workdir / "effects"),
            "--interrupted", "continue",
        ]  # fmt: skip

    def record(self, i: int, message_id: str) -> None:
        if i not in self.done:
            self.done[i] = message_id
            if self.on_progress is not None:
                self.on_progress(1)

    async def on_recovered(self, submission: Submission, message_id: str) -> None:
        self.record(_index(submission), message_id)

    async def client_run(self) -> None:
        """One life of the client process: until it is "restarted" or everything is done."""
        assert self.launcher is not None
        client = AcpClient(
            self.launcher,
            outbox=self.outbox,
            backoff=Backoff(base=0.02, factor=2.0, cap=0.3),
            use_keys=self.keys,
            on_unaware="trust",
            on_recovered=self.on_recovered if self.keys else None,
            # a keyless client has nothing safe to do with what it had pending: it drops it
            recover_pending=self.keys,
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
            launcher = self.launcher
            if isinstance(launcher, StdioLauncher):
                proc = launcher.current
                if proc is not None:
                    proc.process.kill()
                    self.kills += 1
                    await proc.process.wait()
            elif isinstance(launcher, HttpLauncher) and self.server is not None:
                await client.wait_connected()
                await self.server.kill()
                self.kills += 1
            elif isinstance(launcher, WebSocketLauncher) and self.server is not None:
                # the server may be restarting after a cut answer: strike the next connection
                await client.wait_connected()
                frames = launcher.current
                if frames is None:
                    continue
                if self.rng.random() < 0.5:
                    await frames.abort()  # the network fails; the server lives on
                    self.drops += 1
                else:
                    await self.server.kill()
                    self.kills += 1


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
