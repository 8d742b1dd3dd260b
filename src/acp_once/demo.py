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

With `agent_cmd` the agent is any ACP v1 stdio agent behind the upgrade runtime (`acp-once
agent --runtime v1 -- CMD`): each prompt is a template with the submission's number, the
sessions work in a directory of the run, and with `effects` the agent's side effects are the
lines of `effects.log` there (a line `N` for submission N). Agent kills and cut answers then end
the whole upgraded agent, the v1 agent with it.

It runs twice. With keys, the client resends with the same key and the agent inserts each
submission once. Without keys, the client does what a keyless client can: it resends after a
lost answer while it runs (duplicates, when the first attempt was inserted) and, after its own
restart, drops what was pending (losses, when it was not). Then it counts, from the agent's
store, every submission's user messages and side effects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
import anyio.abc
import orjson

from acp_once.agent.state import ended_message
from acp_once.client import AcpClient, ClientSession, HttpLauncher, StdioLauncher, WebSocketLauncher
from acp_once.client.outbox import Submission
from acp_once.protocol.errors import AcpError
from acp_once.rpc.errors import TransportError
from acp_once.storage import open_store
from acp_once.support.backoff import Backoff
from acp_once.support.proctree import kill_tree, with_environment

__all__ = ["DemoResult", "drain", "prompt_text", "run_demo"]

