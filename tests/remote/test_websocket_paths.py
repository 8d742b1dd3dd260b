"""Which WebSocket path serves: the direct channel on the uvicorn versions it was verified
against, uvicorn's own protocol on any other (or when forced with ACP_ONCE_WEBSOCKET_PATH=stock),
with a real keyed turn over a real socket through the fallback."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Mount

from acp_once.agent.reference import ReferenceAgent
from acp_once.server import create_app
from acp_once.server.listen import VERIFIED_UVICORN, WEBSOCKET_PATH_ENV, websocket_protocol
from acp_once.server.websocket_protocol import DirectWebSocketProtocol
from acp_once.storage import open_store
from acp_once.transports.websocket import DirectWebSocketFrames
from tests.remote.harness import listening_socket, running
from tests.remote.test_websocket import new_session, prompt_params, session_conn

pytestmark = pytest.mark.anyio

TIMEOUT = 20


def test_the_direct_path_only_where_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WEBSOCKET_PATH_ENV, raising=False)
    assert ".".join(uvicorn.__version__.split(".")[:2]) in VERIFIED_UVICORN  # this environment
    protocol, said = websocket_protocol()
    assert protocol is DirectWebSocketProtocol and "direct path" in said
    monkeypatch.setattr(uvicorn, "__version__", "0.99.1")
    protocol, said = websocket_protocol()
    assert protocol == "websockets-sansio"
    assert said == (
        "WebSocket: uvicorn's websockets-sansio protocol "
        "(the direct path is not verified on uvicorn 0.99.1)"
    )
    monkeypatch.undo()
    monkeypatch.setenv(WEBSOCKET_PATH_ENV, "stock")
    assert websocket_protocol()[0] == "websockets-sansio"


@pytest.mark.parametrize("unverified", [False, True], ids=["verified", "unverified"])
async def test_a_keyed_turn_through_either_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unverified: bool
) -> None:
    monkeypatch.delenv(WEBSOCKET_PATH_ENV, raising=False)
    if unverified:
        monkeypatch.setattr(uvicorn, "__version__", "0.99.1")
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv, session_conn(srv.url) as (_, conn):
            sid = await new_session(conn)
            served = list(srv.acp.connections.values())
            assert len(served) == 1
            assert isinstance(served[0], DirectWebSocketFrames) is not unverified
            first = await conn.rpc.request("session/prompt", prompt_params(sid, "hello", "k-1"))
            again = await conn.rpc.request("session/prompt", prompt_params(sid, "hello", "k-1"))
            assert first["messageId"] == again["messageId"]  # one insertion, answered twice


async def test_the_app_mounted_under_plain_uvicorn(tmp_path: Path) -> None:
    """Mounted in a parent Starlette app and served by uvicorn as configured by nobody but
    uvicorn (this environment's uvicorn, the newest the package index offers when this was
    written): a keyed turn over WebSocket, through plain ASGI events."""
    async with (
        open_store("memory:") as store,
        ReferenceAgent(store, side_effects=tmp_path) as agent,
    ):
        inner = create_app(agent)
        parent = Starlette(routes=[Mount("/agent", app=inner)], lifespan=inner.state.acp.lifespan)
        sock = listening_socket()
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(parent, log_level="warning"))
        with anyio.fail_after(TIMEOUT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: server.serve(sockets=[sock]))
                async with session_conn(f"ws://127.0.0.1:{port}/agent/acp") as (_, conn):
                    sid = await new_session(conn)
                    served = list(inner.state.acp.connections.values())
                    assert len(served) == 1 and not isinstance(served[0], DirectWebSocketFrames)
                    first = await conn.rpc.request("session/prompt", prompt_params(sid, "hi", "k"))
                    again = await conn.rpc.request("session/prompt", prompt_params(sid, "hi", "k"))
                    assert first["messageId"] == again["messageId"]
                server.should_exit = True
