"""SIGKILL of the upgrade runtime mid-turn, again and again, over a v1 agent that ignores the end
of its stdin and SIGTERM (`tests/agents/stubborn_v1_agent.py`, which also starts a `sleep`).

    python3 dev.py run python benchmarks/bench_upgrade_kill.py [--kills N] [--sessions S]

Each round starts `acp-once agent --runtime v1` on one SQLite store, resumes the session the
last round's prompt was in and retries that prompt's key (answered from the store: the child
must not run it again), then sends a new keyed prompt, in session `round % S`, that the child
never finishes; once the child has written its side effect (one line per prompt it runs) and
said `working`, the runtime is SIGKILLed. A sampler reads `/proc` every 10 ms for the live
processes of the agent.

Printed: kills; side effects once / twice / lost (per keyed prompt); the most agent process
groups alive at once (an agent forking its `sleep` briefly shows twice: groups are counted), and
the most agents alive on one v1 session (when a child starts a prompt, the live agents
that ran a prompt of that session); how long the killed runtime's child group took to be gone
(p50 / max, ms); retries answered with the first message id. Nothing is asserted: this prints
figures (wanted: 0 twice, 0 lost, 1 child per session, every group gone within 5 s).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from acp_once.client import Client, ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.transports.stdio import spawn
from acp_once.upgrade.containment import group_members

AGENT = Path(__file__).resolve().parents[1] / "tests" / "agents" / "stubborn_v1_agent.py"
TIMEOUT = 60
GONE_WITHIN = 5.0


class Recorder(Client):
    def __init__(self) -> None:
        self.working = 0
        self._arrived = anyio.Event()

    async def session_update(self, params: s.UpdateSessionNotification) -> None:
        update = params.model_dump(by_alias=True, exclude_unset=True)["update"]
        kind, content = update.get("sessionUpdate"), update.get("content")
        if kind == "agent_message_chunk" and content.get("text") == "working":
            self.working += 1
        self._arrived.set()
        self._arrived = anyio.Event()

    async def wait_working(self) -> None:
        while self.working == 0:
            await self._arrived.wait()


def agent_pids(marker: str) -> list[int]:
    """The live stubborn agents of this run (their command line names its effects file), and
    any process they forked that has not run its own program yet."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue
        state = stat[stat.rindex(b")") + 2 :].split()[0]
        # `python AGENT --effects MARKER`: not its launcher, nor the runtime, whose command
        # lines hold the agent's too
        if state in (b"Z", b"X") or cmdline[1:2] != [str(AGENT).encode()]:
            continue
        if marker.encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def effects(path: Path) -> list[tuple[int, str, str]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        pid, session, text = line.split(" ", 2)
        rows.append((int(pid), session, text))
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--sessions", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-upgrade-kill-"))
    effects_file = tmp / "effects.log"
    command = [
        sys.executable,
        "-m",
        "acp_once",
        "agent",
        "--runtime",
        "v1",
        "--store",
        f"sqlite:{tmp / 'sessions.sqlite3'}",
        "--",
        sys.executable,
        str(AGENT),
        "--effects",
        str(effects_file),
        "--grandchild",
    ]
    sessions: list[str] = []
    sent: list[tuple[str, str, str]] = []  # (session, key, text)
    first_ids: dict[str, str] = {}
    retried_same = 0
    gone_ms: list[float] = []
    not_gone = 0
    max_alive = 0
    max_on_session = 0
    stop = anyio.Event()

    async def sample() -> None:
        nonlocal max_alive
        while not stop.is_set():
            groups = set()
            for pid in agent_pids(str(effects_file)):
                try:
                    groups.add(os.getpgid(pid))
                except ProcessLookupError:
                    continue
            max_alive = max(max_alive, len(groups))
            with anyio.move_on_after(0.01):
                await stop.wait()

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(sample)
        for round_ in range(args.kills):
            rec = Recorder()
            with (
                open(tmp / "runtime.stderr", "ab") as errfile,  # noqa: ASYNC230
                anyio.fail_after(TIMEOUT),
            ):
                async with (
                    spawn(command, stderr=errfile.fileno()) as proc,
                    ClientSideConnection(rec, proc.frames) as conn,
                ):
                    await conn.agent.initialize(
                        s.InitializeRequest.model_validate(
                            {"protocolVersion": 2, "info": {"name": "bench", "version": "1"}}
                        )
                    )
                    if sent:  # the last round's prompt, retried after the kill
                        session, key, text = sent[-1]
                        await conn.agent.resume_session(
                            s.ResumeSessionRequest(session_id=session, cwd=str(tmp))
                        )
                        again = await conn.rpc.request("session/prompt", prompt(session, key, text))
                        retried_same += again["messageId"] == first_ids[key]
                    if len(sessions) < args.sessions:
                        new = await conn.agent.new_session(s.NewSessionRequest(cwd=str(tmp)))
                        sessions.append(new.session_id)
                        session = new.session_id
                    else:
                        session = sessions[round_ % args.sessions]
                        await conn.agent.resume_session(
                            s.ResumeSessionRequest(session_id=session, cwd=str(tmp))
                        )
                    key, text = f"bench-kill-{round_}", f"round {round_} [hang]"
                    answer = await conn.rpc.request("session/prompt", prompt(session, key, text))
                    first_ids[key] = answer["messageId"]
                    sent.append((session, key, text))
                    await rec.wait_working()
                    rows = effects(effects_file)
                    pid, child_session, _ = rows[-1]
                    served = {p for p, cs, _ in rows if cs == child_session}
                    alive = set(agent_pids(str(effects_file)))
                    max_on_session = max(max_on_session, len(served & alive))
                    pgid = os.getpgid(pid)
                    proc.process.kill()
                    await proc.process.wait()
                    killed = time.perf_counter()
                    with anyio.move_on_after(GONE_WITHIN) as scope:
                        while group_members(pgid):  # noqa: ASYNC110 (the process table)
                            await anyio.sleep(0.005)
                    if scope.cancelled_caught:
                        not_gone += 1
                    else:
                        gone_ms.append((time.perf_counter() - killed) * 1000)
            if (round_ + 1) % 20 == 0:
                print(f"  {round_ + 1} kills, {time.perf_counter() - started:.0f} s", flush=True)
        stop.set()
    counts = collections.Counter(text for _, _, text in effects(effects_file))
    texts = [text for _, _, text in sent]
    once = sum(counts[t] == 1 for t in texts)
    twice = sum(counts[t] > 1 for t in texts)
    lost = sum(counts[t] == 0 for t in texts)
    print(f"kills: {args.kills}, sessions: {args.sessions}, {time.perf_counter() - started:.0f} s")
    print(f"side effects: once {once}, twice or more {twice}, lost {lost}")
    print(f"retries answered with the first message id: {retried_same} of {len(sent) - 1}")
    print(
        f"agent process groups alive at once, most: {max_alive}; "
        f"agents alive on one v1 session, most: {max_on_session}"
    )
    if gone_ms:
        print(
            f"old child group gone after the SIGKILL: p50 {statistics.median(gone_ms):.0f} ms, "
            f"max {max(gone_ms):.0f} ms; not gone within {GONE_WITHIN:.0f} s: {not_gone}"
        )
    left = agent_pids(str(effects_file))
    print(f"agents left running at the end: {len(left)}")


def prompt(session: str, key: str, text: str) -> dict[str, Any]:
    return {
        "sessionId": session,
        "prompt": [{"type": "text", "text": text}],
        "idempotencyKey": key,
    }


if __name__ == "__main__":
    anyio.run(main)
