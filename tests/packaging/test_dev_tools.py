"""`python3 dev.py test` needs SPIN and gcc for its model check: without them (and without a
way to install them) it stops at once, before anything else runs, with the install line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _dev_test(path: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "dev.py"), "test"],
        env={"PATH": str(path), "HOME": str(tmp_path)}, cwd=tmp_path, capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip


def test_missing_spin_and_gcc_stop_the_run_at_once_with_the_install_line(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()  # no spin, no gcc, no apt-get: nothing can be installed
    done = _dev_test(empty, tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "dev.py test: the model check needs spin and gcc, not found on PATH; install them and "
        "run again: sudo apt-get install -y spin gcc  (Debian, Ubuntu; elsewhere SPIN from "
        "https://spinroot.com and any gcc)"
    ]
    assert done.stdout == ""


def test_one_missing_tool_is_named_alone(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    spin = bin_dir / "spin"
    spin.write_text("#!/bin/sh\nexit 0\n")
    spin.chmod(0o755)
    done = _dev_test(bin_dir, tmp_path)
    assert done.returncode == 2
    assert "needs gcc, not found on PATH; install it" in done.stderr
    assert "sudo apt-get install -y gcc " in done.stderr
