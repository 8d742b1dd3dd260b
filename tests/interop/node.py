"""The node project of the interop tests (`package.json`, `package-lock.json`, the scripts):
the TypeScript SDK 2.4.0, `ws` and `undici`, pinned, installed with `npm ci` into a directory
of its own."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROJECT_FILES = (
    "package.json",
    "package-lock.json",
    ".npmrc",
    "ts_client.mjs",
    "ts_server.mjs",
    "ts_v1_client.mjs",
    "ts_v1_agent.mjs",
)


@dataclass(frozen=True)
class NodeProject:
    """An installed copy of the project: `node` runs its scripts, `root` is its directory."""

    node: str
    root: Path

    def script(self, name: str) -> str:
        return str(self.root / name)


def install(root: Path) -> NodeProject:
    """Copy the project into `root` and run `npm ci` there (offline once npm's cache has it).

    Without node or npm the calling test fails under CI (`CI=true`) and is skipped elsewhere;
    a failed install fails it."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        if os.environ.get("CI") == "true":
            pytest.fail("node and npm are needed for the TypeScript SDK interop tests")
        pytest.skip("node and npm are not installed")
    for name in PROJECT_FILES:
        shutil.copy(HERE / name, root / name)
    done = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund", "--prefer-offline"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return NodeProject(node, root)
