#!/usr/bin/env python3
"""Install Zed's Codex ACP agent, `@zed-industries/codex-acp`, at a pinned version into a cache
under `.tools/`, and print the command that starts it.

    python3 scripts/codex.py          # installs once (npm, ~230 MB, ~10 s), prints the path

The tests of `tests/codex/` and the Codex benchmarks run it; it needs node and npm (npm's
configured registry). The install is shared by every caller: made in a directory of its own,
renamed into place when complete, under a file lock, so that parallel test workers install it
once and never see half of it.
"""

from __future__ import annotations

import fcntl
import platform
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "0.16.0"
PACKAGE = "@zed-industries/codex-acp"
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".tools" / f"codex-acp-{VERSION}"

# the platform package npm installs with it (an optional dependency), by (system, machine)
_NATIVE = {
    ("Linux", "x86_64"): "linux-x64",
    ("Linux", "aarch64"): "linux-arm64",
    ("Darwin", "arm64"): "darwin-arm64",
    ("Darwin", "x86_64"): "darwin-x64",
}


class Missing(Exception):
    """node or npm is not installed."""


def binary(cache: Path = CACHE) -> Path:
    """The agent's executable inside an installed `cache`: the native binary when the platform
    has one (no node process in between), else the package's node launcher."""
    suffix = _NATIVE.get((platform.system(), platform.machine()))
    if suffix is not None:
        native = cache / "node_modules" / f"{PACKAGE}-{suffix}" / "bin" / "codex-acp"
        if native.exists():
            return native
    return cache / "node_modules" / ".bin" / "codex-acp"


def install(cache: Path = CACHE) -> Path:
    """Install codex-acp VERSION into `cache` unless it is there; returns its executable.

    Raises:
        Missing: node or npm is not on PATH.
        subprocess.CalledProcessError: npm failed (its output is in the exception).
    """
    if binary(cache).exists():
        return binary(cache)
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise Missing("node and npm are needed to install codex-acp")
    cache.parent.mkdir(parents=True, exist_ok=True)
    with (cache.parent / f"{cache.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing it
        if binary(cache).exists():
            return binary(cache)
        staging = cache.parent / f"{cache.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        subprocess.run(
            [
                npm,
                "install",
                "--prefix",
                str(staging),
                "--no-audit",
                "--no-fund",
                "--no-save",
                "--prefer-offline",
                f"{PACKAGE}@{VERSION}",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=600,
        )
        staging.rename(cache)
    return binary(cache)


def main() -> int:
    try:
        print(install())
    except Missing as exc:
        print(f"codex.py: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        print(f"codex.py: npm failed:\n{exc.stderr}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
