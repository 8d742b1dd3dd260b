#!/usr/bin/env python3
"""Set up the project's environment and run its jobs, with nothing but Python 3.11+ present.

    python3 dev.py demo          # the main job: `acp-once demo`
    python3 dev.py test          # lint, format check, types, import layering, tests
                                 # (extra arguments go to pytest, e.g. -k NAME -n 0)
    python3 dev.py run CMD ...   # any command inside the environment (e.g. `acp-once agent`)
    python3 dev.py docs          # the documentation site into build/site/ (mkdocs, warnings
                                 # are errors; `test` runs the same build)
    python3 dev.py verify        # model-check verification/*.pml with SPIN (--mutants: each
                                 # model with one guard removed at a time must fail)

The first call installs uv into `.tools/` (a private virtual environment) and creates `.venv`
from the committed `uv.lock`; later calls only check that both are current.
"""

from __future__ import annotations

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

# (name, file, flags, bound): each run exhaustively (-DSAFETY: assertions and end states).
MODELS = [
    (
        "agent",
        "agent.pml",
        ["-DFAULTS=2"],
        "1 agent, 2 keys, 4 requests, 2 faults, hold+steer, retained+live-only",
    ),
    (
        "cluster",
        "cluster.pml",
        ["-DFAULTS=2"],
        "2 nodes, 1 key, 2 requests, 2 faults (kill, stall, lost NOTIFY, close, cancel)",
    ),
]
# (model, guard removed): each must give a counterexample
MUTANTS = [
    ("agent", "KEY_APART"),  # the key committed in a transaction apart from its message
    ("agent", "RETRY_EARLY"),  # a retry answered with the id before the original commits
    ("agent", "WITHDRAW_ONE"),  # a withdrawal answers only the cancelled request
    ("agent", "WITHDRAW_INSERTING"),  # a prompt withdrawn while its insert is in flight
    ("agent", "NO_LOOKUP"),  # a failed insert answered -32603 without looking the key up
    ("agent", "NO_UNIQUE"),  # no unique (session, key): the insert does not check the key
    ("cluster", "NO_FENCE"),  # a write that does not check the fencing token
    ("cluster", "TAKE_UNEXPIRED"),  # a lease taken from a live owner (no expiry)
    ("cluster", "ROW_UNGUARDED"),  # a queued row inserted without state = 'queued'
    ("cluster", "NO_POLL"),  # outcomes only by NOTIFY (a lost one leaves a waiter)
    ("cluster", "WITHDRAW_RECORDED"),  # a row withdrawn although its key was inserted
]


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


def _check(model: str, flags: list[str]) -> dict[str, str]:
    """Generate, compile and run one verifier; its states, errors and first message."""
    spin, gcc = _need("spin", "spin"), _need("gcc", "gcc")
    with tempfile.TemporaryDirectory(prefix="acp-once-verify-") as tmp:
        shutil.copy(ROOT / "verification" / model, tmp)
        subprocess.run([spin, *flags, "-a", model], cwd=tmp, check=True, capture_output=True)
        cc = [gcc, "-O2", "-w", "-DSAFETY", "-DMEMLIM=2048", "-o", "pan", "pan.c"]
        subprocess.run(cc, cwd=tmp, check=True, capture_output=True)
        out = subprocess.run(["./pan", "-m200000"], cwd=tmp, capture_output=True, text=True).stdout
    errors = re.search(r"errors: (\d+)", out)
    states = re.search(r"(\d+) states, stored", out)
    first = re.search(r"pan:1: (.*)", out)
    return {
        "errors": errors.group(1) if errors else "?",
        "states": states.group(1) if states else "?",
        "why": first.group(1).strip() if first else "",
    }


def verify(args: list[str]) -> None:
    flags = {name: (model, fl, bound) for name, model, fl, bound in MODELS}
    failed = False
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [(n, pool.submit(_check, m, fl)) for n, m, fl, _ in MODELS]
        for name, run in runs:
            res = run.result()
            ok = res["errors"] == "0"
            failed |= not ok
            print(f"verify {name:12} bound: {flags[name][2]}")
            print(
                f"verify {name:12} states explored: {res['states']:>9}  "
                + ("no counterexample" if ok else f"COUNTEREXAMPLE: {res['why']}"),
                flush=True,
            )
        if "--mutants" in args:
            caught = 0
            jobs = [
                (n, m, pool.submit(_check, flags[n][0], [*flags[n][1], f"-DMUTANT_{m}"]))
                for n, m in MUTANTS
            ]
            for name, mutant, run in jobs:
                res = run.result()
                hit = res["errors"] not in ("0", "?")
                caught += hit
                print(f"mutant {name}/{mutant}: " + (res["why"] if hit else "NOT CAUGHT"))
            print(f"mutants caught: {caught}/{len(MUTANTS)}")
            failed |= caught != len(MUTANTS)
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
        # the models first: seconds, and a counterexample says more than a failing example
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
