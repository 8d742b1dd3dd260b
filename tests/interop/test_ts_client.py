"""The TypeScript SDK 2.4.0 as a client of `acp-once serve`, over WebSocket and Streamable HTTP.

A real `acp-once serve` subprocess on SQLite listens on a loopback socket bound here (`--fd`);
`ts_client.mjs` drives it with the SDK's `experimental/ws-client` or `experimental/http-client`
transport. The same keyed prompt is sent twice on one connection and a third time on a new
connection after `session/resume`: every answer carries the same `messageId` and the store holds
one user message. What the SDK's transport saw on the wire is checked against digest 7.2/7.3.
The last test shows why the server writes SSE keep-alive comments (the SDK's HTTP client on
Node's fetch loses a connection whose stream stays silent).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import uvicorn

from acp_once.agent.reference import ReferenceAgent
from acp_once.server import DEFAULT_MAX_MESSAGE_BYTES, create_app
from acp_once.server.listen import uvicorn_config
from acp_once.storage import open_store
from tests.interop.node import NodeProject

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TOKEN = "interop-" + uuid.uuid4().hex
PROMPT_TEXT = "hello from the TypeScript SDK"


@dataclass(frozen=True)
class Served:
    port: int
    db: Path
    log: Path

    def url(self, transport: str) -> str:
        return f"{transport}://127.0.0.1:{self.port}/acp"


def _env(token: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ACP_ONCE_TOKEN"}
    if token is not None:
        env["ACP_ONCE_TOKEN"] = token
    return env


@asynccontextmanager
async def acp_once_serve(tmp: Path, *, token: str | None) -> AsyncIterator[Served]:
    """`acp-once serve --store sqlite:...` on a loopback socket listening before it starts (a
    client may connect at once: it waits in the backlog). Leaving the block stops it (SIGTERM,
    then SIGKILL after 15 s); its stderr is in `log`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    served = Served(sock.getsockname()[1], tmp / "served.sqlite3", tmp / "serve.log")
    log_fd = os.open(served.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    command = [
        sys.executable, "-m", "acp_once", "serve",
        "--store", f"sqlite:{served.db}",
        "--side-effects", str(tmp / "effects"),
        "--fd", str(sock.fileno()),
    ]  # fmt: skip
    try:
        process = await anyio.open_process(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_fd,
            pass_fds=(sock.fileno(),),
            env=_env(token),
        )
    finally:
        os.close(log_fd)
    try:
        yield served
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.terminate()
                with anyio.move_on_after(15):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            await process.aclose()
            sock.close()


async def run_ts_client(project: NodeProject, *args: str, token: str | None) -> dict[str, Any]:
    """Run `ts_client.mjs ARGS` to its end and return the JSON object it printed."""
    with anyio.fail_after(90):
        done = await anyio.run_process(
            [project.node, project.script("ts_client.mjs"), *args],
            cwd=project.root,
            env=_env(token),
            check=False,
        )
    stdout = done.stdout.decode()
    assert done.returncode == 0, (stdout[-2000:], done.stderr.decode()[-4000:])
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return result


def server_log(served: Served) -> str:
    return served.log.read_text(encoding="utf-8", errors="replace")


@pytest.mark.parametrize("transport", ["ws", "http"])
async def test_keyed_retries_from_the_sdk_client_get_one_message(
    node_project: NodeProject, tmp_path: Path, transport: str
) -> None:
    key = str(uuid.uuid4())
    async with acp_once_serve(tmp_path, token=TOKEN) as served:
        out = await run_ts_client(
            node_project, "run", transport, served.url(transport), key, token=TOKEN
        )
    first, second = out["first"], out["second"]
    session_id = first["sessionId"]
    message_id = first["first"]["messageId"]

    assert first["agent"]["name"] == "acp-once-reference"
    # a malformed key is refused, not treated as absent (R5, R6), and the SDK sees -32602
    assert first["emptyKey"]["error"]["code"] == -32602
    # the same key: the same message, on the same connection and after a resume elsewhere
    assert first["again"]["messageId"] == message_id
    assert second["retry"]["messageId"] == message_id

    # the updates reached the SDK client: one user message (a retry echoes nothing, D8), the
    # agent's reply, and never the key (R29)
    updates = [u for u in out["updates"] if u["sessionId"] == session_id]
    user_messages = [u["update"] for u in updates if u["update"]["sessionUpdate"] == "user_message"]
    assert [m["messageId"] for m in user_messages] == [message_id]
    replies = [u["update"] for u in updates if u["update"]["sessionUpdate"] == "agent_message"]
    assert [r["content"] for r in replies] == [[{"type": "text", "text": PROMPT_TEXT}]]
    assert key not in json.dumps(out["updates"])

    check_wire(transport, out["wire"], session_id)

    async with open_store(f"sqlite:{served.db}") as store:
        assert await store.count_user_messages(session_id) == 1
        assert await store.count_user_messages(session_id, idempotency_key=key) == 1

    log = server_log(served)
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-4000:]
    assert key not in log and TOKEN not in log


