"""The network face under hostile peers (issue 20): browser pages (`Origin`, DNS rebinding via
`Host`), large bodies, floods of initialize POSTs, half-open sockets, client-chosen ids."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest

from acp_once.server.guard import HalfOpenGuard
from acp_once.transports.http import CONNECTION_ID_HEADER, SESSION_ID_HEADER, connect_http
from tests.remote.harness import Running, ServeProcess, running
from tests.remote.test_websocket import new_session, session_conn

pytestmark = pytest.mark.anyio

TIMEOUT = 20
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {"protocolVersion": 2, "info": {"name": "t", "version": "1"}},
}


async def _read_head(stream: anyio.abc.SocketStream) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        head += await stream.receive()
    return head


async def _status(port: int, request: bytes) -> int:
    """Send `request` on a new socket; the status code of the answer's head."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(request)
        head = await _read_head(stream)
    return int(head.split(b" ", 2)[1])


def _upgrade(port: int, host: str | None = None, origin: str | None = None) -> bytes:
    lines = [
        "GET /acp HTTP/1.1",
        f"Host: {host or f'127.0.0.1:{port}'}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
    ]
    if origin is not None:
        lines.append(f"Origin: {origin}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _post(port: int, body: bytes, host: str | None = None, origin: str | None = None) -> bytes:
    lines = [
        "POST /acp HTTP/1.1",
        f"Host: {host or f'127.0.0.1:{port}'}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if origin is not None:
        lines.append(f"Origin: {origin}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def test_origin_and_host_are_checked_on_upgrades_and_posts(tmp_path: Path) -> None:
    options = {"allowed_origins": ["https://editor.example"], "allowed_hosts": ["acp.internal"]}
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, app_options=options) as srv:
            port = srv.port
            # the DNS-rebinding page of finding 1 (it got 101): refused before any ACP message
            evil = await _status(port, _upgrade(port, "evil.example", "http://evil.example"))
            assert evil in (403, 421)
            assert await _status(port, _upgrade(port, origin="http://evil.example")) == 403
            assert await _status(port, _upgrade(port, host="evil.example")) == 421
            # a loopback origin of another port is another site
            assert await _status(port, _upgrade(port, origin="http://127.0.0.1:1")) == 403
            assert await _status(port, _upgrade(port, origin="null")) == 403
            for origin in (
                None,
                f"http://127.0.0.1:{port}",
                f"http://localhost:{port}",
                f"http://[::1]:{port}",
                "https://editor.example",
            ):
                assert await _status(port, _upgrade(port, origin=origin)) == 101, origin
            for host in (f"localhost:{port}", "acp.internal", f"[::1]:{port}"):
                assert await _status(port, _upgrade(port, host=host)) == 101, host
            body = json.dumps(INITIALIZE).encode()
            assert await _status(port, _post(port, body, origin="http://evil.example")) == 403
            assert await _status(port, _post(port, body, host="evil.example")) == 421
            assert await _status(port, _post(port, body)) == 200
            # /healthz says only "ok": it stays reachable for load balancers under any name
            healthz = b"GET /healthz HTTP/1.1\r\nHost: evil.example\r\nOrigin: http://x\r\n\r\n"
            assert await _status(port, healthz) == 200
            assert srv.acp.forbidden == 7
            # a client of the library sends no Origin: nothing changes for it
            async with session_conn(srv.url) as (_, conn):
                await new_session(conn)


async def test_a_large_body_is_refused_before_it_ends(tmp_path: Path) -> None:
    limit = 64 * 1024
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, max_message_bytes=limit) as srv:
            port = srv.port
            head = (
                f"POST /acp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            ).encode()
            chunk = b"x" * 16 * 1024
            framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                await stream.send(head)
                for _ in range(limit // len(chunk) + 1):  # just over the limit
                    await stream.send(framed)
                # the answer comes while the body is still open (it came only at its end)
                with anyio.fail_after(5):
                    answer = await _read_head(stream)
                assert answer.split(b" ", 2)[1] == b"413"
                # the client may go on sending: the rest is discarded, the socket lives
                for _ in range(3 * limit // len(chunk)):
                    await stream.send(framed)
                await stream.send(b"0\r\n\r\n")
                await stream.send(
                    f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
                )
                assert b" 200 " in await _read_head(stream)
            declared = _post(port, b"")
            declared = declared.replace(
                b"Content-Length: 0", f"Content-Length: {4 * limit}".encode()
            )
            assert await _status(port, declared) == 413  # refused unread
            async with session_conn(srv.url) as (_, conn):
                await new_session(conn)


async def test_initialize_floods_expire_and_do_not_starve_clients(tmp_path: Path) -> None:
    options = {"max_unopened_http": 5, "http_open_timeout": 1.0}
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path, max_connections=3, app_options=options) as srv,
            httpx.AsyncClient() as client,
        ):
            url = f"{srv.http}/acp"
            codes = [(await client.post(url, json=INITIALIZE)).status_code for _ in range(20)]
            assert codes == [200] * 5 + [503] * 15
            lone = list(srv.acp.http_connections.values())
            # they count apart: WebSocket clients and streaming HTTP clients are still served
            async with session_conn(srv.url) as (_, conn):
                await new_session(conn)
            # lone POSTs end after http_open_timeout (they lived for the idle timeout: 300 s)
            for frames in lone:
                with anyio.fail_after(5):
                    await frames.closed.wait()
            assert srv.acp.unopened_closed == 5
            async with connect_http(url) as frames_client:
                await frames_client.send(json.dumps(INITIALIZE).encode())
                first = await frames_client.receive()
                assert isinstance(first, bytes) and b'"result"' in first
                assert frames_client.connection_id in srv.acp.http_connections


async def test_half_open_sockets_are_capped_and_timed_out(tmp_path: Path) -> None:
    listen = {"header_timeout": 1.0, "max_half_open": 40, "max_half_open_per_address": 20}
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, listen_options=listen) as srv:
            guard = _guard(srv)
            sockets = []
            try:
                for _ in range(50):
                    stream = await anyio.connect_tcp("127.0.0.1", srv.port)
                    sockets.append(stream)
                    await stream.send(b"GET /healthz HTTP/1.1\r\nHost: 127")  # never finished
                with anyio.fail_after(3):
                    async with httpx.AsyncClient() as client:
                        health = await client.get(f"{srv.http}/healthz")
                assert health.status_code == 200
                assert guard.evicted >= 30
                # every half-open socket is closed: the oldest at once, the rest at the deadline
                with anyio.fail_after(5):
                    for stream in sockets:
                        with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                            await stream.receive()
                assert guard.timed_out >= 1 and guard.half_open == 0
                # real clients are still served
                async with session_conn(srv.url) as (_, conn):
                    await new_session(conn)
            finally:
                for stream in sockets:
                    await stream.aclose()


def _guard(srv: Running) -> HalfOpenGuard:
    guard: HalfOpenGuard = srv.server.config.http.guard  # type: ignore[union-attr]
    return guard


async def test_session_stream_entries_end_with_their_reader(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv, httpx.AsyncClient() as client:
            url = f"{srv.http}/acp"
            answer = await client.post(url, json=INITIALIZE)
            connection_id = answer.headers[CONNECTION_ID_HEADER]
            frames = srv.acp.http_connections[connection_id]
            for _ in range(30):  # ids of the client's choosing, none of them a session
                headers = {
                    "Accept": "text/event-stream",
                    CONNECTION_ID_HEADER: connection_id,
                    SESSION_ID_HEADER: uuid.uuid4().hex,
                }
                async with client.stream("GET", url, headers=headers) as response:
                    assert response.status_code == 200
            # bounded polling of the server's table (the readers end as their sockets do)
            for _ in range(500):
                if frames.scopes <= 1:
                    break
                await anyio.sleep(0.01)
            assert frames.scopes <= 1  # the connection stream's entry at most


async def test_serve_flags_allow_an_origin_and_a_host(tmp_path: Path) -> None:
    extra = ("--allow-origin", "https://editor.example", "--allow-host", "acp.internal")
    with anyio.fail_after(TIMEOUT):
        async with ServeProcess(tmp_path, *extra) as srv:
            port = srv.port
            # the socket listens before the process serves: these wait in its backlog
            assert await _status(port, _upgrade(port, origin="https://editor.example")) == 101
            assert await _status(port, _upgrade(port, host="acp.internal")) == 101
            assert await _status(port, _upgrade(port, origin="https://other.example")) == 403
            assert await _status(port, _upgrade(port, host="evil.example")) == 421


async def test_a_kept_alive_socket_idle_past_the_header_timeout_is_closed(tmp_path: Path) -> None:
    """After an answered request the next request's headers are due within `header_timeout`,
    counted from the answer (the check armed at connect time runs again for what is left)."""
    listen = {"header_timeout": 2.0}
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, listen_options=listen) as srv:
            guard = _guard(srv)
            before = guard.timed_out
            stream = await anyio.connect_tcp("127.0.0.1", srv.port)
            try:
                await anyio.sleep(1.5)  # most of the first deadline passes before the request
                await stream.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                answer = b""
                while b"\r\n\r\n" not in answer:
                    answer += await stream.receive()
                assert answer.startswith(b"HTTP/1.1 200")
                answered = anyio.current_time()
                with (
                    anyio.fail_after(5),
                    pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)),
                ):
                    while True:
                        await stream.receive()
                # not at the first deadline (~0.5 s after the answer) but at the answer's own
                # (2 s after it; the margin covers a loaded machine reading the answer late)
                assert anyio.current_time() - answered >= 1.25
                assert guard.timed_out == before + 1
            finally:
                await stream.aclose()
