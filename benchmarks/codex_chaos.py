"""Chaos with a real agent: Zed's Codex (codex-acp 0.16.0) behind `acp-once agent --runtime v1`,
N keyed prompts with a side effect each, while the runtime is SIGKILLed at random and answers
are cut; then the same without keys.

    python3 dev.py run python benchmarks/codex_chaos.py [N] [--seed S] [--cut-rate P]
        [--no-baseline]

It is `acp-once demo --agent-cmd` (acp_once.demo.run_demo) with Codex against the scripted
model of `tests/codex/model_server.py` on loopback: submission i's prompt is `run: echo i >>
effects.log`, so Codex runs a shell command that appends the line `i` in the sessions'
directory. Faults: the killer SIGKILLs the runtime with Codex and its tools every 0.2-1.0 s; a
share P of insertions (default 0.05) kills it right after the commit, before the answer (a cut
answer); the client restarts twice. Then it counts, from the store and the file, each
submission's user messages (once / twice or more / lost) and lines (once / twice or more /
none), the turns a fault interrupted (no stored answer: reported `stopReason: error`, never run
again), kills and cuts. Target (with keys): 0 inserted twice, 0 lost, 0 side effects twice.
Needs node and npm (`scripts/codex.py` installs codex-acp into `.tools/`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import anyio
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the scripted model lives in tests/codex

from acp_once.agent.state import ended_message  # noqa: E402
from acp_once.demo import DemoResult, run_demo  # noqa: E402
from acp_once.storage import open_store  # noqa: E402
from tests.codex.harness import Missing, install  # noqa: E402
from tests.codex.model_server import ModelServer, codex_home  # noqa: E402

PROMPT = "run: echo {i} >> effects.log"


def codex() -> str:
    try:
        return install()
    except (Missing, RuntimeError) as exc:
        raise SystemExit(f"codex_chaos: cannot install codex-acp: {exc}") from exc


async def interrupted_submissions(workdir: Path, session_ids: list[str]) -> set[int]:
    """The submissions whose turn stored no answer (a fault ended it first)."""
    found: set[int] = set()
    async with open_store(f"sqlite:{workdir / 'agent.sqlite3'}") as store:
        for sid in session_ids:
            current: int | None = None
            answered = True
            for entry in await store.read_timeline_tail(sid, limit=100_000):
                update = orjson.loads(entry.update)
                kind = update.get("sessionUpdate")
                if kind == "user_message" and entry.message_id is not None:
                    text = str((update.get("content") or [{}])[0].get("text", ""))
                    current = int(text.split()[2]) if text.startswith("run: echo ") else None
                    answered = False
                elif kind == "agent_message":
                    answered = True
                elif ended_message(update) is not None and current is not None:
                    if not answered:
                        found.add(current)
                    current = None
    return found


def effect_counts(workdir: Path, n: int, interrupted: set[int]) -> Counter[str]:
    """How many submissions have their line once, twice or more, or not at all, and how many
    have none although their turn was not interrupted."""
    log = workdir / "work" / "effects.log"
    lines = Counter(log.read_text().split()) if log.exists() else Counter()
    tally: Counter[str] = Counter()
    for i in range(n):
        copies = lines.get(str(i), 0)
        tally["once" if copies == 1 else "twice+" if copies > 1 else "none"] += 1
        tally["none, not interrupted"] += int(copies == 0 and i not in interrupted)
    return tally


async def one_run(binary: str, keys: bool, n: int, seed: int, cut_rate: float) -> None:
    with tempfile.TemporaryDirectory(prefix="codex-chaos-") as tmp:
        workdir = Path(tmp)
        with ModelServer() as model:
            env = codex_home(workdir / "codex-home", model.base_url)
            result: DemoResult = await run_demo(
                keys=keys,
                submissions=n,
                seed=seed,
                workdir=workdir,
                cut_rate=cut_rate,
                agent_cmd=[binary],
                prompt=PROMPT,
                effects=True,
                env=env,
            )
            requests = len(model.requests)
        sessions = list(result.session_ids)
        effects = effect_counts(workdir, n, await interrupted_submissions(workdir, sessions))
    print(
        f"| {'keys' if keys else 'no keys'} | {result.submissions} | {result.inserted_once} |"
        f" {result.inserted_twice_or_more} | {result.lost} | {effects['once']} |"
        f" {effects['twice+']} | {effects['none']} ({effects['none, not interrupted']}) |"
        f" {result.interrupted_turns} |"
        f" {result.agent_kills} | {result.cut_answers} | {result.client_restarts} |"
        f" {requests} | {result.seconds:.0f} s |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", nargs="?", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cut-rate", type=float, default=0.05)
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without keys")
    args = parser.parse_args()
    binary = codex()
    print(f"codex-acp: {binary}; load average {os.getloadavg()[0]:.2f}", flush=True)
    print(
        "| run | submitted | inserted once | 2+ | lost | side effect once | 2+ |"
        " none (of turns not interrupted) |"
        " interrupted | kills | cut answers | client restarts | model requests | time |"
    )
    print("| - |" + " -: |" * 13)
    for keys in (True,) if args.no_baseline else (True, False):
        anyio.run(one_run, binary, keys, args.n, args.seed, args.cut_rate)


if __name__ == "__main__":
    main()
