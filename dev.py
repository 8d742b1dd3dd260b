#!/usr/bin/env python3
"""Set up the project's environment and run its jobs, with nothing but Python 3.11+ present.

    python3 dev.py demo          # the main job: `acp-once demo`
    python3 dev.py test          # lint, format check, types, import layering, tests
                                 # (extra arguments go to pytest, e.g. -k NAME -n 0); it
                                 # model-checks with SPIN and a C compiler (gcc) first:
                                 # installed with apt-get when run as root, else it stops
                                 # at once with the command that installs them
    python3 dev.py run CMD ...   # any command inside the environment (e.g. `acp-once agent`)
    python3 dev.py docs          # the documentation site into build/site/ (mkdocs, warnings
                                 # are errors; `test` runs the same build)
    python3 dev.py verify        # model-check verification/*.pml with SPIN (--mutants: each
                                 # model with one guard removed at a time must fail, and each
                                 # code mutant of verification/mutants/ must fail its tests)

The first call installs uv into `.tools/` (a private virtual environment) and creates `.venv`
from the committed `uv.lock`; later calls only check that both are current.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import venv
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent
TOOLS = ROOT / ".tools"
UV_SPEC = "uv>=0.5,<1"


def _uv() -> Path:
    bindir = TOOLS / ("Scripts" if os.name == "nt" else "bin")
    uv = bindir / ("uv.exe" if os.name == "nt" else "uv")
    if not uv.exists():
        print("dev.py: installing uv into .tools/", file=sys.stderr)
        venv.EnvBuilder(with_pip=True, clear=True).create(TOOLS)
        pip = bindir / ("pip.exe" if os.name == "nt" else "pip")
        subprocess.run([str(pip), "install", "--quiet", UV_SPEC], check=True)
    return uv


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # Use the interpreter that runs this script; never download one.
    env.setdefault("UV_PYTHON", sys.executable)
    env["UV_PYTHON_DOWNLOADS"] = "never"
    env.setdefault("UV_PROJECT_ENVIRONMENT", str(ROOT / ".venv"))
    return env


def _run(*args: str) -> None:
    code = subprocess.run(list(args), cwd=ROOT, env=_env()).returncode
    if code != 0:
        raise SystemExit(code)


def sync() -> Path:
    uv = _uv()
    # every extra: the tests cover the optional adapters too (the LangGraph one).
    # Bytecode is written here, explicitly: where PYTHONDONTWRITEBYTECODE is set (as on the
    # machines this project is built and tested on) no import writes it, and every agent
    # subprocess would compile each module it imports again (measured: an agent answered
    # `initialize` after 1,128 ms instead of 550, and importing LangGraph took 4.0 s, not 2.0).
    _run(str(uv), "sync", "--frozen", "--all-extras", "--quiet", "--compile-bytecode")
    _run(str(uv), "run", "--frozen", "--no-sync", "python", "-m", "compileall", "-q", "src")
    return uv


# -- verify: the Promela models of verification/ (docs/verification.md) ----------------------

# (name, file, flags, bound, mode). "safety": exhaustive search for assertion violations and
# invalid end states (-DSAFETY). "liveness": search for acceptance cycles of the model's LTL
# property under weak fairness (-a -f); a hang (a dead end or a cycle without progress)
# violates it. Each search must be complete: a run cut short by the depth or memory bound
# fails, whatever it found.
MODELS = [
    (
        "agent",
        "agent.pml",
        ["-DFAULTS=2"],
        "2 sessions (2 keys + 1 key), 4 requests, 2 faults, group commit, hold+steer",
        "safety",
    ),
    (
        "agent-live",
        "agent.pml",
        ["-DFAULTS=1"],
        "as agent, 1 fault; LTL <>(every client ended) under weak fairness",
        "liveness",
    ),
    (
        "cluster",
        "cluster.pml",
        ["-DFAULTS=2"],
        "2 nodes, 1 key, 2 requests, 2 rows, 2 faults, hold+steer, sticky leases",
        "safety",
    ),
    (
        "cluster-live",
        "cluster.pml",
        ["-DFAULTS=2"],
        "as cluster; LTL <>(the client ended) under weak fairness",
        "liveness",
    ),
    (
        "turns",
        "turns.pml",
        ["-DN=3", "-DFAULTS=3"],
        "3 messages, 3 process deaths, 1 cancel, hold+steer, recovery policy report",
        "safety",
    ),
    (
        "turns-continue",
        "turns.pml",
        ["-DN=3", "-DFAULTS=3", "-DPOLICY=1"],
        "as turns, recovery policy continue",
        "safety",
    ),
]
# (model, guard removed): each must give a counterexample in one of the model's runs
MUTANTS = [
    ("agent", "KEY_APART"),  # the key committed in a transaction apart from its message
    ("agent", "RETRY_EARLY"),  # a retry answered with the id before the original commits
    ("agent", "WITHDRAW_ONE"),  # a withdrawal answers only the cancelled request
    ("agent", "WITHDRAW_INSERTING"),  # a prompt withdrawn while its insert is in flight
    ("agent", "NO_LOOKUP"),  # a failed insert answered -32603 without looking the key up
    ("agent", "NO_UNIQUE"),  # no unique (session, key): the insert does not check the key
    ("agent", "CANCEL_INSERT"),  # a cancelled handler withdraws its queued write, pending left
    ("agent", "KEY_GLOBAL"),  # the key looked up without its session
    ("agent", "MARK_FIRST"),  # a session/cancel mark checked before the key: -32800 for a used key
    ("cluster", "NO_FENCE"),  # a write that does not check the fencing token
    ("cluster", "TAKE_UNEXPIRED"),  # a lease taken from a live owner (no expiry)
    ("cluster", "ROW_UNGUARDED"),  # a queued row inserted without state = 'queued'
    ("cluster", "NO_POLL"),  # outcomes only by NOTIFY (a lost one leaves a waiter)
    ("cluster", "WITHDRAW_RECORDED"),  # a row withdrawn although its key was inserted
    ("cluster", "FENCE_NO_LOOKUP"),  # a fenced refusal answered -32603 without a lookup
    ("cluster", "NO_QUEUE_INSERT"),  # the owner never inserts a queued row
    ("cluster", "NO_TAKEOVER"),  # a waiting node never takes a dead owner's lease over
    ("cluster", "NO_ANSWER"),  # an inserted row's waiters are never answered
    ("cluster", "CANCEL_ADMIT"),  # a cancelled admission leaves its prompt registered
    ("cluster", "KEPT_UNFENCED"),  # the insert on a kept (idle) lease trusts the local lease map
    ("cluster", "RELEASE_QUEUED"),  # the lease released after its grace with prompts queued
    ("cluster", "NO_PICKUP"),  # an idle owner never starts on prompts queued behind it
    ("turns", "REPORT_UNSTORED"),  # an interrupted turn's end told, never stored
    ("turns", "RERUN_ENDED"),  # recovery ignores end records
    ("turns", "RERUN_UNMARKED"),  # continue runs a turn again without its marker first
    ("turns", "DROPPED_UNENDED"),  # a cancel drops queued turns without their end records
    ("turns", "DROPPED_KEPT"),  # a cancel ends queued turns but leaves them queued
    ("turns", "START_UNMARKED"),  # a queued turn runs without its "started" marker first
]
# mutants that make a client wait for ever: tried on the liveness search first
LIVENESS_MUTANTS = {
    "CANCEL_INSERT",
    "NO_POLL",
    "NO_QUEUE_INSERT",
    "NO_TAKEOVER",
    "NO_ANSWER",
    "CANCEL_ADMIT",
    "NO_PICKUP",
}
PAN_DEPTH = 1_000_000  # -m: deeper than any model's reachable depth (the run checks it)
_INCOMPLETE = (
    "Search not completed",
    "max search depth too small",
    "reached -DMEMLIM bound",
    "out of memory",
)


def _need(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        print(
            f"dev.py verify: `{tool}` is missing; install Debian's `{package}` package"
            f" (apt-get install -y {package})",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return path


TEST_TOOLS = {"spin": "spin", "gcc": "gcc"}
"""What `test` needs beyond Python (the model check): command -> Debian package."""


def test_tools() -> None:
    """SPIN and gcc on PATH before `test` starts anything: installed with apt-get when this
    runs as root with apt-get present (as `.ci/run` does), else a stop (exit 2) with the exact
    install line."""
    missing = [pkg for tool, pkg in TEST_TOOLS.items() if shutil.which(tool) is None]
    if not missing:
        return
    apt = shutil.which("apt-get")
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    if apt is not None and root:
        print(f"dev.py: installing {' '.join(missing)} (apt-get)", file=sys.stderr, flush=True)
        install = [apt, "install", "-y", *missing]
        if subprocess.run(install).returncode != 0:
            subprocess.run([apt, "update"], check=False)
            subprocess.run(install, check=False)
        missing = [pkg for tool, pkg in TEST_TOOLS.items() if shutil.which(tool) is None]
        if not missing:
            return
    print(
        f"dev.py test: the model check needs {' and '.join(missing)}, not found on PATH; "
        f"install {'them' if len(missing) > 1 else 'it'} and run again: "
        f"sudo apt-get install -y {' '.join(missing)}  (Debian, Ubuntu; elsewhere SPIN from "
        "https://spinroot.com and any gcc)",
        file=sys.stderr,
    )
    raise SystemExit(2)


def _pan_flags(mode: str, depth: int) -> tuple[list[str], list[str]]:
    """The compiler's and the verifier's flags for a safety or a liveness search."""
    cc = ["-DMEMLIM=4096", "-DCOLLAPSE"]
    if mode == "safety":
        return [*cc, "-DSAFETY", "-DNOCLAIM"], [f"-m{depth}"]
    return [*cc, "-DNFAIR=3"], ["-a", "-f", f"-m{depth}"]


def _check(model: str, flags: list[str], mode: str, depth: int = PAN_DEPTH) -> dict[str, str]:
    """Generate, compile and run one verifier: its errors, states, depth, first message and
    whether the search was complete."""
    spin, gcc = _need("spin", "spin"), _need("gcc", "gcc")
    cc_flags, pan_flags = _pan_flags(mode, depth)
    with tempfile.TemporaryDirectory(prefix="acp-once-verify-") as tmp:
        shutil.copy(ROOT / "verification" / model, tmp)
        subprocess.run([spin, *flags, "-a", model], cwd=tmp, check=True, capture_output=True)
        cc = [gcc, "-O2", "-w", *cc_flags, "-o", "pan", "pan.c"]
        subprocess.run(cc, cwd=tmp, check=True, capture_output=True)
        run = subprocess.run(["./pan", *pan_flags], cwd=tmp, capture_output=True, text=True)
    out = run.stdout + run.stderr
    errors = re.search(r"errors: (\d+)", out)
    states = re.search(r"(\d+) states, stored", out)
    reached = re.search(r"depth reached (\d+)", out)
    first = re.search(r"pan:1: (.*)", out)
    return {
        "errors": errors.group(1) if errors else "?",
        "states": states.group(1) if states else "?",
        "depth": reached.group(1) if reached else "?",
        "why": first.group(1).strip() if first else "",
        "complete": "yes" if errors and not any(m in out for m in _INCOMPLETE) else "no",
        "pan": " ".join([*flags, *cc_flags, *pan_flags]),
    }


def _passed(res: dict[str, str]) -> bool:
    """A model passes: no counterexample, and the search was complete."""
    return res["errors"] == "0" and res["complete"] == "yes"


def _caught(res: dict[str, str]) -> bool:
    """A mutant is caught by a real counterexample (a trail), never by a search cut short."""
    return res["errors"] not in ("0", "?") and res["why"] != ""


def _model_mutant(name: str, mutant: str, depth: int) -> tuple[str, bool, str]:
    """Run the model's searches with the mutant, safety first, until one gives a trail."""
    why = "NOT CAUGHT"
    runs = [m for m in MODELS if m[0].split("-")[0] == name]
    runs.sort(key=lambda m: (m[4] == "liveness") != (mutant in LIVENESS_MUTANTS))
    for run, model, fl, _, mode in runs:
        res = _check(model, [*fl, f"-DMUTANT_{mutant}"], mode, depth)
        if _caught(res):
            return f"{name}/{mutant}", True, f"{run}: {res['why']}"
        if res["complete"] != "yes":
            why = f"NOT CAUGHT ({run}: search not completed)"
    return f"{name}/{mutant}", False, why


