"""The upgrade runtime's cost per turn: the official Python SDK's v1 echo agent driven directly,
and the same agent behind `acp-once agent --runtime v1`, by the same v1 client.

    python3 dev.py run python benchmarks/bench_upgrade.py [N] [--rounds R] [--store memory|sqlite]

The agent is `bench_v1.py --sdk-agent` (written with `acp`, agent-client-protocol 0.12.1: its
turn sends the prompt's text back as one `agent_message_chunk` and ends with `end_turn`). The
client is the SDK's `ClientSideConnection` (v1): against the upgraded agent it is served by
acp-once's v1 face, so each turn is: v1 prompt -> v2 turn (the user message stored) -> v1
prompt to the child -> its chunk, sent on under a message id of ours -> the whole message and
the turn's marker stored -> the v1 answer.

One session per agent, 20 warm-up turns, then R rounds (default 5) of N sequential turns
(default 200) per agent, alternating round by round. Printed: turns per second of each per
round, the medians, the ratio (upgraded / bare) as the median of the per-round ratios, and the
CPU per turn of the bare agent, of the upgraded agent's own process and of its child (`/proc`).
Nothing is asserted: this prints figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import acp
from acp import schema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _proc import process_cpu_seconds
from bench_v1 import CountingClient

WARMUP = 20
SDK_AGENT = [sys.executable, str(Path(__file__).resolve().parent / "bench_v1.py"), "--sdk-agent"]


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


class Driven:
    """One agent process with an initialized v1 connection and a session."""

    def __init__(self, name: str, command: list[str]) -> None:
        self.name = name
        self.command = command
        self.client = CountingClient()
        self.rates: list[float] = []
        self.cpu: dict[int, float] = {}  # pid -> CPU seconds over the timed rounds
        self.timed_turns = 0
        self.conn: Any = None
        self.pids: list[int] = []  # the agent, then its children
        self.session_id = ""

    async def run(self, turns: int, *, timed: bool = True) -> float:
        before = len(self.client.updates)
        cpu0 = {pid: process_cpu_seconds(pid) for pid in self.pids}
        start = time.perf_counter()
        for i in range(turns):
            block = schema.TextContentBlock(type="text", text=f"echo {i}")
            done = await self.conn.prompt(session_id=self.session_id, prompt=[block])
            assert done.stop_reason == "end_turn", done
        elapsed = time.perf_counter() - start
        chunks = [
            u for u in self.client.updates[before:] if isinstance(u, schema.AgentMessageChunk)
        ]
        assert len(chunks) == turns, f"{self.name}: {len(chunks)} chunks for {turns} turns"
        if timed:
            for pid, first in cpu0.items():
                last = process_cpu_seconds(pid)
                if first is not None and last is not None:
                    self.cpu[pid] = self.cpu.get(pid, 0.0) + last - first
            self.timed_turns += turns
        return turns / elapsed


async def bench(turns: int, rounds: int, store: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store_url = "memory" if store == "memory" else f"sqlite:{Path(tmp) / 'sessions.db'}"
        upgraded = [sys.executable, "-m", "acp_once", "agent", "--runtime", "v1"]
        upgraded += ["--store", store_url, "--", *SDK_AGENT]
        agents = [
            Driven(f"upgraded SDK agent ({store})", upgraded),
            Driven("bare SDK agent", SDK_AGENT),
        ]
        async with contextlib.AsyncExitStack() as stack:
            for agent in agents:
                spawned = acp.spawn_agent_process(
                    cast(acp.Client, agent.client), agent.command[0], *agent.command[1:]
                )
                conn, process = await stack.enter_async_context(spawned)
                agent.conn = conn
                init = await conn.initialize(protocol_version=1)
                assert init.protocol_version == 1
                agent.session_id = (await conn.new_session(cwd=tmp)).session_id
                await agent.run(WARMUP, timed=False)
                agent.pids = [process.pid, *_children(process.pid)]
            load0 = os.getloadavg()[0]
            for r in range(rounds):
                order = agents if r % 2 == 0 else agents[::-1]
                for agent in order:
                    agent.rates.append(await agent.run(turns))
                print(
                    f"round {r + 1}: "
                    + ", ".join(f"{a.name} {a.rates[-1]:,.0f} turns/s" for a in agents),
                    flush=True,
                )
            load1 = os.getloadavg()[0]
    ours, bare = agents
    ratios = [a / b for a, b in zip(ours.rates, bare.rates, strict=True)]
    print()
    load = f"load {load0:.2f} -> {load1:.2f}"
    print(f"{turns} sequential v1 echo turns per round, {rounds} rounds, {load}")
    for agent in agents:
        print(f"  {agent.name:30} median {statistics.median(agent.rates):,.0f} turns/s")
    print(f"  ratio upgraded / bare (median of per-round ratios): {statistics.median(ratios):.2f}x")

    def per_turn(agent: Driven, pid: int) -> str:
        seconds = agent.cpu.get(pid)
        return "n/a" if seconds is None else f"{seconds / agent.timed_turns * 1e6:,.0f} us"

    if bare.pids and ours.pids:
        line = f"  CPU per turn: bare agent {per_turn(bare, bare.pids[0])}, "
        line += f"upgrade runtime {per_turn(ours, ours.pids[0])}"
        if len(ours.pids) > 1:
            line += f" + its child {per_turn(ours, ours.pids[1])}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("turns", nargs="?", type=int, default=200, help="turns per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--store", choices=["memory", "sqlite"], default="sqlite")
    args = parser.parse_args()
    asyncio.run(bench(args.turns, args.rounds, args.store))


if __name__ == "__main__":
    main()
