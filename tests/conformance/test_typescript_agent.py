"""A real third-party v2 agent: the TypeScript SDK 2.4.0, with its typed prompt handler.

The SDK's typed `session/prompt` handler drops the unknown `idempotencyKey` field, so such an
agent inserts every retry again. The suite must report it as not honouring keys. The agent
(`benchmarks/ts_agent/agent.mjs`) is installed from its pinned lock file into a temporary
directory with `npm ci`; without node and npm the test fails under CI and is skipped elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from acp_once.client import StdioLauncher
from acp_once.conformance import Status, run_suite

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TS_AGENT = Path(__file__).resolve().parents[2] / "benchmarks" / "ts_agent"


@pytest.fixture(scope="module")
def ts_agent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        if os.environ.get("CI") == "true":
            pytest.fail("node and npm are needed for the TypeScript SDK interop test")
        pytest.skip("node and npm are not installed")
    workdir = tmp_path_factory.mktemp("ts-agent")
    for name in ("package.json", "package-lock.json", ".npmrc", "agent.mjs"):
        shutil.copy(TS_AGENT / name, workdir / name)
    done = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return workdir / "agent.mjs"


async def test_typescript_sdk_agent_is_reported_as_not_honouring_keys(ts_agent: Path) -> None:
    node = shutil.which("node")
    assert node is not None
    report = await run_suite(
        StdioLauncher([node, str(ts_agent)]),
        select=[
            "session.new",
            "key.invalid.empty",
            "key.invalid.number",
            "trace.T1-same-connection",
        ],
        timeout=20,
    )
    assert report.by_id("session.new").status is Status.PASSED  # it is a working v2 agent
    failed = report.failed_ids()
    assert {"trace.T1-same-connection", "key.invalid.empty", "key.invalid.number"} <= failed
    assert report.exit_code != 0
