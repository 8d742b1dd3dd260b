"""The TypeScript SDK 2.4.0's stable (v1) client (`@agentclientprotocol/sdk`'s main entry:
`client()`, `ndJsonStream`) against `acp-once agent` over stdio: the SDK spawns the agent (a
real subprocess), initializes with its `PROTOCOL_VERSION` (1) and runs one turn
(`ts_v1_client.mjs`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from acp_once.protocol import v1
from tests.interop.node import NodeProject


def test_the_ts_sdks_v1_client_runs_a_turn_against_acp_once_agent(
    node_project: NodeProject, tmp_path: Path
) -> None:
    effects = tmp_path / "effects"
    agent = [sys.executable, "-m", "acp_once", "agent", "--store", "memory"]
    done = subprocess.run(
        [
            node_project.node,
            node_project.script("ts_v1_client.mjs"),
            str(tmp_path),
            *agent,
            "--side-effects",
            str(effects),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    init = v1.InitializeResponse.model_validate(report["init"])
    assert init.protocol_version == 1
    assert init.agent_info is not None and init.agent_info.name == "acp-once-reference"
    assert report["stopReason"] == "end_turn"
    updates = report["updates"]
    for update in updates:
        v1.SessionNotification.model_validate({"sessionId": report["sessionId"], "update": update})
    assert [u["sessionUpdate"] for u in updates] == [
        "tool_call",
        "tool_call_update",
        "agent_message_chunk",
    ]
    assert updates[1]["status"] == "completed"
    assert updates[2]["content"] == {"type": "text", "text": "hello [tool]"}
    (log,) = effects.iterdir()  # the turn's tool ran once
    assert len(log.read_text(encoding="utf-8").split()) == 1