def _print_mutants(results: list[tuple[str, bool, str]]) -> bool:
    """Print each mutant's result and `mutants caught: K/N`; True when all were caught."""
    for name, caught, why in results:
        print(f"mutant {name}: " + (why if caught else why or "NOT CAUGHT"))
    caught_all = sum(caught for _, caught, _ in results)
    print(f"mutants caught: {caught_all}/{len(results)}", flush=True)
    return caught_all == len(results)


def _code_mutants() -> list[tuple[str, bool, str]]:
    """Run the code mutants of verification/mutants/*.toml (verification/mutate.py), each
    against the tests it names. Needs the environment (created here) and, for the mutants
    whose tests use PostgreSQL, `ACP_ONCE_TEST_POSTGRES_DSN`: without it their runs are
    reported "not run", which fails under CI=true only."""
    uv = sync()
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "verification" / "mutate.py")
    assert spec is not None and spec.loader is not None
    mutate = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = mutate  # its dataclass looks its module up while being made
    spec.loader.exec_module(mutate)
    mutants = mutate.load(ROOT / "verification" / "mutants")
    python = [str(uv), "run", "--frozen", "--no-sync", "python"]
    strict = os.environ.get("CI") == "true"
    results: list[tuple[str, bool, str]] = []
    skipped = 0
    for mutant, verdict, why in mutate.run(ROOT, python, mutants):
        name = f"code/{mutant.name}" + (f" ({mutant.model})" if mutant.model else "")
        if verdict == mutate.NOT_RUN and not strict:
            skipped += 1
            print(f"mutant {name}: not run ({why})")
            continue
        shown = why if verdict != mutate.NOT_RUN else f"NOT RUN: {why}"
        results.append((name, verdict == mutate.CAUGHT, shown))
    if skipped:
        print(f"dev.py verify: {skipped} code mutants not run (set ACP_ONCE_TEST_POSTGRES_DSN)")
    return results


