#!/usr/bin/env python3
"""Set up the project's environment and run its jobs, with nothing but Python 3.11+ present.

    python3 dev.py demo          # the main job: `acp-once demo`
    python3 dev.py test          # lint, format check, types, import layering, tests
                                 # (extra arguments go to pytest, e.g. -k NAME -n 0)
    python3 dev.py run CMD ...   # any command inside the environment (e.g. `acp-once agent`)

The first call installs uv into `.tools/` (a private virtual environment) and creates `.venv`
from the committed `uv.lock`; later calls only check that both are current.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
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


def main(argv: list[str]) -> None:
    job = argv[0] if argv else "help"
    if job == "test":
        uv = sync()
        for step in (
            ["ruff", "check", "."],
            ["ruff", "format", "--check", "."],
            ["mypy"],
            ["lint-imports"],
            # one worker per CPU (at most 4): most tests wait on subprocesses and sockets;
            # `python3 dev.py test -n 0` runs them in this process, one at a time
            ["pytest", "-n", "auto", "--maxprocesses", "4", *argv[1:]],
        ):
            print(f"dev.py: {' '.join(step)}", file=sys.stderr, flush=True)
            _run(str(uv), "run", "--frozen", "--no-sync", *step)
    elif job == "demo":
        uv = sync()
        _run(str(uv), "run", "--frozen", "--no-sync", "acp-once", "demo", *argv[1:])
    elif job == "run":
        uv = sync()
        _run(str(uv), "run", "--frozen", "--no-sync", *argv[1:])
    elif job == "lock":
        _run(str(_uv()), "lock")
    else:
        print(__doc__)
        raise SystemExit(0 if job == "help" else 2)


if __name__ == "__main__":
    main(sys.argv[1:])