SESSIONS = 4
_RUN_MARKER = "ACP_ONCE_DEMO_RUN"  # in the environment of every process a v1 run starts

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
    interrupted_turns: int = 0
    """Submissions whose turn stored no agent message: a kill or a cut ended it first (it was
    reported with `stopReason: error`, or run again under `--interrupted continue`)."""
    session_ids: tuple[str, ...] = ()
    """The run's sessions, in the agent's store (`agent.sqlite3` in its working directory)."""
    side_effects_counted: bool = True
    """False for an agent whose side effects the demo cannot see (`agent_cmd` without
    `effects`): the side-effect counts are then 0 and mean nothing."""
    unreported_missing_side_effects: int = 0
    """Submissions counted in `missing_side_effects` whose turn did not end with
    `stopReason: "error"`: work neither done nor reported as failed. Under `--interrupted
    continue` a turn interrupted twice is reported rather than run a third time (A3), so
    `missing_side_effects` may be above 0 under faults; this must not."""


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
    agent_cmd: Sequence[str] | None = None,
    prompt: str = "submission #{i}",
    effects: bool = False,
    env: dict[str, str] | None = None,
) -> DemoResult:
    """Run the demo once; see the module docstring.

    `cut_rate` is the share of insertions after which the agent dies before answering.
    `transport`: "stdio" (the agent is the client's subprocess), "ws" or "http" (`acp-once
    serve` as a supervised subprocess, the client over WebSocket or Streamable HTTP).
    `agent_cmd`: a v1 agent's command, run behind the upgrade runtime instead of the reference
    agent (stdio only); `prompt` is then each submission's text, `{i}` its number; `effects`:
    count the lines `N` of `effects.log` in the sessions' directory as submission N's side
    effects. `env`: variables added to the agent's environment.

    Raises:
        ValueError: an unknown transport, `agent_cmd` with another transport than stdio, or
            a `prompt` without `{i}`.
    """
    if transport not in ("stdio", "ws", "http"):
        raise ValueError(f"unknown transport {transport!r}: stdio, ws or http")
    if agent_cmd is not None and transport != "stdio":
        raise ValueError("a v1 agent command (agent_cmd) runs over stdio only")
    if agent_cmd is not None and "{i}" not in prompt:
        raise ValueError("the prompt template needs {i}, the submission's number")
    with tempfile.TemporaryDirectory(prefix="acp-once-demo-") as tmp:
        demo = _Demo(Path(workdir or tmp), keys, submissions, seed, on_progress, cut_rate)
        if env:
            demo.env.update(env)
        if transport != "stdio":
            return await _run_remote(demo, transport)
        if agent_cmd is not None:
            demo.use_v1_agent(list(agent_cmd), prompt, effects)
        launcher = StdioLauncher(
            demo.agent_command("agent"), env=demo.env, stderr=subprocess.DEVNULL
        )
        try:
            return await _run(demo, launcher)
        finally:
            # a v1 agent may outlive its runtime (one that ignores its stdin's end, killed
            # while being started): whatever this run started is marked, and ended here
            for pid in with_environment(_RUN_MARKER, str(demo.run_id)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


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
    result = await _count(demo, elapsed, cuts)
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
        self.v1_agent: list[str] | None = None
        self.store = f"sqlite:{workdir / 'agent.sqlite3'}"
        self.template = "submission #{i}"
        self.effects = True
        self.cwd = "/tmp/demo"

    def use_v1_agent(self, command: list[str], template: str, effects: bool) -> None:
        """Run the v1 agent `command` behind the upgrade runtime (see `run_demo`)."""
        self.v1_agent, self.template, self.effects = command, template, effects
        self.env[_RUN_MARKER] = str(self.run_id)
        work = self.workdir / "work"
        work.mkdir(exist_ok=True)
        self.cwd = str(work)

    def text(self, i: int) -> str:
        """Submission `i`'s prompt text."""
        return prompt_text(i) if self.v1_agent is None else self.template.replace("{i}", str(i))

    def index(self, text: str) -> int | None:
        """The submission number in a prompt's text (None: not one of the submissions)."""
        if self.v1_agent is None:
            if not text.startswith("submission #"):
                return None
            return int(text.split("#", 1)[1].split()[0])
        head, _, tail = self.template.partition("{i}")
        found = re.fullmatch(re.escape(head) + r"(\d+)" + re.escape(tail), text)
        return int(found.group(1)) if found else None

    def agent_command(self, command: Literal["agent", "serve"]) -> list[str]:
        """`acp-once agent` (stdio) or `acp-once serve` (WebSocket) on the demo's store; with
        a v1 agent, `acp-once agent --runtime v1 -- CMD`."""
        if self.v1_agent is not None:
            return [
                sys.executable, "-m", "acp_once", "agent", "--runtime", "v1", "--store", self.store,
                "--", *self.v1_agent,
            ]  # fmt: skip
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
        self.record(self._submission_index(submission), message_id)

    def _submission_index(self, submission: Submission) -> int:
        blocks = orjson.loads(submission.prompt)
        index = self.index(str(blocks[0]["text"]))
        assert index is not None, "the outbox holds the demo's submissions only"
        return index

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
                    self.record(self._submission_index(submission), "")
                    await client.outbox.complete(submission.submission_id)
            if not self.session_ids:
                for _ in range(SESSIONS):
                    self.session_ids.append((await client.new_session(self.cwd)).session_id)
            sessions = [await client.resume_session(sid, self.cwd) for sid in self.session_ids]
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
                if self.v1_agent is None:
                    await drain(client, self.session_ids)
                else:
                    await drain(client, self.session_ids, echoes=False, store=self.store)
            self._stop_v1_agent()

    def _stop_v1_agent(self) -> None:
        """End the v1 agent before its runtime stops: an agent that outlives its stdin (Codex
        does) would hold the runtime's exit for its shutdown timeout."""
        launcher = self.launcher
        if self.v1_agent is not None and isinstance(launcher, StdioLauncher):
            proc = launcher.current
            if proc is not None:
                kill_tree(proc.process.pid, include_root=False)

    async def submitter(
        self, k: int, session: ClientSession, restart: anyio.CancelScope, restart_at: int | None
    ) -> None:
        for i in range(k, self.n, SESSIONS):
            if i in self.done:
                continue
            key = str(uuid.uuid5(self.run_id, str(i))) if self.keys else None
            try:
                message_id = await session.prompt(self.text(i), idempotency_key=key)
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
                    # the agent and what it started (a v1 agent and its tools): a host crash
                    kill_tree(proc.process.pid)
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


async def drain(
    client: AcpClient, session_ids: list[str], *, echoes: bool = True, store: str | None = None
) -> None:
    """Wait until every session's earlier turns have run: a last prompt per session
    ("drain <session id>") whose turn comes after all of them, since a session's turns run in
    order. `echoes`: the agent echoes the prompt (the reference agent), and its echo ends the
    wait. Otherwise give the agent's `store` URL: each turn's end (an update with a stop
    reason, or a resume's) makes the wait look there for the drain turn's end record, which
    a turn interrupted by a crash also gets (A10)."""
    if not echoes and store is None:
        raise ValueError("drain needs the agent's store for an agent that does not echo")
    for sid in session_ids:
        session = client.session(sid)
        assert session is not None
        marker = f"drain {sid}"
        async with session.updates() as stream:
            message_id = await session.prompt(marker)
            if echoes:
                async for n in stream:
                    update = n.update.model_dump(by_alias=True, exclude_unset=True)
                    content = update.get("content") or [{}]
                    kind = update.get("sessionUpdate")
                    if kind == "agent_message" and content[0].get("text") == marker:
                        break
                continue
            while not await _turn_closed(store, sid, message_id):
                # woken by the next idle, or after a second: the marker may be written after
                # the idle that announced it was sent
                with anyio.move_on_after(1.0):
                    async for n in stream:
                        if getattr(n.update, "state", None) == "idle":
                            break


async def _turn_closed(store: str | None, session_id: str, message_id: str) -> bool:
    """Whether the store holds the end record of `message_id`'s turn (A10)."""
    assert store is not None
    async with open_store(store) as opened:
        tail = await opened.read_timeline_tail(session_id, limit=64)
    return any(ended_message(orjson.loads(entry.update)) == message_id for entry in tail)


async def _count(demo: _Demo, elapsed: float, cuts: int) -> DemoResult:
    n, workdir = demo.n, demo.workdir
    copies: dict[int, list[str]] = {i: [] for i in range(n)}
    interrupted = 0
    turns: set[str] = set()  # the message ids of the submissions
    reported: set[str] = set()  # messages whose turn ended with stopReason "error" (told)
    answered = True
    async with open_store(f"sqlite:{workdir / 'agent.sqlite3'}") as store:
        for sid in demo.session_ids:
            after = 0
            while page := await store.read_timeline(sid, after_seq=after):
                for entry in page:
                    update = orjson.loads(entry.update)
                    kind = update.get("sessionUpdate")
                    if kind == "agent_message":
                        answered = True
                    elif (ended := ended_message(update)) is not None:
                        # a submission's turn that ended without a stored answer: interrupted
                        interrupted += int(not answered and ended in turns)
                        if update.get("stopReason") == "error":
                            reported.add(ended)
                    if kind != "user_message" or entry.message_id is None:
                        continue
                    answered = True  # until this turn's end record is seen
                    index = demo.index(str((update.get("content") or [{}])[0].get("text", "")))
                    if index is not None:
                        copies[index].append(entry.message_id)
                        turns.add(entry.message_id)
                        answered = False
                after = page[-1].seq
    effects: dict[str, int] = {}
    logs = (
        list((workdir / "effects").glob("*.log"))
        if demo.v1_agent is None
        else [Path(demo.cwd) / "effects.log"]
    )
    for log in logs:
        if not log.exists():
            continue
        for line in log.read_text(encoding="utf-8").split():
            effects[line] = effects.get(line, 0) + 1
    duplicate_effects = missing_effects = unreported = 0
    for i, ids in copies.items():
        if not ids or not demo.effects:
            continue
        if demo.v1_agent is None:
            if "[tool]" not in prompt_text(i):
                continue
            total = sum(effects.get(m, 0) for m in ids)
        else:
            total = effects.get(str(i), 0)
        duplicate_effects += max(0, total - 1)
        if total == 0:
            missing_effects += 1
            unreported += int(not any(m in reported for m in ids))
    kills, restarts, keys = demo.kills, demo.restarts, demo.keys
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
        interrupted_turns=interrupted,
        side_effects_counted=demo.effects,
        session_ids=tuple(demo.session_ids),
        unreported_missing_side_effects=unreported,
    )
