"""A removed token's open WebSocket connections are closed when the tokens file is reloaded
(SIGHUP), with close code 4401, on both WebSocket paths of a real `acp-once serve --tokens`:
the direct channel and uvicorn's own protocol (ASGI events). The other tenants' connections
stay open and keep working."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.server.app import CLOSE_REVOKED
from acp_once.server.listen import WEBSOCKET_PATH_ENV
from acp_once.transports.http import connect_http
from acp_once.transports.websocket import ClientWebSocketFrames, connect_websocket
from tests.remote.harness import running
from tests.remote.test_tenants import ALICE, BOB, TenantServer

pytestmark = pytest.mark.anyio

TIMEOUT = 20
PATHS = {
    "direct": "WebSocket: direct path",
    "stock": "WebSocket: uvicorn's websockets-sansio protocol (ACP_ONCE_WEBSOCKET_PATH=stock)",
}


async def call(
    frames: ClientWebSocketFrames, id_: int, method: str, params: object
) -> dict[str, Any]:
    """Send one request and read frames until its answer (updates are skipped)."""
    request = {"jsonrpc": "2.0", "id": id_, "method": method, "params": params}
    await frames.send(json.dumps(request).encode())
    while True:
        frame = await frames.receive()
        assert isinstance(frame, bytes)
        message: dict[str, Any] = json.loads(frame)
        if message.get("id") == id_:
            return message


INIT = {"protocolVersion": 2, "info": {"name": "t", "version": "1"}}


@pytest.mark.parametrize("path", sorted(PATHS))
async def test_a_removed_tokens_websockets_are_closed_with_4401(tmp_path: Path, path: str) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    env = {**os.environ, WEBSOCKET_PATH_ENV: "stock" if path == "stock" else "auto"}
    with anyio.fail_after(TIMEOUT):
        async with (
            TenantServer(tmp_path, "memory", tokens, env=env).run() as srv,
            connect_websocket(srv.url, token=ALICE) as alice,
            connect_websocket(srv.url, token=ALICE) as alice_too,
            connect_websocket(srv.url, token=BOB) as bob,
        ):
            for frames in (alice, alice_too, bob):
                assert "result" in await call(frames, 0, "initialize", INIT)
                assert "result" in await call(frames, 1, "session/new", {"cwd": "/w"})
            # the server says which WebSocket path it serves with
            assert any(PATHS[path] in line for line in srv.lines), srv.lines
            tokens.write_text(f"bob:{BOB}\n")
            await srv.sighup("tokens reloaded")
            assert any("2 connection(s) of removed tokens closed" in line for line in srv.lines)
            for revoked in (alice, alice_too):
                with pytest.raises(anyio.EndOfStream):
                    while True:  # anything in flight, then the close
                        await revoked.receive()
                assert revoked.close_code == CLOSE_REVOKED
            # bob's connection is untouched and still served
            assert "result" in await call(bob, 2, "session/list", {})
            assert bob.close_code is None
    assert not any(token in line for line in srv.lines for token in (ALICE, BOB))


async def test_a_removed_tokens_http_connections_end(tmp_path: Path) -> None:
    """Streamable HTTP: the removed tenant's connection ends; the other tenant's lives on."""
    tenants = {"alice": ALICE, "bob": BOB}
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path, app_options={"tokens": tenants}) as srv,
            connect_http(f"{srv.http}/acp", token=ALICE) as alice,
            connect_http(f"{srv.http}/acp", token=BOB) as bob,
        ):
            for frames in (alice, bob):
                await frames.send(
                    json.dumps(
                        {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": INIT}
                    ).encode()
                )
                assert b'"result"' in bytes(await frames.receive())  # type: ignore[arg-type]
            served = srv.acp.http_connections
            assert alice.connection_id in served and bob.connection_id in served
            revoked = served[alice.connection_id]
            assert srv.acp.set_tokens({"bob": BOB}) == 1
            await revoked.closed.wait()
            assert not served[bob.connection_id].closed.is_set()
            assert srv.acp.revoked_closed == 1
            # bob's connection is still served
            new = {"jsonrpc": "2.0", "id": 1, "method": "session/new", "params": {"cwd": "/w"}}
            await bob.send(json.dumps(new).encode())
            while b'"id":1' not in (answer := bytes(await bob.receive())).replace(b" ", b""):  # type: ignore[arg-type]
                pass
            assert b'"sessionId"' in answer
