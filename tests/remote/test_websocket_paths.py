"""Which WebSocket path serves: the direct channel on the uvicorn versions it was verified
against, uvicorn's own protocol on any other (or when forced with ACP_ONCE_WEBSOCKET_PATH=stock),
with a real keyed turn over a real socket through the fallback."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import uvicorn

from acp_once.server.listen import VERIFIED_UVICORN, WEBSOCKET_PATH_ENV, websocket_protocol
from acp_once.server.websocket_protocol import DirectWebSocketProtocol
from acp_once.transports.websocket import DirectWebSocketFrames
from tests.remote.harness import running
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
