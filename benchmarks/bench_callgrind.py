"""Instructions per echo turn of the reference agent, counted by callgrind (repeatable).

    python3 dev.py run python benchmarks/bench_callgrind.py [N] [--store memory:|sqlite:PATH]
        [--keyed] [--sessions K] [--loop uvloop|asyncio]

The agent runs under `valgrind --tool=callgrind --instr-atstart=no`; the raw client of
`bench_agent.py` drives 200 warm-up turns, then instrumentation is switched on for N turns
(one session at a time, or K sessions busy at once) and off again. Instructions are counted in
user space, in every thread of the agent, whatever else the machine is doing: the same build
gives the same count to within a fraction of a percent, where turns/s moves by 10-20%. They
leave out the kernel (pipe reads and writes, wake-ups) and the cost of cache misses.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_agent import RawDriven, reference_command


def count(n: int, store: str, *, keyed: bool, sessions: int, loop: str) -> float:
    """Instructions per turn over `n` turns."""
    with tempfile.TemporaryDirectory(prefix="bench-callgrind-") as tmp:
        out = Path(tmp) / "callgrind.out"
        store = store.replace("TMP", tmp)
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}",
            *reference_command(store, Path(tmp) / "fx"),
        ]
        os.environ["ACP_ONCE_LOOP"] = loop
        agent = RawDriven("reference", command)
        try:
            first = agent.new_session()
            agent.measure([first], 200, keyed=keyed)
            ids = [agent.new_session() for _ in range(sessions)]
            control = shutil.which("callgrind_control") or "callgrind_control"
            subprocess.run(
                [control, "-i", "on", str(agent.proc.pid)], check=True, capture_output=True
            )
            agent.measure(ids, n, keyed=keyed)
            subprocess.run(
                [control, "-i", "off", str(agent.proc.pid)], check=True, capture_output=True
            )
        finally:
            agent.close()
        total = 0
        for part in Path(tmp).glob("callgrind.out*"):
            for line in part.read_text(encoding="utf-8", errors="replace").splitlines():
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
        turns = max(1, n // sessions) * sessions  # whole rounds, as `measure` runs them
        return total / turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("n", nargs="?", type=int, default=2_000, help="turns counted")
    parser.add_argument(
        "--store", default="memory:", help="memory: or sqlite:PATH (TMP: a temp dir)"
    )
    parser.add_argument("--keyed", action="store_true", help="a fresh key per prompt")
    parser.add_argument("--sessions", type=int, default=1, help="sessions busy at once")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed")
    per_turn = count(args.n, args.store, keyed=args.keyed, sessions=args.sessions, loop=args.loop)
    print(
        f"store={args.store} keyed={args.keyed} sessions={args.sessions} loop={args.loop}: "
        f"{per_turn:,.0f} instructions per echo turn"
    )


if __name__ == "__main__":
    main()
