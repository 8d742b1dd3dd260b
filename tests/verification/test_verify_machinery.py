"""`python3 dev.py verify` fails when SPIN's search was cut short: a search that hits the depth
(or memory) bound explored only part of the model, so "errors: 0" proves nothing; and such a
search never counts as catching a mutant."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    shutil.which("spin") is None or shutil.which("gcc") is None,
    reason="SPIN and gcc are needed (Debian's spin and gcc packages)",
)


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("acp_once_dev", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_search_cut_short_by_the_depth_bound_fails() -> None:
    run = subprocess.run(
        [sys.executable, "dev.py", "verify", "--model", "cluster", "--depth", "50"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "SEARCH NOT COMPLETED" in run.stdout
    assert "no counterexample" not in run.stdout


def test_a_truncated_search_is_neither_a_pass_nor_a_caught_mutant() -> None:
    dev = _dev()
    res: dict[str, str] = dev._check("cluster.pml", ["-DFAULTS=2"], "safety", 50)
    assert res["errors"] == "0"
    assert res["complete"] == "no"
    assert not dev._passed(res)
    assert not dev._caught(res)
    assert res["depth"] == "49"
    assert "-m50" in res["pan"]
