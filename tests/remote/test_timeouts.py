"""Idle and stalled-reader timeouts of the server, over WebSocket and Streamable HTTP.

Short timeouts keep the tests quick; every wait is an event or a bounded poll, and no test
asserts how long anything took.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from acp_once.rpc.streams import FrameStream
from acp_once.transports.http import CONNECTION_ID_HEADER, SESSION_ID_HEADER, connect_http
from acp_once.transports.websocket import CLOSE_NORMAL, connect_websocket
from tests.remote.harness import Running, ServeProcess, running
from tests.remote.test_websocket import new_session, prompt, resume, session_conn

pytestmark = pytest.mark.anyio

TIMEOUT = 30
INIT: dict[str, Any] = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {"protocolVersion": 2, "info": {"name": "t", "version": "1"}},
}
BIG = "x" * (1024 * 1024)  # echoed twice per prompt (user_message, agent_message)


async def message(frames: FrameStream) -> dict[str, Any]:
    frame = await frames.receive()
    assert isinstance(frame, bytes)
    parsed: dict[str, Any] = json.loads(frame)
    return parsed


async def poll(condition: Any) -> None:
    """Until `condition()` holds; bounded by the caller's fail_after."""
    while not condition():  # noqa: ASYNC110 (server state, no event to wait on)
        await anyio.sleep(0.01)


async def test_an_idle_websocket_is_closed_and_a_busy_one_is_not(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path, idle_timeout=1.0) as srv,
            session_conn(srv.url) as (idle, _),
            session_conn(srv.url) as (busy_frames, busy),
        ):
            sid = await new_session(busy)
            sent = 0
            closed = anyio.Event()

            async def wait_closed() -> None:
                await idle.connection.wait_closed()
                closed.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_closed)
                while not closed.is_set():  # traffic well within the idle timeout
                    await prompt(busy, sid, f"keep alive {sent}", None)
                    sent += 1
            assert idle.close_code == CLOSE_NORMAL
            assert idle.connection.close_reason == "idle timeout"
            assert srv.acp.idle_closed == 1
            await poll(lambda: len(srv.acp.connections) == 1)
            assert busy_frames.connection_id in srv.acp.connections
            await prompt(busy, sid, "still here", None)
            assert await srv.agent.store.count_user_messages(sid) == sent + 1


async def test_an_idle_http_connection_ends_and_its_id_is_gone(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path, idle_timeout=0.5) as srv,
            httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT, read=None)) as http,
        ):
            url = f"{srv.http}/acp"
            answer = await http.post(url, json=INIT)
            cid = answer.headers[CONNECTION_ID_HEADER]
            sse = {"Accept": "text/event-stream", CONNECTION_ID_HEADER: cid}
            async with http.stream("GET", url, headers=sse) as stream:
                async for _ in stream.aiter_bytes():
                    pass  # the server ends the stream when it ends the connection
            assert srv.acp.idle_closed == 1
            assert cid not in srv.acp.http_connections
            new = {"jsonrpc": "2.0", "id": 1, "method": "session/new", "params": {"cwd": "/w"}}
            gone = await http.post(url, json=new, headers={CONNECTION_ID_HEADER: cid})
            assert gone.status_code == 404


async def test_no_idle_timeout_keeps_a_quiet_connection(tmp_path: Path) -> None:
    """With `idle_timeout=None` nothing is closed: a quiet connection still answers after the
    server closed an idle one on another server with a short timeout (the control)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path / "a", idle_timeout=None) as keep,
            running(tmp_path / "b", idle_timeout=0.3) as short,
            session_conn(keep.url) as (_, quiet),
            session_conn(short.url) as (control, _),
        ):
            await control.connection.wait_closed()
            assert short.acp.idle_closed == 1
            assert await new_session(quiet)
            assert keep.acp.idle_closed == 0 and len(keep.acp.connections) == 1


async def _drive_until(srv: Running, sid: str, gone: Any) -> int:
    """Prompt big texts on `sid` over a healthy connection until `gone()`; returns how many."""
    sent = 0
    async with session_conn(srv.url) as (_, driver):
        await resume(driver, sid)
        while not gone():
            await prompt(driver, sid, f"{sent} {BIG}", None)
            sent += 1
        # the agent is not held up: the healthy connection keeps working
        await prompt(driver, sid, "after", None)
    return sent + 1


async def test_a_websocket_that_stops_reading_is_dropped(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, write_timeout=0.5) as srv:
            async with session_conn(srv.url) as (_, setup):
                sid = await new_session(setup)
            async with connect_websocket(srv.url, ping_interval=None) as stalled:
                cid = stalled.connection_id
                resume_request = {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "session/resume",
                    "params": {"sessionId": sid, "cwd": "/w"},
                }
                for request in (INIT, resume_request):
                    await stalled.send(json.dumps(request).encode())
                    while (answer := await message(stalled)).get("id") is None:
                        pass  # updates
                    assert "result" in answer
                # from here on it reads nothing: the server's send buffer fills up
                sent = await _drive_until(srv, sid, lambda: cid not in srv.acp.connections)
                assert await srv.agent.store.count_user_messages(sid) == sent
                # it was dropped: reading again drains what was buffered, then the end
                with pytest.raises(anyio.EndOfStream):
                    while True:
                        await stalled.receive()
            assert stalled.close_code != CLOSE_NORMAL


async def test_an_sse_reader_that_stops_reading_ends_its_connection(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path, write_timeout=0.5) as srv,
            httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT, read=None)) as http,
        ):
            async with session_conn(srv.url) as (_, setup):
                sid = await new_session(setup)
            url = f"{srv.http}/acp"
            cid = (await http.post(url, json=INIT)).headers[CONNECTION_ID_HEADER]
            headers = {CONNECTION_ID_HEADER: cid, SESSION_ID_HEADER: sid}
            sse = {**headers, "Accept": "text/event-stream"}
            async with http.stream("GET", url, headers=sse) as stream:
                assert stream.status_code == 200  # and never read
                resume_request = {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "session/resume",
                    "params": {"sessionId": sid, "cwd": "/w"},
                }
                assert (
                    await http.post(url, json=resume_request, headers=headers)
                ).status_code == 202
                sent = await _drive_until(srv, sid, lambda: cid not in srv.acp.http_connections)
            assert await srv.agent.store.count_user_messages(sid) == sent
            gone = await http.post(url, json=resume_request, headers=headers)
            assert gone.status_code == 404


async def test_http_client_sees_the_idle_end_as_a_lost_connection(tmp_path: Path) -> None:
    """`connect_http`'s frame stream ends when the server ends an idle connection."""
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, idle_timeout=0.5) as srv:
            async with connect_http(f"{srv.http}/acp") as frames:
                await frames.send(json.dumps(INIT).encode())
                assert (await message(frames))["id"] == 0
                with pytest.raises(anyio.EndOfStream):
                    await frames.receive()
                assert frames.ended
            assert srv.acp.idle_closed == 1


async def test_serve_idle_timeout_option(tmp_path: Path) -> None:
    """`acp-once serve --idle-timeout` reaches the server: a quiet WebSocket is closed."""
    with anyio.fail_after(TIMEOUT):
        async with ServeProcess(tmp_path, "--idle-timeout", "0.5") as server:
            url = f"ws://127.0.0.1:{server.port}/acp"
            async with session_conn(url) as (frames, conn):
                assert await new_session(conn)
                await frames.connection.wait_closed()
            assert frames.close_code == CLOSE_NORMAL
            assert frames.connection.close_reason == "idle timeout"
