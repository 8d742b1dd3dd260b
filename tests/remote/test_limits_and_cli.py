"""Limits of the WebSocket server, and `acp-once serve`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest
import uvicorn

from acp_once.client import AcpClient, WebSocketLauncher
from acp_once.protocol.errors import INVALID_REQUEST, AcpError
from acp_once.rpc.errors import ConnectionClosed
from acp_once.server import InsecureListen, check_listen, is_loopback
from acp_once.server.run import reference_factory, serve_agent
from acp_once.storage import open_store
from acp_once.support.backoff import Backoff
from acp_once.transports.websocket import CLOSE_TOO_BIG, WebSocketRejected, connect_websocket
from tests.remote.harness import listening_socket, running
from tests.remote.test_websocket import new_session, prompt, session_conn

pytestmark = pytest.mark.anyio

TIMEOUT = 30
FAST = Backoff(base=0.05, factor=2.0, cap=0.3)


async def test_oversized_message_is_refused_and_the_connection_lives_on(tmp_path: Path) -> None:
    limit = 4096
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path, max_message_bytes=limit) as srv,
            session_conn(srv.url) as (frames, conn),
        ):
            sid = await new_session(conn)
            with pytest.raises(AcpError) as info:
                await prompt(conn, sid, "x" * (limit + 1))
            assert info.value.code == INVALID_REQUEST
            assert await srv.agent.store.count_user_messages(sid) == 0
            small = await prompt(conn, sid, "small", key="k2")
            assert small.startswith("msg_user_")
            # far above the limit (beyond the server's frame limit): closed with 1009
            with pytest.raises(ConnectionClosed):
                await prompt(conn, sid, "y" * (limit + 2 * 1024 * 1024), key="k3")
            assert frames.close_code == CLOSE_TOO_BIG
            assert await srv.agent.store.count_user_messages(sid) == 1


async def test_connection_limit(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, max_connections=1) as srv, session_conn(srv.url):
            with pytest.raises(WebSocketRejected) as info:
                async with connect_websocket(srv.url):
                    pass
            assert info.value.status == 503
            assert srv.acp.rejected == 1 and srv.acp.accepted == 1


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.10", False),
        ("example.com", False),
        ("", False),
    ],
)
def test_only_loopback_without_a_token(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    check_listen(host, "a-token")  # with a token anything goes
    if loopback:
        check_listen(host, None)
    else:
        with pytest.raises(InsecureListen, match="without a token"):
            check_listen(host, None)


def test_cli_refuses_a_public_host_without_a_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ACP_ONCE_TOKEN"}
    refused = subprocess.run(
        [sys.executable, "-m", "acp_once", "serve", "--host", "0.0.0.0", "--port", "1",
         "--store", f"sqlite:{tmp_path / 'never.sqlite3'}"],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "without a token" in refused.stderr
    assert not (tmp_path / "never.sqlite3").exists()  # refused before anything opened
    helped = subprocess.run(
        [sys.executable, "-m", "acp_once", "serve", "--help"],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert helped.returncode == 0
    for option in ("--host", "--port", "--store", "--token", "ACP_ONCE_TOKEN", "--policy"):
        assert option in helped.stdout
    assert "--sqlite-busy-poll-ms" in helped.stdout


@pytest.mark.parametrize("ms", ["-1", "nan", "inf", "1001"])
def test_cli_refuses_a_busy_poll_time_out_of_range(tmp_path: Path, ms: str) -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "acp_once", "serve", "--port", "1", "--sqlite-busy-poll-ms", ms,
         "--store", f"sqlite:{tmp_path / 'never.sqlite3'}"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "--sqlite-busy-poll-ms" in refused.stderr
    assert "from 0 to 1000" in refused.stderr
    assert not (tmp_path / "never.sqlite3").exists()


async def test_serve_reference_composition_with_a_token(tmp_path: Path) -> None:
    """What `acp-once serve` runs: the reference agent on SQLite behind the app, with a token."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    db = tmp_path / "served.sqlite3"
    servers: list[uvicorn.Server] = []
    token = "cli-token"
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: serve_agent(
                    reference_factory(side_effects=tmp_path / "effects"),
                    host="127.0.0.1",
                    port=port,
                    store=f"sqlite:{db}",
                    token=token,
                    max_connections=10,
                    max_message_bytes=1024 * 1024,
                    sock=sock,
                    on_server=servers.append,
                )
            )
            url = f"ws://127.0.0.1:{port}/acp"
            with pytest.raises(WebSocketRejected):
                async with connect_websocket(url):
                    pass
            async with AcpClient(WebSocketLauncher(url, token), backoff=FAST) as client:
                session = await client.new_session("/w")
                await session.prompt("over the served agent")
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
            servers[0].should_exit = True
    async with open_store(f"sqlite:{db}") as store:
        assert await store.count_user_messages(session.session_id) == 1
