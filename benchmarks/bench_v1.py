"""A v1 echo turn: `acp-once agent` (served in v1 by its v1 face) against the official Python
SDK's own agent, both driven by the official Python SDK's client over stdio.

    python3 dev.py run python benchmarks/bench_v1.py [N] [--rounds R] [--store memory|sqlite]

The SDK agent is this file run with `--sdk-agent`: an echo agent written with `acp`
(`agent-client-protocol` 0.12.1, v1), whose turn sends the prompt's text back as one
`agent_message_chunk` and ends with `end_turn`. `acp-once agent` (the reference agent) does
the same: its v2 turn emits the text as an `agent_message`, which the v1 face sends as one
`agent_message_chunk`, and the prompt is answered at the end of the turn.

One client (the SDK's `ClientSideConnection`, which keeps every update it receives) runs one
session per agent, 20 warm-up turns, then R rounds (default 5) of N sequential turns (default
300) per agent, the two agents alternating round by round. Each turn is one `session/prompt`
awaited to its `{stopReason}`. Printed: turns per second of each agent per round, the medians,
the ratio (acp-once / SDK) as the median of the per-round ratios, and each agent process's CPU
per turn over all timed rounds (`/proc`), with its ratio. Nothing is asserted: this prints
figures.
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

WARMUP = 20


class SdkEchoAgent:
    """The official SDK's agent: one chunk echoing the prompt, then `end_turn`."""

    def __init__(self) -> None:
        self._client: Any = None
        self._sessions = 0

    def on_connect(self, conn: Any) -> None:
        self._client = conn

    async def initialize(self, protocol_version: int, **kwargs: Any) -> schema.InitializeResponse:
        return schema.InitializeResponse(
            protocol_version=acp.PROTOCOL_VERSION,
            agent_capabilities=schema.AgentCapabilities(),
            agent_info=schema.Implementation(name="sdk-echo", version="0.12.1"),
        )

    async def new_session(self, cwd: str, **kwargs: Any) -> schema.NewSessionResponse:
        self._sessions += 1
        return schema.NewSessionResponse(session_id=f"sess-{self._sessions}")

    async def prompt(
        self, session_id: str, prompt: list[Any], **kwargs: Any
    ) -> schema.PromptResponse:
        text = "".join(getattr(block, "text", "") for block in prompt)
        await self._client.session_update(
            session_id=session_id, update=acp.update_agent_message_text(text)
        )
        return schema.PromptResponse(stop_reason="end_turn")

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        return None


class CountingClient:
    """The driving client: keeps the updates it receives (as an editor would)."""

    def __init__(self) -> None:
        self.updates: list[Any] = []

    def on_connect(self, conn: Any) -> None:
        return None

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        self.updates.append(update)

    async def request_permission(self, *args: Any, **kwargs: Any) -> Any:
        raise acp.RequestError.method_not_found("session/request_permission")


class Driven:
    """One agent process with an initialized v1 connection and a session."""

    def __init__(self, name: str, command: list[str]) -> None:
        self.name = name
        self.command = command
        self.client = CountingClient()
        self.rates: list[float] = []
        self.cpu: list[float] = []  # agent CPU seconds of each timed round
        self.timed_turns = 0
        self.conn: Any = None
        self.pid: int | None = None
        self.session_id = ""

    async def run(self, turns: int) -> float:
        assert self.conn is not None and self.pid is not None
        before = len(self.client.updates)
        cpu0 = process_cpu_seconds(self.pid)
        start = time.perf_counter()
        for i in range(turns):
            block = schema.TextContentBlock(type="text", text=f"echo {i}")
            done = await self.conn.prompt(session_id=self.session_id, prompt=[block])
            assert done.stop_reason == "end_turn", done
        elapsed = time.perf_counter() - start
        cpu1 = process_cpu_seconds(self.pid)
        assert len(self.client.updates) - before == turns, "one chunk per turn"
        if cpu0 is not None and cpu1 is not None:
            self.cpu.append(cpu1 - cpu0)
            self.timed_turns += turns
        return turns / elapsed


HERE = Path(__file__).resolve()


async def bench(turns: int, rounds: int, store: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store_url = "memory" if store == "memory" else f"sqlite:{Path(tmp) / 'sessions.db'}"
        acp_once = [sys.executable, "-m", "acp_once", "agent", "--store", store_url]
        acp_once += ["--side-effects", str(Path(tmp) / "effects")]
        agents = [
            Driven(f"acp-once agent ({store})", acp_once),
            Driven("official SDK agent", [sys.executable, str(HERE), "--sdk-agent"]),
        ]
        async with contextlib.AsyncExitStack() as stack:
            for agent in agents:
                spawned = acp.spawn_agent_process(
                    cast(acp.Client, agent.client), agent.command[0], *agent.command[1:]
                )
                conn, process = await stack.enter_async_context(spawned)
                agent.conn, agent.pid = conn, process.pid
                init = await conn.initialize(protocol_version=1)
                assert init.protocol_version == 1
                agent.session_id = (await conn.new_session(cwd=tmp)).session_id
                await agent.run(WARMUP)
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
    ours, theirs = agents
    ratios = [a / b for a, b in zip(ours.rates, theirs.rates, strict=True)]
    print()
    load = f"load {load0:.2f} -> {load1:.2f}"
    print(f"{turns} sequential v1 echo turns per round, {rounds} rounds, {load}")
    for agent in agents:
        print(f"  {agent.name:28} median {statistics.median(agent.rates):,.0f} turns/s")
    ratio = statistics.median(ratios)
    print(f"  ratio acp-once / SDK agent (median of per-round ratios): {ratio:.2f}x")
    if ours.cpu and theirs.cpu:
        # clock ticks of 10 ms: summed over every timed round, the CPU per turn is steadier
        # than wall time on a shared machine
        per_turn = [sum(a.cpu) / a.timed_turns for a in agents]
        print(
            f"  agent CPU per turn: acp-once {per_turn[0] * 1e6:,.0f} us, "
            f"SDK agent {per_turn[1] * 1e6:,.0f} us, "
            f"ratio (SDK / acp-once, >1 = acp-once cheaper) {per_turn[1] / per_turn[0]:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("turns", nargs="?", type=int, default=300, help="turns per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--store", choices=["memory", "sqlite"], default="memory")
    parser.add_argument("--sdk-agent", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sdk_agent:
        asyncio.run(acp.run_agent(cast(acp.Agent, SdkEchoAgent())))
        return
    asyncio.run(bench(args.turns, args.rounds, args.store))


if __name__ == "__main__":
    main()
