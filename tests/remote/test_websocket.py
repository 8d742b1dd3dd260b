"""ACP over WebSocket against the reference agent served by uvicorn on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from acp_once.client import AcpClient, Client, ClientSideConnection, WebSocketLauncher
from acp_once.protocol import schema as s
from acp_once.protocol.errors import RESOURCE_NOT_FOUND, AcpError
from acp_once.rpc.errors import ConnectionClosed
from acp_once.support.backoff import Backoff
from acp_once.transports.websocket import (
    CLOSE_GOING_AWAY,
    ClientWebSocketFrames,
    WebSocketRejected,
    connect_websocket,
)
from tests.helpers import UpdateRecorder, initialize_request
from tests.remote.harness import Background, Running, listening_socket, running

pytestmark = pytest.mark.anyio

TIMEOUT = 30
FAST = Backoff(base=0.05, factor=2.0, cap=0.3)
KEY = "remote-key-1"


@asynccontextmanager
async def session_conn(
    url: str, client: Client | None = None, *, token: str | None = None
) -> AsyncIterator[tuple[ClientWebSocketFrames, ClientSideConnection]]:
    """A raw ACP connection over WebSocket, initialized."""
    async with (
        connect_websocket(url, token=token) as frames,
        ClientSideConnection(client or Client(), frames) as conn,
    ):
        await conn.agent.initialize(initialize_request("t"))
        yield frames, conn


def prompt_params(sid: str, text: str, key: str | None = KEY) -> dict[str, Any]:
    p: dict[str, Any] = {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}
    if key is not None:
        p["idempotencyKey"] = key
    return p


async def prompt(conn: ClientSideConnection, sid: str, text: str, key: str | None = KEY) -> str:
    result = await conn.rpc.request("session/prompt", prompt_params(sid, text, key))
    return str(result["messageId"])


async def new_session(conn: ClientSideConnection) -> str:
    return (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id


async def resume(conn: ClientSideConnection, sid: str) -> None:
    await conn.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/w"))


def effects(tmp_path: Path, sid: str) -> list[str]:
    path = tmp_path / "effects" / f"{sid}.log"
    return path.read_text().split() if path.exists() else []


async def test_initialize_new_session_and_prompt(tmp_path: Path) -> None:
    recorder = UpdateRecorder()
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv, session_conn(srv.url, recorder) as (frames, conn):
            assert frames.connection_id is not None
            assert frames.connection_id in srv.acp.connections
            # binary frames carry nothing and are ignored; the connection lives on
            await frames.connection.send(b'{"jsonrpc": "2.0", "id": 99, "method": "x"}')
            sid = await new_session(conn)
            message_id = await prompt(conn, sid, "hello [tool]")
            assert message_id.startswith("msg_user_")
            await recorder.wait_for(lambda ups: any(u.get("stopReason") == "end_turn" for u in ups))
            assert recorder.user_messages() == [message_id]
            texts = [
                u["content"][0]["text"]
                for u in recorder.updates
                if u["sessionUpdate"] == "agent_message"
            ]
            assert texts == ["hello [tool]"]
            assert srv.acp.accepted == 1
            assert await srv.agent.store.count_user_messages(sid) == 1
    assert effects(tmp_path, sid) == [message_id]


async def test_t2_answer_lost_with_the_socket_then_resume_and_retry(tmp_path: Path) -> None:
    """The agent commits the keyed prompt, then the server drops the socket before answering.
    On a new connection the retry (after session/resume) answers the original message id."""
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv:
            srv.agent.faults.append(lambda: _close_all(srv))
            async with session_conn(srv.url) as (frames, first):
                sid = await new_session(first)
                with pytest.raises(ConnectionClosed):
                    await prompt(first, sid, "deploy [tool]")
            assert frames.close_code == CLOSE_GOING_AWAY
            assert len(srv.agent.cut) == 1
            async with session_conn(srv.url) as (_, second):
                # not active on the new connection until resumed
                with pytest.raises(AcpError) as info:
                    await prompt(second, sid, "deploy [tool]")
                assert info.value.code == RESOURCE_NOT_FOUND
                await resume(second, sid)
                assert await prompt(second, sid, "deploy [tool]") == srv.agent.cut[0]
            store = srv.agent.store
            assert await store.count_user_messages(sid) == 1
            assert await store.count_user_messages(sid, idempotency_key=KEY) == 1


async def _close_all(srv: Running) -> None:
    assert await srv.acp.close_all(CLOSE_GOING_AWAY) >= 1


async def test_client_abort_after_insert_then_retry_on_new_connection(tmp_path: Path) -> None:
    """The client's TCP connection dies (no closing handshake) while the answer is due."""
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv:
            async with session_conn(srv.url) as (frames, first):
                sid = await new_session(first)
                srv.agent.faults.append(frames.abort)
                with pytest.raises(ConnectionClosed):
                    await prompt(first, sid, "once")
            async with session_conn(srv.url) as (_, second):
                await resume(second, sid)
                assert await prompt(second, sid, "once") == srv.agent.cut[0]
            assert await srv.agent.store.count_user_messages(sid) == 1


