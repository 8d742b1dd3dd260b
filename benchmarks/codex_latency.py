"""What the upgrade runtime adds to a real agent's turn: Zed's Codex (codex-acp 0.16.0) running
a tool turn, driven directly and behind `acp-once agent --runtime v1`.

    python3 dev.py run python benchmarks/codex_latency.py [N] [--rounds R] [--store sqlite|memory]

Each turn is `run: echo x >> log.txt` against the scripted model of `tests/codex/
model_server.py` on loopback: two model requests (the `exec_command` call, then the answer
after its output), a real shell command, the answer streamed back. Three ways, one fresh
session each per round, alternating round by round (default 2 rounds of N = 50 turns, after 5
warm-up turns):

- bare: a v1 client on Codex's pipes; the turn ends with its `session/prompt` answer;
- upgraded, v2 keyed: our v2 client on the runtime's pipes, each prompt with its own key; the
  turn ends with the idle `state_update` that carries its stop reason;
- upgraded, v1 face: the bare client's v1 turn, against the runtime (no keys).

Printed per way: p50, p90 and p99 of the turn's wall time, the added milliseconds at p50 and
p99 (upgraded minus bare, over all turns; and at p50 as the median of each round's difference,
which a loaded machine disturbs less), and the CPU per turn of the runtime's own process and
of Codex (from `/proc`, over the measured turns). Nothing is asserted. Needs node and npm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the scripted model lives in tests/codex
sys.path.insert(0, str(ROOT / "benchmarks"))

from _proc import process_cpu_seconds  # noqa: E402

from acp_once.client import Client, ClientSideConnection  # noqa: E402
from acp_once.protocol import schema as s  # noqa: E402
from acp_once.rpc.connection import Connection  # noqa: E402
from acp_once.support.proctree import descendants  # noqa: E402
from acp_once.transports.stdio import AgentProcess, spawn  # noqa: E402
from acp_once.upgrade.translate import CLIENT_CAPABILITIES  # noqa: E402
from tests.codex.harness import Missing, install  # noqa: E402
from tests.codex.model_server import ModelServer, codex_home  # noqa: E402

TURN = "run: echo x >> log.txt"
WARMUP = 5
TIMEOUT = 60


def codex() -> str:
    try:
        return install()
    except (Missing, RuntimeError) as exc:
        raise SystemExit(f"codex_latency: cannot install codex-acp: {exc}") from exc


class IdleWaiter(Client):
    """A v2 client that wakes whoever waits for the end of a turn."""

    def __init__(self) -> None:
        self.ended = anyio.Event()

    async def session_update(self, params: s.UpdateSessionNotification) -> None:
        update = params.update.model_dump(by_alias=True, exclude_unset=True)
        if update.get("sessionUpdate") == "state_update" and "stopReason" in update:
            self.ended.set()


Turn = Callable[[], Awaitable[None]]


async def measure(
    command: list[str], env: dict[str, str], cwd: str, n: int, v2: bool
) -> tuple[list[float], float | None, float | None]:
    """N timed turns (after the warm-up) on a fresh process; returns the turn times in
    seconds and the CPU seconds per turn of the process spawned and of Codex under it (None
    when Codex is the process spawned)."""
    times: list[float] = []
    async with spawn(command, env=env, stderr=subprocess.DEVNULL) as proc:
        try:
            if v2:
                waiter = IdleWaiter()
                async with ClientSideConnection(waiter, proc.frames) as conn:
                    await conn.agent.initialize(
                        s.InitializeRequest.model_validate(
                            {"protocolVersion": 2, "info": {"name": "bench", "version": "1"}}
                        )
                    )
                    sid = (await conn.agent.new_session(s.NewSessionRequest(cwd=cwd))).session_id

                    async def turn() -> None:
                        waiter.ended = anyio.Event()
                        params = {
                            "sessionId": sid,
                            "prompt": [{"type": "text", "text": TURN}],
                            "idempotencyKey": str(uuid.uuid4()),
                        }
                        await conn.rpc.request("session/prompt", params, timeout=TIMEOUT)
                        with anyio.fail_after(TIMEOUT):
                            await waiter.ended.wait()

                    return await _timed(turn, proc, n, times)
            async with Connection(proc.frames, name="bench-v1") as rpc:
                # what the runtime tells Codex it has: the same Codex code paths both ways
                init = {"protocolVersion": 1, "clientCapabilities": CLIENT_CAPABILITIES}
                await rpc.request("initialize", init, timeout=TIMEOUT)
                new = {"cwd": cwd, "mcpServers": []}
                v1_sid = (await rpc.request("session/new", new, timeout=TIMEOUT))["sessionId"]

                async def v1_turn() -> None:
                    params = {"sessionId": v1_sid, "prompt": [{"type": "text", "text": TURN}]}
                    result: Any = await rpc.request("session/prompt", params, timeout=TIMEOUT)
                    assert result["stopReason"] == "end_turn", result

                return await _timed(v1_turn, proc, n, times)
        finally:
            for pid in descendants(proc.pid):  # Codex ignores its stdin's end
                os.kill(pid, 15)


async def _timed(
    turn: Turn, proc: AgentProcess, n: int, times: list[float]
) -> tuple[list[float], float | None, float | None]:
    for _ in range(WARMUP):
        await turn()
    children = descendants(proc.pid)
    child = next((pid for pid in children if "codex" in _exe(pid)), None)
    own0 = process_cpu_seconds(proc.pid) or 0.0
    child0 = process_cpu_seconds(child) if child is not None else None
    for _ in range(n):
        started = time.perf_counter()
        await turn()
        times.append(time.perf_counter() - started)
    own = ((process_cpu_seconds(proc.pid) or 0.0) - own0) / n
    codex_cpu = None
    if child is not None and child0 is not None:
        codex_cpu = ((process_cpu_seconds(child) or 0.0) - child0) / n
    return times, own, codex_cpu


def _exe(pid: int) -> str:
    try:
        return os.path.realpath(f"/proc/{pid}/exe")
    except OSError:
        return ""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def main_async(n: int, rounds: int, store: str) -> None:
    binary = codex()
    ways = ["bare", "upgraded, v2 keyed", "upgraded, v1 face"]
    times: dict[str, list[float]] = {w: [] for w in ways}
    round_p50: dict[str, list[float]] = {w: [] for w in ways}
    own_cpu: dict[str, list[float]] = {w: [] for w in ways}
    codex_cpu: dict[str, list[float]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory(prefix="codex-latency-") as tmp, ModelServer() as model:
        env = {**os.environ, **codex_home(Path(tmp) / "codex-home", model.base_url)}
        for r in range(rounds):
            for way in ways if r % 2 == 0 else reversed(ways):
                work = Path(tmp) / f"work-{r}-{ways.index(way)}"
                work.mkdir()
                if way == "bare":
                    command = [binary]
                else:
                    url = "memory:" if store == "memory" else f"sqlite:{work / 's.sqlite3'}"
                    command = [sys.executable, "-m", "acp_once", "agent", "--runtime", "v1"]
                    command += ["--store", url, "--", binary]
                took, own, child = await measure(command, env, str(work), n, v2="v2" in way)
                times[way] += took
                round_p50[way].append(pct(took, 0.5))
                if way == "bare":
                    if own is not None:
                        codex_cpu[way].append(own)
                else:
                    if own is not None:
                        own_cpu[way].append(own)
                    if child is not None:
                        codex_cpu[way].append(child)
                print(
                    f"round {r + 1} {way:20} p50 {pct(took, 0.5) * 1e3:7.1f} ms"
                    f"  p99 {pct(took, 0.99) * 1e3:7.1f} ms",
                    flush=True,
                )
    bare = times["bare"]
    print(f"\nload average {os.getloadavg()[0]:.2f}; {rounds} rounds of {n} turns; store {store}")
    print(
        "| way | p50 | p90 | p99 | added p50 | added p99 | added p50, median of rounds"
        " | runtime CPU/turn | Codex CPU/turn |"
    )
    print("| - | -: | -: | -: | -: | -: | -: | -: | -: |")
    for way in ways:
        t = times[way]
        added = (
            ("-", "-")
            if way == "bare"
            else (
                f"{(pct(t, 0.5) - pct(bare, 0.5)) * 1e3:+.1f} ms",
                f"{(pct(t, 0.99) - pct(bare, 0.99)) * 1e3:+.1f} ms",
            )
        )
        diffs = [a - b for a, b in zip(round_p50[way], round_p50["bare"], strict=True)]
        paired = "-" if way == "bare" else f"{statistics.median(diffs) * 1e3:+.1f} ms"
        runtime = f"{statistics.mean(own_cpu[way]) * 1e3:.1f} ms" if own_cpu[way] else "-"
        cx = f"{statistics.mean(codex_cpu[way]) * 1e3:.1f} ms" if codex_cpu[way] else "-"
        print(
            f"| {way} | {pct(t, 0.5) * 1e3:.1f} ms | {pct(t, 0.9) * 1e3:.1f} ms |"
            f" {pct(t, 0.99) * 1e3:.1f} ms | {added[0]} | {added[1]} | {paired} | {runtime} |"
            f" {cx} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", nargs="?", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--store", choices=["sqlite", "memory"], default="sqlite")
    args = parser.parse_args()
    anyio.run(main_async, args.n, args.rounds, args.store)


if __name__ == "__main__":
    main()
