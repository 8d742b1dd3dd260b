"""JSON-RPC round trips per second over a real stdio pipe (request + response, small params).

    python3 dev.py run python benchmarks/bench_stdio_roundtrip.py [N]

Spawns the tiny test agent as a subprocess and sends `_echo` requests: first one at a time
(latency-bound), then 32 in flight (throughput-bound). Prints the figures, with the CPU time
per round trip of the agent process (from /proc, Linux) and of this client: on a busy machine
they move far less than the rates do.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import anyio
from _proc import process_cpu_seconds

from acp_once.client import Client, ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.transports.stdio import spawn

AGENT = Path(__file__).resolve().parent.parent / "tests" / "agents" / "tiny_agent.py"


def _cpu_us(before: tuple[float | None, float], after: tuple[float | None, float], n: int) -> str:
    agent0, client0 = before
    agent1, client1 = after
    agent = "n/a" if agent0 is None or agent1 is None else f"{(agent1 - agent0) / n * 1e6:.0f}"
    return f"CPU us each: agent {agent}, client {(client1 - client0) / n * 1e6:.0f}"


async def main(n: int) -> None:
    async with (
        spawn([sys.executable, str(AGENT)]) as proc,
        ClientSideConnection(Client(), proc.frames) as conn,
    ):
        await conn.agent.initialize(
            s.InitializeRequest.model_validate(
                {"protocolVersion": 2, "info": {"name": "bench", "version": "1"}}
            )
        )
        params = {"sessionId": "sess_1", "n": 1, "text": "hello"}
        for _ in range(200):  # warm up
            await conn.agent.ext_request("_echo", params)

        cpu0 = (process_cpu_seconds(proc.pid), time.process_time())
        start = time.perf_counter()
        for _ in range(n):
            await conn.agent.ext_request("_echo", params)
        sequential = n / (time.perf_counter() - start)
        sequential_cpu = _cpu_us(cpu0, (process_cpu_seconds(proc.pid), time.process_time()), n)

        in_flight = 32
        per_task = n // in_flight

        async def worker() -> None:
            for _ in range(per_task):
                await conn.agent.ext_request("_echo", params)

        cpu0 = (process_cpu_seconds(proc.pid), time.process_time())
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(in_flight):
                tg.start_soon(worker)
        concurrent = per_task * in_flight / (time.perf_counter() - start)
        concurrent_cpu = _cpu_us(
            cpu0, (process_cpu_seconds(proc.pid), time.process_time()), per_task * in_flight
        )

    print(
        f"stdio round trips, sequential:   {sequential:>9,.0f} /s  ({1e6 / sequential:.0f} us each;"
        f" {sequential_cpu})"
    )
    print(f"stdio round trips, 32 in flight: {concurrent:>9,.0f} /s  ({concurrent_cpu})")


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 20_000)