async def test_a_session_active_on_two_connections_gets_updates_on_both(tmp_path: Path) -> None:
    a_rec, b_rec = UpdateRecorder(), UpdateRecorder()
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path) as srv,
            session_conn(srv.url, a_rec) as (fa, a),
            session_conn(srv.url, b_rec) as (fb, b),
        ):
            assert fa.connection_id != fb.connection_id
            assert len(srv.acp.connections) == 2
            sid = await new_session(a)
            await resume(b, sid)
            message_id = await prompt(b, sid, "hello")
            assert await prompt(a, sid, "hello") == message_id  # the retry, on the other one
            for rec in (a_rec, b_rec):
                await rec.wait_for(lambda ups: any(u.get("stopReason") == "end_turn" for u in ups))
                assert rec.user_messages() == [message_id]
                assert all(n["sessionId"] == sid for n in rec.notifications)
            assert await srv.agent.store.count_user_messages(sid) == 1


async def test_acp_client_keeps_the_promise_when_connections_drop(tmp_path: Path) -> None:
    """`AcpClient` over `WebSocketLauncher`: the first prompt's answer is lost when the server
    closes the socket, the second's when the client's connection dies; each is inserted once
    and answered with its original message id."""
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv:
            launcher = WebSocketLauncher(srv.url)

            async def abort_client() -> None:
                assert launcher.current is not None
                await launcher.current.abort()

            srv.agent.faults.extend([lambda: _close_all(srv), abort_client])
            async with AcpClient(
                launcher, outbox=f"sqlite:{tmp_path / 'outbox.sqlite3'}", backoff=FAST
            ) as client:
                assert client.keys_trusted
                session = await client.new_session("/w")
                ids = [await session.prompt(f"step {n} [tool]") for n in range(3)]
                assert ids[:2] == srv.agent.cut
                assert len(set(ids)) == 3
                assert launcher.connects == 3
                assert client.reconnects == 2
                assert not await client.outbox.pending()
            sid = session.session_id
            assert await srv.agent.store.count_user_messages(sid) == 3
    assert sorted(effects(tmp_path, sid)) == sorted(ids)


async def test_missing_or_wrong_token_is_refused_before_any_message(tmp_path: Path) -> None:
    token = "s3cret-token"
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, token=token) as srv:
            for wrong in (None, "wrong", token + "x", ""):
                with pytest.raises(WebSocketRejected) as info:
                    async with connect_websocket(srv.url, token=wrong):
                        pass
                assert info.value.status == 401
                assert token not in str(info.value)
            with pytest.raises(WebSocketRejected):
                async with AcpClient(WebSocketLauncher(srv.url, "nope"), backoff=FAST):
                    pass
            assert srv.acp.accepted == 0 and srv.acp.rejected == 5
            assert await srv.agent.store.list_sessions() == ([], None)  # nothing processed
            async with httpx.AsyncClient(base_url=srv.http) as http:
                assert (await http.post("/acp", content=b"{}")).status_code == 401
                authed = await http.post(
                    "/acp", content=b"{}", headers={"Authorization": f"Bearer {token}"}
                )
                assert authed.status_code == 415  # past the token check: not JSON
                assert (await http.get("/healthz")).json() == {"status": "ok"}
            async with AcpClient(WebSocketLauncher(srv.url, token), backoff=FAST) as client:
                session = await client.new_session("/w")
                await session.prompt("authorized")
            assert srv.acp.accepted == 1
            assert await srv.agent.store.count_user_messages(session.session_id) == 1


async def test_healthz_and_other_methods(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv, httpx.AsyncClient(base_url=srv.http) as http:
            health = await http.get("/healthz")
            assert health.status_code == 200
            assert health.headers["content-type"] == "application/json"
            assert health.json() == {"status": "ok"}
            # plain HTTP at /acp is Streamable HTTP (tests/remote/test_http.py)
            expected = {"GET": 406, "POST": 415, "DELETE": 400, "PUT": 405, "PATCH": 405}
            for method, status in expected.items():
                answer = await http.request(
                    method, "/acp", content=b"" if method != "GET" else None
                )
                assert answer.status_code == status, method
            assert srv.acp.accepted == 0


async def test_server_restart_on_the_same_store_and_port(tmp_path: Path) -> None:
    """uvicorn stops (its connections close) and starts again on the same SQLite file and port;
    the client reconnects, resumes and its prompt submitted meanwhile is inserted once."""
    first_sock = listening_socket()
    port = first_sock.getsockname()[1]
    launcher = WebSocketLauncher(f"ws://127.0.0.1:{port}/acp")
    after: list[str] = []
    done = anyio.Event()
    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as servers:
            first = Background(servers, tmp_path, sock=first_sock)
            await first.start()
            async with AcpClient(launcher, backoff=FAST) as client:
                session = await client.new_session("/w")
                sid = session.session_id
                before = await session.prompt("before the restart")
                await first.stop()  # uvicorn, then the agent and its store

                async def submit() -> None:
                    after.append(await session.prompt("during the restart"))
                    done.set()

                async with anyio.create_task_group() as tg:
                    # the server is down: this submission waits while connects are refused
                    tg.start_soon(submit)
                    async with running(tmp_path, sock=listening_socket(port)) as srv:
                        await done.wait()
                        store = srv.agent.store
                        assert await store.count_user_messages(sid) == 2
                        assert [r.session_id for r in (await store.list_sessions())[0]] == [sid]
                assert launcher.connects == 2
                assert client.reconnects >= 1
    assert before != after[0]
