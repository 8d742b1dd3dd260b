"""The load client of benchmarks/bench_load.py (`benchmarks/load/client.mjs`, Node, raw `ws` and
`undici`) against a real `acp-once serve --store memory` subprocess, over WebSocket and
Streamable HTTP: it opens its connections, each with a session, and its keyed prompts are
answered and their turns reach idle, with no error. A smoke test: the benchmark's figures stay
meaningful only while the client speaks the server's transports.

The client's node project is installed with `npm ci` into a temporary directory (offline once
npm's cache has `ws` and `undici`); without node and npm the tests fail under `CI=true` and
are skipped elsewhere, like the other interop tests."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

LOAD_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "load"
PROJECT_FILES = ("package.json", "package-lock.json", ".npmrc", "client.mjs")


@pytest.fixture(scope="module")
def load_client(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The command that runs an installed copy of the load client."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        if os.environ.get("CI") == "true":
            pytest.fail("node and npm are needed for the load client's smoke test")
        pytest.skip("node and npm are not installed")
    root = tmp_path_factory.mktemp("load-client")
    for name in PROJECT_FILES:
        shutil.copy(LOAD_DIR / name, root / name)
    done = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund", "--prefer-offline"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [node, str(root / "client.mjs")]


@pytest.fixture(scope="module")
def server_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """`acp-once serve --store memory` on a socket bound here (clients wait in its backlog)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port: int = sock.getsockname()[1]
    effects = tmp_path_factory.mktemp("effects")
    command = [
        sys.executable, "-m", "acp_once", "serve", "--store", "memory",
        "--side-effects", str(effects), "--fd", str(sock.fileno()),
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(sock.fileno(),),
    )
    sock.close()
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.mark.parametrize("transport", ["ws", "http"])
def test_the_load_client_drives_serve(
    load_client: list[str], server_port: int, transport: str
) -> None:
    command = [
        *load_client, "--transport", transport,
        "--url", f"{transport}://127.0.0.1:{server_port}/acp",
        "--connections", "3", "--warmup", "0.2", "--duration", "3", "--open-timeout", "20",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=50, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    events: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        event = json.loads(line)
        events.update(event if "window" not in event else {f"window {event['window']}": True})
    assert events["opened"]["connections"] == 3, events
    assert events["opened"]["failed"] == 0, events
    assert events["window start"] and events["window end"]
    result = events["result"]
    assert result["transport"] == transport
    assert result["active"] == 3
    assert result["prompts"] > 0, result
    assert result["errors"] == 0 and result["lost"] == 0, result
    assert result["p50Ms"] is not None and result["p99Ms"] >= result["p50Ms"]