def verify(args: list[str]) -> None:
    """`verify [--mutants] [--no-code] [--depth N] [--model NAME]`: --mutants also runs each
    model mutant and, unless --no-code or --model is given, each code mutant; --depth bounds
    the search depth (a search it cuts short fails: that is how to show an incomplete search
    is not a pass); --model runs one model (by its name in MODELS) and the mutants of its
    file."""
    depth = PAN_DEPTH
    only: str | None = None
    if "--depth" in args:
        depth = int(args[args.index("--depth") + 1])
    if "--model" in args:
        only = args[args.index("--model") + 1]
    models = [m for m in MODELS if only is None or m[0] == only]
    failed = False
    results: list[tuple[str, bool, str]] = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [(m, pool.submit(_check, m[1], m[2], m[4], depth)) for m in models]
        for (name, _, _, bound, mode), run in runs:
            res = run.result()
            ok = _passed(res)
            failed |= not ok
            if ok:
                verdict = "no counterexample"
            elif res["errors"] not in ("0", "?"):
                verdict = f"COUNTEREXAMPLE: {res['why']}"
            else:
                verdict = "SEARCH NOT COMPLETED (a bound was hit: not a pass)"
            print(f"verify {name:12} {mode}, bound: {bound}")
            print(
                f"verify {name:12} states: {res['states']:>9}  depth reached: {res['depth']:>4}"
                f"  flags: {res['pan']}"
            )
            print(f"verify {name:12} {verdict}", flush=True)
        if "--mutants" in args:
            files = {m[0].split("-")[0] for m in models}
            jobs = [pool.submit(_model_mutant, n, m, depth) for n, m in MUTANTS if n in files]
            results = [job.result() for job in jobs]
    if "--mutants" in args:
        if only is None and "--no-code" not in args:
            results += _code_mutants()
        failed |= not _print_mutants(results)
    if failed:
        raise SystemExit(1)


