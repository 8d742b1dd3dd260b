"""The source distribution holds the project's files and nothing a tool or a run left behind
(a cache directory, bytecode, a database file)."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UV = (
    ROOT
    / ".tools"
    / ("Scripts" if os.name == "nt" else "bin")
    / ("uv.exe" if os.name == "nt" else "uv")
)

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not UV.exists(), reason="uv is installed into .tools/ by dev.py")
def test_the_sdist_holds_the_sources_and_no_caches(tmp_path: Path) -> None:
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    env.pop("VIRTUAL_ENV", None)
    build = [str(UV), "build", "--sdist", "--out-dir", str(tmp_path)]
    subprocess.run(build, cwd=ROOT, env=env, capture_output=True, timeout=120, check=True)
    (sdist,) = tmp_path.glob("acp_once-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = [n.split("/", 1)[1] for n in archive.getnames() if "/" in n]
    for wanted in (
        "src/acp_once/__init__.py",
        "LICENSE",
        "NOTICE",
        "pyproject.toml",
        "tests/conftest.py",
    ):
        assert wanted in names
    stray = [
        n for n in names
        if re.search(r"(^|/)(\.[\w-]*_cache|__pycache__|\.hypothesis|build|site)(/|$)", n)
        or re.search(r"\.(pyc|db|db-wal|db-shm|sqlite3)$", n)
    ]  # fmt: skip
    assert stray == []