def check_wire(transport: str, wire: list[dict[str, Any]], session_id: str) -> None:
    """What the SDK's transport saw is what digest 7.2/7.3 says a server answers."""
    if transport == "ws":
        # two connections, each upgrade a 101 with its own Acp-Connection-Id
        assert [w["upgrade"] for w in wire] == [101, 101]
        ids = [w["connectionId"] for w in wire]
        assert all(ids) and ids[0] != ids[1]
        return
    initializes = [w for w in wire if w["method"] == "POST" and w["sentConnectionId"] is None]
    assert [w["status"] for w in initializes] == [200, 200]
    assert all(w["contentType"] == "application/json" for w in initializes)
    ids = [w["connectionId"] for w in initializes]
    assert all(ids) and ids[0] != ids[1]
    for w in wire:
        if w["sentConnectionId"] is not None:
            assert w["sentConnectionId"] in ids, w
    posts = [w for w in wire if w["method"] == "POST" and w["sentConnectionId"] is not None]
    # 202 for each; or no status at all when the JSON-RPC answer won the race against the 202
    # and the SDK aborted the POST as it closed the connection (nothing orders the two)
    assert all(w["status"] == 202 or (w["status"] is None and "failed" in w) for w in posts), posts
    assert sum(w["status"] == 202 for w in posts) >= 4, posts
    # the prompts (3 + 1) and session/resume were POSTed with the session's Acp-Session-Id
    assert sum(w["sentSessionId"] == session_id for w in posts) == 5, posts
    streams = [w for w in wire if w["method"] == "GET"]
    assert all(w["status"] == 200 for w in streams), streams
    assert all(w["contentType"] == "text/event-stream" for w in streams)
    # a connection stream and a session stream on each connection
    assert Counter((w["sentConnectionId"], w["sentSessionId"]) for w in streams) == Counter(
        (cid, sid) for cid in ids for sid in (None, session_id)
    )
    deletes = [w for w in wire if w["method"] == "DELETE"]
    assert [(w["sentConnectionId"], w["status"]) for w in deletes] == [(ids[0], 202), (ids[1], 202)]


@pytest.mark.parametrize("transport", ["ws", "http"])
async def test_sdk_client_with_a_wrong_token_is_refused_before_anything_is_processed(
    node_project: NodeProject, tmp_path: Path, transport: str
) -> None:
    async with acp_once_serve(tmp_path, token=TOKEN) as served:
        out = await run_ts_client(
            node_project, "refused", transport, served.url(transport), token="not-" + TOKEN
        )
    assert out["refused"] is True
    assert "401" in out["error"]["message"]  # the SDK says why
    if transport == "ws":
        assert out["wire"] == []  # no upgrade
    else:
        assert [(w["method"], w["status"]) for w in out["wire"]] == [("POST", 401)]
    async with open_store(f"sqlite:{served.db}") as store:
        sessions, _ = await store.list_sessions()
        assert sessions == []
    assert TOKEN not in server_log(served)


@asynccontextmanager
async def in_process_server(tmp: Path, *, sse_keepalive: float | None) -> AsyncIterator[int]:
    """The reference agent on SQLite behind `create_app(sse_keepalive=...)`, served by uvicorn
    in this event loop on a loopback socket listening before it starts; yields the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    async with (
        open_store(f"sqlite:{tmp / 'agent.sqlite3'}") as store,
        ReferenceAgent(store, side_effects=tmp / "effects") as agent,
    ):
        app = create_app(agent, sse_keepalive=sse_keepalive)
        config = uvicorn_config(
            app,
            host="127.0.0.1",
            port=port,
            max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
            log_level="warning",
        )
        server = uvicorn.Server(config)
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            try:
                yield port
            finally:
                await app.state.acp.close_all()  # the SSE streams would hold the shutdown
                server.should_exit = True


BODY_TIMEOUT_MS = 1500
IDLE_MS = 3000


@pytest.mark.parametrize("keepalive", [0.2, None], ids=["keepalive", "silent"])
async def test_sdk_http_client_survives_silence_thanks_to_sse_keepalive(
    node_project: NodeProject, tmp_path: Path, keepalive: float | None
) -> None:
    """Node's fetch gives up on a response body that sends nothing for 300 s, and the SDK's
    HTTP client then closes the whole connection: a client that only prompts in a session
    leaves its connection stream silent that long. Scaled down (a fetch with a 1.5 s body
    timeout, 3 s of silence), an SSE comment every 0.2 s keeps it alive; without them
    (`sse_keepalive=None`, the control) the SDK loses the connection."""
    key = str(uuid.uuid4())
    async with in_process_server(tmp_path, sse_keepalive=keepalive) as port:
        out = await run_ts_client(
            node_project,
            "idle",
            "http",
            f"http://127.0.0.1:{port}/acp",
            key,
            str(BODY_TIMEOUT_MS),
            str(IDLE_MS),
            token=None,
        )
    if keepalive is not None:
        assert "failed" not in out, out
        assert out["answer"]["messageId"].startswith("msg_user_")
    else:
        assert "answer" not in out, out
        assert out["failed"]["cause"] == "UND_ERR_BODY_TIMEOUT", out