def docs(uv: Path, site_dir: str | None = None) -> None:
    """Build the site (mkdocs.yml) with warnings as errors: a broken link, a docstring griffe
    cannot read, a public name without its API entry or a guide's code that is gone fails."""
    env = {**_env(), "NO_MKDOCS_2_WARNING": "1"}  # the theme's banner about MkDocs 2.0
    args = [str(uv), "run", "--frozen", "--no-sync", "mkdocs", "build", "--strict"]
    if site_dir is not None:
        args += ["--site-dir", site_dir]
    print(f"dev.py: {' '.join(args[4:])}", file=sys.stderr, flush=True)
    code = subprocess.run(args, cwd=ROOT, env=env).returncode
    if code != 0:
        raise SystemExit(code)


def main(argv: list[str]) -> None:
    job = argv[0] if argv else "help"
    if job == "test":
        test_tools()  # before anything else: a missing tool stops the run at once
        # the models and the mutants first: a counterexample says more than a failing example
        verify(["--mutants"])
        uv = sync()
        for step in (
            ["ruff", "check", "."],
            ["ruff", "format", "--check", "."],
            ["mypy"],
            ["lint-imports"],
            # one worker per CPU (at most 4): most tests wait on subprocesses and sockets;
            # `python3 dev.py test -n 0` runs them in this process, one at a time
            # the ten slowest tests are printed, so one creeping towards ~60 s shows
            ["pytest", "-n", "auto", "--maxprocesses", "4", "--durations", "10", *argv[1:]],
        ):
            print(f"dev.py: {' '.join(step)}", file=sys.stderr, flush=True)
            _run(str(uv), "run", "--frozen", "--no-sync", *step)
            if step == ["lint-imports"]:
                # the docs after the linters, before the tests (a few seconds)
                with tempfile.TemporaryDirectory(prefix="acp-once-site-") as site:
                    docs(uv, site)
    elif job == "demo":
        uv = sync()
        _run(str(uv), "run", "--frozen", "--no-sync", "acp-once", "demo", *argv[1:])
    elif job == "run":
        uv = sync()
        _run(str(uv), "run", "--frozen", "--no-sync", *argv[1:])
    elif job == "docs":
        docs(sync())
    elif job == "verify":
        verify(argv[1:])
    elif job == "lock":
        _run(str(_uv()), "lock")
    else:
        print(__doc__)
        raise SystemExit(0 if job == "help" else 2)


if __name__ == "__main__":
    main(sys.argv[1:])
