"""acp-once's client against an agent served by the TypeScript SDK 2.4.0, over WebSocket and
Streamable HTTP.

`ts_server.mjs` serves a v2 agent with the SDK's `experimental/server` `AcpServer` and its
`experimental/node` adapters (WebSocket upgrades through `createNodeWebSocketUpgradeHandler`).
`AcpClient` with `WebSocketLauncher` or `HttpLauncher` initializes, creates a session,
prompts, answers the agent's permission request (a session-scoped agent-to-client request) and
receives the turn's updates; a second client resumes the session on a new connection and
prompts again. The SDK's typed prompt handler drops `idempotencyKey`, so nothing here is about
duplicates: this is the round trip, and that our client needs no reconnect to make it.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.text import TextReceiveStream

from acp_once.client import AcpClient, ClientSession, HttpLauncher, WebSocketLauncher
from acp_once.protocol import schema as s
from tests.interop.node import NodeProject

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TOKEN = "interop-" + uuid.uuid4().hex
IDLE = {"state": "idle", "stopReason": "end_turn"}


@dataclass
class TsServer:
    port: int
    log: Path
    lines: list[dict[str, Any]] = field(default_factory=list)
    """What it printed after `{"port": N}`: one object per HTTP exchange or upgrade."""

    def url(self, transport: str) -> str:
        return f"{transport}://127.0.0.1:{self.port}/acp"


async def _read_lines(
    stream: anyio.abc.ByteReceiveStream,
    log: Path,
    lines: list[dict[str, Any]],
    *,
    task_status: anyio.abc.TaskStatus[TsServer],
) -> None:
    buffered = ""
    started = False
    async for chunk in TextReceiveStream(stream):
        buffered += chunk
        *complete, buffered = buffered.split("\n")
        for line in complete:
            message = json.loads(line)
            if not started:
                started = True
                task_status.started(TsServer(int(message["port"]), log, lines))
            else:
                lines.append(message)
    if not started:
        raise RuntimeError("ts_server.mjs exited before listening")


@asynccontextmanager
async def ts_server(project: NodeProject, tmp: Path, *, token: str) -> AsyncIterator[TsServer]:
    """`node ts_server.mjs` until the block ends (SIGTERM, then SIGKILL after 10 s); its
    stderr goes to `tmp/ts_server.log`."""
    log = tmp / "ts_server.log"
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        process = await anyio.open_process(
            [project.node, project.script("ts_server.mjs")],
            cwd=project.root,
            stdin=subprocess.DEVNULL,
            stderr=log_fd,
            env={**os.environ, "ACP_ONCE_TOKEN": token},
        )
    finally:
        os.close(log_fd)
    try:
        async with anyio.create_task_group() as tg:
            assert process.stdout is not None
            with anyio.fail_after(30):
                server: TsServer = await tg.start(_read_lines, process.stdout, log, [])
            try:
                yield server
            finally:
                process.terminate()
                with anyio.move_on_after(10):
                    await process.wait()  # the reader then sees the end of stdout
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
            await process.aclose()


def launcher(server: TsServer, transport: str) -> WebSocketLauncher | HttpLauncher:
    if transport == "ws":
        return WebSocketLauncher(server.url("ws"), token=TOKEN)
    return HttpLauncher(server.url("http"), token=TOKEN)


async def prompt_and_watch(session: ClientSession, text: str) -> tuple[str, list[dict[str, Any]]]:
    """Prompt, then collect the session's updates until the turn is idle."""
    seen: list[dict[str, Any]] = []
    async with session.updates() as updates:
        message_id = await session.prompt(text)
        async for update in updates:
            seen.append(update.update.model_dump(mode="json", by_alias=True, exclude_none=True))
            if seen[-1].get("state") == "idle":
                break
    return message_id, seen


@pytest.mark.parametrize("transport", ["ws", "http"])
async def test_our_client_round_trips_with_the_sdk_server(
    node_project: NodeProject, tmp_path: Path, transport: str
) -> None:
    asked: list[s.RequestPermissionRequest] = []

    async def allow(request: s.RequestPermissionRequest) -> s.RequestPermissionResponse:
        asked.append(request)
        return s.RequestPermissionResponse.model_validate(
            {"outcome": {"outcome": "selected", "optionId": "yes"}}
        )

    async with ts_server(node_project, tmp_path, token=TOKEN) as server:
        with anyio.fail_after(30):
            first = launcher(server, transport)
            async with AcpClient(first, on_permission=allow) as client:
                assert client.agent_info is not None
                assert client.agent_info.info.name == "ts-remote-agent"
                assert first.current is not None and first.current.connection_id  # the SDK's
                session = await client.new_session("/tmp")
                message_id, updates = await prompt_and_watch(session, "hello from acp-once")
                assert client.reconnects == 0 and first.connects == 1

            # a new connection: resume the session there, prompt again
            second = launcher(server, transport)
            async with AcpClient(second, on_permission=allow) as again:
                resumed = await again.resume_session(session.session_id, "/tmp")
                message_id_2, updates_2 = await prompt_and_watch(resumed, "and once more")
                assert again.reconnects == 0 and second.connects == 1

    assert message_id.startswith("msg_user_") and message_id_2.startswith("msg_user_")
    assert message_id != message_id_2
    assert [u["sessionUpdate"] for u in updates] == [
        "user_message",
        "state_update",
        "agent_message",
        "state_update",
    ]
    assert updates[0]["messageId"] == message_id
    assert text_of(updates[2]) == "hello from acp-once [permission: yes]"
    assert updates[3] == {"sessionUpdate": "state_update", **IDLE}
    assert updates_2[0]["messageId"] == message_id_2
    assert text_of(updates_2[2]) == "and once more [permission: yes]"
    assert [r.session_id for r in asked] == [session.session_id] * 2

    check_served(transport, server, session.session_id)
    log = server.log.read_text(encoding="utf-8", errors="replace")
    assert "turn failed" not in log, log[-4000:]


def text_of(update: dict[str, Any]) -> str:
    assert update["sessionUpdate"] == "agent_message"
    [block] = update["content"]
    assert block["type"] == "text"
    return str(block["text"])


def check_served(transport: str, server: TsServer, session_id: str) -> None:
    """What the SDK's server saw of our client (it logs each exchange when it is finished)."""
    if transport == "ws":
        upgrades = [line["upgrade"] for line in server.lines if "upgrade" in line]
        assert upgrades == [{"url": "/acp", "authorized": True}] * 2
        return
    exchanges = [line["http"] for line in server.lines if "http" in line]
    # the SDK's server refuses a message it cannot route with 400 (for example a permission
    # answer POSTed without the Acp-Session-Id its request came with): none of that here
    assert all(e["status"] in (200, 202) for e in exchanges), exchanges
    posts = [e for e in exchanges if e["method"] == "POST"]
    initializes = [e for e in posts if e["connectionId"] is None]
    assert [e["status"] for e in initializes] == [200, 200]
    # per connection: the prompt and the permission answer (and on the second, the resume)
    # carry the session's Acp-Session-Id
    assert sum(e["sessionId"] == session_id for e in posts) == 5
    deletes = [e for e in exchanges if e["method"] == "DELETE"]
    assert [e["status"] for e in deletes] == [202, 202]
    assert len({e["connectionId"] for e in deletes}) == 2
