"""Code mutants: one guard of the code removed at a time, each of which a named test must catch.

Each mutant in `verification/mutants/*.toml` names a file under `src/`, a piece of its text
(`find`, which must occur exactly once) and what replaces it (`replace`), and the test(s) that
must fail with it. `run` copies `src/` into a temporary directory, applies one mutant there,
and runs its tests with that copy first on `PYTHONPATH` (agent subprocesses the tests start
inherit it), so the working tree is never touched and mutants run side by side. A mutant is
caught when pytest reports failed tests (exit status 1); any other status (no test collected,
a usage error, a mutant whose text is gone from the code) is reported as not caught.

Standard library only: `dev.py` imports it before the environment is checked.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# a mutant's tests run one at a time; a hang is not a catch
_RUN_TIMEOUT = 300


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    why: str
    model: str | None  # the model mutant whose guard this is, if any


def load(folder: Path) -> list[Mutant]:
    """Every mutant of the TOML files in `folder`, in file order.

    Raises:
        ValueError: a mutant lacks a field, or two share a name.
    """
    mutants: list[Mutant] = []
    for path in sorted(folder.glob("*.toml")):
        with path.open("rb") as f:
            data = tomllib.load(f)
        for entry in data.get("mutant", []):
            try:
                tests = entry["test"]
                mutants.append(
                    Mutant(
                        name=entry["name"],
                        file=entry["file"],
                        find=entry["find"],
                        replace=entry["replace"],
                        tests=tuple([tests] if isinstance(tests, str) else tests),
                        why=entry["why"],
                        model=entry.get("model"),
                    )
                )
            except KeyError as exc:
                raise ValueError(f"{path.name}: a mutant without {exc}") from None
    names = [m.name for m in mutants]
    if len(set(names)) != len(names):
        raise ValueError(f"{folder}: two code mutants share a name")
    return mutants


def _ignore_caches(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n in (".mypy_cache", ".pytest_cache")]


CAUGHT, MISSED, NOT_RUN = "caught", "missed", "not run"


def run_one(root: Path, python: list[str], mutant: Mutant) -> tuple[str, str]:
    """Apply `mutant` to a copy of `root/src` and run its tests: (`CAUGHT`, `MISSED` or
    `NOT_RUN`, what happened). `NOT_RUN`: its tests were skipped or could not run for want
    of PostgreSQL (`ACP_ONCE_TEST_POSTGRES_DSN`, or `ACP_ONCE_TEST_POSTGRES_DSN2`, the second
    server of the sharded store's tests), which says nothing about the mutant."""
    target = root / mutant.file
    text = target.read_text(encoding="utf-8")
    count = text.count(mutant.find)
    if count != 1:
        return MISSED, f"its text occurs {count} times in {mutant.file}: update the mutant"
    with tempfile.TemporaryDirectory(prefix="acp-once-mutant-") as tmp:
        src = Path(tmp) / "src"
        # copy2 keeps modification times, so the bytecode of every unchanged module stays
        # valid and only the mutated one is compiled again
        shutil.copytree(root / "src", src, ignore=_ignore_caches)
        mutated = src / Path(mutant.file).relative_to("src")
        mutated.write_text(text.replace(mutant.find, mutant.replace), encoding="utf-8")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
        env["ACP_ONCE_MUTANT_SRC"] = str(src)  # tests/conftest.py checks the copy is imported
        command = [*python, "-m", "pytest", "-q", "-n", "0", "-x", "-p", "no:cacheprovider"]
        try:
            proc = subprocess.run(
                [*command, *mutant.tests],
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                timeout=_RUN_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            return MISSED, f"its tests ran over {_RUN_TIMEOUT} s"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    last = lines[-1].strip("= ") if lines else proc.stderr.strip()[-200:]
    if re.search(r"ACP_ONCE_TEST_POSTGRES_DSN2? is not set", proc.stdout) or (
        proc.returncode == 0 and "skipped" in last and "passed" not in last
    ):
        return NOT_RUN, f"its tests need PostgreSQL: {last}"
    if proc.returncode == 1:
        failed = [line for line in lines if line.startswith("FAILED ")]
        return CAUGHT, (failed[0].removeprefix("FAILED ") if failed else last)
    return MISSED, f"pytest exited {proc.returncode}: {last}"


def run(
    root: Path, python: list[str], mutants: list[Mutant], *, workers: int = 2
) -> list[tuple[Mutant, str, str]]:
    """Run every mutant (`workers` at a time); each with its `run_one` verdict and why."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        jobs = [(m, pool.submit(run_one, root, python, m)) for m in mutants]
        return [(m, *job.result()) for m, job in jobs]
