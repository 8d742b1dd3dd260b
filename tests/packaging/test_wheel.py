"""The wheel, as a user installs it: built from this tree, installed without extras into a
fresh environment, it runs `acp-once --version`, `acp-once agent` and the public API, carries
its license files, and pulls in none of the extras' packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UV = (
    ROOT
    / ".tools"
    / ("Scripts" if os.name == "nt" else "bin")
    / ("uv.exe" if os.name == "nt" else "uv")
)
EXTRAS_PACKAGES = [
    "starlette",
    "uvicorn",
    "websockets",
    "httpx",
    "psycopg",
    "psycopg_pool",
    "uvloop",
]

pytestmark = pytest.mark.slow


def _uv(*args: str, cwd: Path) -> None:
    """Run uv from its own cache (offline) first, then online when the cache lacks something."""
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    env.pop("VIRTUAL_ENV", None)
    offline = subprocess.run(
        [str(UV), *args, "--offline"],
        cwd=cwd,
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    if offline.returncode != 0:
        subprocess.run(
            [str(UV), *args], cwd=cwd, env=env, capture_output=True, timeout=120, check=True
        )


def _run(*args: str | Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.skipif(not UV.exists(), reason="uv is installed into .tools/ by dev.py")
def test_the_wheel_installs_and_runs_without_extras(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _uv("build", "--wheel", "--out-dir", str(dist), cwd=ROOT)
    (wheel,) = dist.glob("acp_once-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        headers = archive.read(metadata).decode()
    info = metadata.removesuffix("METADATA")
    assert {f"{info}licenses/LICENSE", f"{info}licenses/NOTICE"} <= names
    assert "License-Expression: Apache-2.0" in headers
    assert "Requires-Dist: psycopg" not in headers.split("Provides-Extra:")[0]

    env_dir = tmp_path / "env"
    _uv("venv", str(env_dir), "--python", sys.executable, cwd=tmp_path)
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    _uv("pip", "install", "--python", str(python), str(wheel), cwd=tmp_path)

    version = _run(bindir / "acp-once", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("acp-once 0."), version.stdout

    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": 2, "info": {"name": "wheel-test", "version": "1"}},
    }
    agent = _run(
        bindir / "acp-once", "agent", "--store", f"sqlite:{tmp_path / 's.db'}",
        "--side-effects", tmp_path / "effects", stdin=json.dumps(initialize) + "\n",
    )  # fmt: skip
    assert agent.returncode == 0, agent.stderr
    assert json.loads(agent.stdout.splitlines()[0])["result"]["protocolVersion"] == 2

    code = (
        "import importlib.util, json, sys\n"
        "import acp_once, acp_once.agent, acp_once.client, acp_once.storage, acp_once.protocol\n"
        "from acp_once.agent import SessionAgent, serve_stdio\n"
        "from acp_once.client import AcpClient, StdioLauncher, WebSocketLauncher\n"
        "print(json.dumps({'version': acp_once.__version__, 'installed': [n for n in "
        f"{EXTRAS_PACKAGES!r} if importlib.util.find_spec(n) is not None]}}))\n"
    )
    api = _run(python, "-c", code)
    assert api.returncode == 0, api.stderr
    found = json.loads(api.stdout)
    assert version.stdout.strip() == f"acp-once {found['version']}"
    assert found["installed"] == []

    serve = _run(bindir / "acp-once", "serve", "--store", "memory:")
    assert serve.returncode == 2
    assert "install acp-once[server]" in serve.stderr
