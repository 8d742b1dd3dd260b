"""Our secrets stay with us: a bridged agent, an upgraded v1 agent and an agent a client
launches over stdio (real child processes that write out the environment they were started
with) never see `ACP_ONCE_TOKEN`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.bridge import Bridge
from acp_once.client import StdioLauncher
from acp_once.upgrade.child import V1Children

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).parents[2]
SECRET = "secret-token-5d1e8b"


def dumping(agent: list[str], out: Path) -> list[str]:
    """A command that writes its environment to `out` as JSON, then becomes `agent`."""
    code = (
        "import json, os, sys; "
        "open(sys.argv[1], 'w').write(json.dumps(dict(os.environ))); "
        "os.execv(sys.argv[2], sys.argv[2:])"
    )
    return [sys.executable, "-c", code, str(out), *agent]


def environment(out: Path) -> dict[str, str]:
    value: dict[str, str] = json.loads(out.read_text())
    return value


async def test_a_bridged_agent_does_not_inherit_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_ONCE_TOKEN", SECRET)
    monkeypatch.setenv("ACP_ONCE_UNRELATED", "kept")
    out = tmp_path / "env.json"
    tiny = [sys.executable, str(ROOT / "tests" / "agents" / "tiny_agent.py")]
    with anyio.fail_after(20):
        async with Bridge(dumping(tiny, out), ready_timeout=15):
            seen = environment(out)
    assert "ACP_ONCE_TOKEN" not in seen
    assert SECRET not in json.dumps(seen)
    assert seen["ACP_ONCE_UNRELATED"] == "kept"  # the rest of ours is inherited


async def test_an_explicit_environment_is_passed_as_given(tmp_path: Path) -> None:
    out = tmp_path / "env.json"
    tiny = [sys.executable, str(ROOT / "tests" / "agents" / "tiny_agent.py")]
    given = {**os.environ, "ACP_ONCE_TOKEN": "chosen-by-the-caller"}
    with anyio.fail_after(20):
        async with Bridge(dumping(tiny, out), env=given, ready_timeout=15):
            seen = environment(out)
    assert seen["ACP_ONCE_TOKEN"] == "chosen-by-the-caller"


async def test_an_upgraded_v1_agent_does_not_inherit_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_ONCE_TOKEN", SECRET)
    out = tmp_path / "env.json"
    v1 = [sys.executable, str(ROOT / "tests" / "agents" / "sdk_v1_agent.py")]

    async def on_request(child: Any, method: str, params: Any, ctx: Any) -> Any:
        raise AssertionError(method)

    async def on_notification(child: Any, method: str, params: Any) -> None:
        return None

    with anyio.fail_after(20):
        async with V1Children(
            dumping(v1, out),
            on_request=on_request,
            on_notification=on_notification,
            ready_timeout=15,
        ) as children:
            child = await children.current()
            assert child.alive
            seen = environment(out)
    assert "ACP_ONCE_TOKEN" not in seen
    assert SECRET not in json.dumps(seen)


async def test_an_agent_a_client_launches_does_not_inherit_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACP_ONCE_TOKEN", SECRET)
    out = tmp_path / "env.json"
    tiny = [sys.executable, str(ROOT / "tests" / "agents" / "tiny_agent.py")]
    initialize = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {"protocolVersion": 2, "info": {"name": "t", "version": "1"}},
    }
    with anyio.fail_after(20):
        async with StdioLauncher(dumping(tiny, out)).connect() as frames:
            await frames.send(json.dumps(initialize).encode())
            assert b'"result"' in bytes(await frames.receive())  # type: ignore[arg-type]
            seen = environment(out)
    assert "ACP_ONCE_TOKEN" not in seen
    assert SECRET not in json.dumps(seen)
