"""ACP over Streamable HTTP (digest 7.2) against the reference agent served by uvicorn."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import anyio
import anyio.abc
import httpx
import pytest
import uvicorn

from acp_once.agent.reference import ReferenceAgent
from acp_once.client import AcpClient, HttpLauncher
from acp_once.server import create_app, http_protocol
from acp_once.server.http_protocol import _DirectSseH11
from acp_once.storage import open_store
from acp_once.transports.http import CONNECTION_ID_HEADER, SESSION_ID_HEADER, ServerHttpFrames
from tests.remote.harness import Running, listening_socket, running
from tests.remote.test_websocket import FAST, KEY, TIMEOUT, effects, prompt_params

pytestmark = pytest.mark.anyio

INIT = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {"protocolVersion": 2, "info": {"name": "t", "version": "1"}},
}
SSE = {"Accept": "text/event-stream"}
JSON = {"Content-Type": "application/json"}

Message = dict[str, Any]


def url(srv: Running) -> str:
    return f"{srv.http}/acp"


def request(id_: int, method: str, params: Message) -> Message:
    return {"jsonrpc": "2.0", "id": id_, "method": method, "params": params}


class Raw:
    """A hand-driven HTTP ACP connection."""

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self.http = http
        self.url = url
        self.cid = ""

    async def initialize(self) -> Message:
        r = await self.http.post(self.url, json=INIT)
        assert r.status_code == 200, r.text
        self.cid = r.headers[CONNECTION_ID_HEADER]
        body: Message = r.json()
        return body

    async def post(self, message: Message, sid: str | None = None) -> httpx.Response:
        headers = {CONNECTION_ID_HEADER: self.cid}
        if sid is not None:
            headers[SESSION_ID_HEADER] = sid
        return await self.http.post(self.url, json=message, headers=headers)

    @asynccontextmanager
    async def stream(self, sid: str | None = None) -> AsyncIterator[Stream]:
        headers = {**SSE, CONNECTION_ID_HEADER: self.cid}
        if sid is not None:
            headers[SESSION_ID_HEADER] = sid
        async with self.http.stream("GET", self.url, headers=headers) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            yield Stream(r)


class Stream:
    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.lines = response.aiter_lines()
        self.seen: list[Message] = []

    async def until(self, predicate: Callable[[Message], bool]) -> Message:
        async for line in self.lines:
            if line.startswith("data:"):
                message: Message = json.loads(line[5:])
                self.seen.append(message)
                if predicate(message):
                    return message
        raise AssertionError(f"the stream ended; seen {self.seen}")

    async def response_to(self, id_: int) -> Message:
        return await self.until(lambda m: m.get("id") == id_ and "method" not in m)


@asynccontextmanager
async def raw(srv: Running) -> AsyncIterator[Raw]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT, read=None)) as http:
        yield Raw(http, url(srv))


async def new_session(conn: Raw, stream: Stream, id_: int = 1) -> str:
    r = await conn.post(request(id_, "session/new", {"cwd": "/w"}))
    assert r.status_code == 202 and r.content == b""
    return str((await stream.response_to(id_))["result"]["sessionId"])


async def test_status_codes(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv, raw(srv) as conn:
            http, u = conn.http, conn.url
            new = request(1, "session/new", {"cwd": "/w"})
            assert (
                await http.post(u, content=b"{}", headers={"Content-Type": "text/plain"})
            ).status_code == 415
            assert (await http.post(u, content=b"{nope", headers=JSON)).status_code == 400
            assert (await http.post(u, json=[INIT])).status_code == 400  # batch
            assert (await http.post(u, json=1)).status_code == 400  # not an object
            assert (await http.post(u, json=new)).status_code == 400  # no connection id
            assert (
                await http.post(u, json=new, headers={CONNECTION_ID_HEADER: "x"})
            ).status_code == 404
            assert not srv.acp.http_connections

            body = await conn.initialize()
            assert body["id"] == 0 and body["result"]["protocolVersion"] == 2
            assert conn.cid in srv.acp.http_connections
            again = await http.post(u, json=INIT, headers={CONNECTION_ID_HEADER: conn.cid})
            assert again.status_code == 400

            params = prompt_params("sess_x", "hi")
            assert (await conn.post(request(2, "session/prompt", params))).status_code == 400
            assert (
                await conn.post(request(2, "session/prompt", params), "sess_y")
            ).status_code == 400
            assert (await conn.post(new, "sess_y")).status_code == 400  # header, no sessionId

            assert (await http.get(u, headers={CONNECTION_ID_HEADER: conn.cid})).status_code == 406
            assert (await http.get(u, headers=SSE)).status_code == 400
            assert (
                await http.get(u, headers={**SSE, CONNECTION_ID_HEADER: "x"})
            ).status_code == 404
            async with conn.stream() as stream, conn.stream("sess_a"):
                second = await http.get(u, headers={**SSE, CONNECTION_ID_HEADER: conn.cid})
                assert second.status_code == 409
                other = {**SSE, CONNECTION_ID_HEADER: conn.cid, SESSION_ID_HEADER: "sess_a"}
                assert (await http.get(u, headers=other)).status_code == 409
                sid = await new_session(conn, stream, 3)
                assert sid.startswith("sess")

            assert (await http.put(u, json=new)).status_code == 405
            assert (await http.delete(u)).status_code == 400
            assert (
                await http.delete(u, headers={CONNECTION_ID_HEADER: conn.cid})
            ).status_code == 202
            assert (await conn.post(new)).status_code == 404
            assert (
                await http.delete(u, headers={CONNECTION_ID_HEADER: conn.cid})
            ).status_code == 404
            # the session survived the connection (D30): resumable on a new one
            fresh = Raw(http, u)
            await fresh.initialize()
            async with fresh.stream(sid) as s_stream:
                r = await fresh.post(
                    request(1, "session/resume", {"sessionId": sid, "cwd": "/w"}), sid
                )
                assert r.status_code == 202
                assert "result" in await s_stream.response_to(1)


async def test_token_is_checked(tmp_path: Path) -> None:
    token = "s3cret-token"
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, token=token) as srv, raw(srv) as conn:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = await conn.http.post(conn.url, json=INIT, headers=headers)
                assert r.status_code == 401
                assert r.headers["www-authenticate"].startswith("Bearer")
            assert not srv.acp.http_connections
            ok = await conn.http.post(
                conn.url, json=INIT, headers={"Authorization": f"Bearer {token}"}
            )
            assert ok.status_code == 200


async def test_initialize_new_session_and_keyed_prompt(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv, raw(srv) as conn:
            await conn.initialize()
            async with conn.stream() as c_stream:
                sid = await new_session(conn, c_stream)
                async with conn.stream(sid) as s_stream:
                    r = await conn.post(
                        request(2, "session/prompt", prompt_params(sid, "hello [tool]")), sid
                    )
                    assert r.status_code == 202 and r.content == b""
                    answer = await s_stream.response_to(2)
                    message_id = answer["result"]["messageId"]
                    assert message_id.startswith("msg_user_")
                    await s_stream.until(
                        lambda m: (
                            m.get("params", {}).get("update", {}).get("stopReason") == "end_turn"
                        )
                    )
                    updates = [m for m in s_stream.seen if m.get("method") == "session/update"]
                    assert updates and all(m["params"]["sessionId"] == sid for m in updates)
                # nothing session-scoped went to the connection stream
                assert [m.get("id") for m in c_stream.seen] == [1]
            assert await srv.agent.store.count_user_messages(sid) == 1
    assert effects(tmp_path, sid) == [message_id]


async def test_t2_response_lost_with_the_stream_then_resume_and_retry(tmp_path: Path) -> None:
    """The keyed prompt is accepted (202) and committed, then the GET stream that would carry
    the answer closes. A new connection resumes the session and the retry (same key, new id)
    answers the original message id; one message is stored."""
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv, raw(srv) as first:
            await first.initialize()
            async with first.stream() as c_stream:
                sid = await new_session(first, c_stream)
            cut = anyio.Event()
            async with first.stream(sid) as s_stream:

                async def close_stream() -> None:
                    await s_stream.response.aclose()
                    cut.set()

                srv.agent.faults.append(close_stream)
                params = prompt_params(sid, "deploy [tool]")
                r = await first.post(request(2, "session/prompt", params), sid)
                assert r.status_code == 202
                await cut.wait()
            assert not any(m.get("id") == 2 for m in s_stream.seen)
            assert len(srv.agent.cut) == 1

            second = Raw(first.http, first.url)
            await second.initialize()
            assert second.cid != first.cid
            async with second.stream(sid) as stream:
                resume = request(1, "session/resume", {"sessionId": sid, "cwd": "/w"})
                assert (await second.post(resume, sid)).status_code == 202
                assert "result" in await stream.response_to(1)
                retry = request(2, "session/prompt", params)
                assert (await second.post(retry, sid)).status_code == 202
                answer = await stream.response_to(2)
                assert answer["result"]["messageId"] == srv.agent.cut[0]
            store = srv.agent.store
            assert await store.count_user_messages(sid) == 1
            assert await store.count_user_messages(sid, idempotency_key=KEY) == 1


async def test_acp_client_over_http_agent(tmp_path: Path) -> None:
    """`AcpClient(HttpLauncher(...))`: prompts are answered; when the server drops the GET
    streams after the first insertion, the client reconnects and the retry answers the
    original message id."""
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv:

            async def drop_streams() -> None:
                dropped = sum(c.drop_readers() for c in srv.acp.http_connections.values())
                assert dropped >= 1

            srv.agent.faults.append(drop_streams)
            launcher = HttpLauncher(url(srv))
            async with AcpClient(
                launcher, outbox=f"sqlite:{tmp_path / 'outbox.sqlite3'}", backoff=FAST
            ) as client:
                session = await client.new_session("/w")
                ids = [await session.prompt(f"step {n} [tool]") for n in range(3)]
                assert ids[0] == srv.agent.cut[0]
                assert len(set(ids)) == 3
                assert launcher.connects == 2
                assert not await client.outbox.pending()
            sid = session.session_id
            assert await srv.agent.store.count_user_messages(sid) == 3
    assert sorted(effects(tmp_path, sid)) == sorted(ids)


async def test_server_frames_route_by_scope_and_close_on_overflow() -> None:
    """Responses follow their request's scope, notifications their `params.sessionId`; more
    than `buffer` messages waiting for an absent reader close the connection."""
    with anyio.fail_after(TIMEOUT):
        frames = ServerHttpFrames("c1", buffer=2)
        scoped = request(7, "session/prompt", {"sessionId": "s1"})
        await frames.post(json.dumps(scoped).encode(), scoped, "s1")
        plain = request(8, "session/list", {})
        await frames.post(json.dumps(plain).encode(), plain, None)
        assert json.loads(await frames.receive())["id"] == 7  # type: ignore[arg-type]
        assert json.loads(await frames.receive())["id"] == 8  # type: ignore[arg-type]
        await frames.send(b'{"jsonrpc": "2.0", "id": 7, "result": {}}')
        await frames.send(b'{"jsonrpc": "2.0", "id": 8, "result": {}}')
        update = {"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": "s1"}}
        await frames.send(json.dumps(update).encode())
        assert [json.loads(f)["id"] for f in frames.waiting(None)] == [8]
        session = [json.loads(f) for f in frames.waiting("s1")]
        assert [m.get("id", m.get("method")) for m in session] == [7, "session/update"]
        frames.outlet("s1").frames.clear()  # as a reader would have taken them
        for _ in range(2):
            await frames.send(json.dumps(update).encode())
        assert not frames.closed.is_set()
        with pytest.raises(anyio.BrokenResourceError):
            await frames.send(json.dumps(update).encode())
        assert frames.overflowed and frames.closed.is_set()
        with pytest.raises(anyio.EndOfStream):
            await frames.receive()
        with pytest.raises(anyio.ClosedResourceError):
            await frames.post(json.dumps(plain).encode(), plain, None)


async def _keyed_turn_events(srv_http: str) -> tuple[list[Message], str]:
    """One connection: a session, a keyed prompt; the session stream's messages up to the
    turn's end (in the order they arrived) and the session id."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT, read=None)) as http:
        conn = Raw(http, f"{srv_http}/acp")
        await conn.initialize()
        async with conn.stream() as c_stream:
            sid = await new_session(conn, c_stream)
            async with conn.stream(sid) as s_stream:
                for n in (2, 3):
                    params = prompt_params(sid, f"turn {n} [tool]", key=f"key-{n}")
                    r = await conn.post(request(n, "session/prompt", params), sid)
                    assert r.status_code == 202 and r.content == b""
                    await s_stream.until(
                        lambda m: m.get("params", {}).get("update", {}).get("state") == "idle"
                    )
                return s_stream.seen, sid


def _check_turns(seen: list[Message], sid: str) -> None:
    """Every message of both turns arrived once, in order: each answer before its turn's
    idle state, the second turn's messages after the first turn's idle state."""
    answers = [m["id"] for m in seen if "method" not in m]
    assert answers == [2, 3]
    assert all(m["params"]["sessionId"] == sid for m in seen if "method" in m)
    idle = [
        i
        for i, m in enumerate(seen)
        if m.get("params", {}).get("update", {}).get("state") == "idle"
    ]
    first_answer, second_answer = (i for i, m in enumerate(seen) if "method" not in m)
    assert len(idle) == 2 and first_answer < idle[0] < second_answer < idle[1]
    assert all(
        "result" in m and m["result"]["messageId"].startswith("msg_user_")
        for m in seen
        if "method" not in m
    )


async def test_serve_streams_through_direct_sse_writers(tmp_path: Path) -> None:
    """Under `uvicorn_config` (serve) the h11 protocol offers SSE writers and the turn's
    messages all arrive, in order, with their ids."""
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv:
            assert issubclass(srv.server.config.http, _DirectSseH11)  # type: ignore[arg-type]
            seen, sid = await _keyed_turn_events(srv.http)
            _check_turns(seen, sid)
            assert await srv.agent.store.count_user_messages(sid) == 2


async def test_plain_uvicorn_h11_streams_through_asgi_events(tmp_path: Path) -> None:
    """The same app under uvicorn's own h11 protocol (no SSE writer, no complete-body mark):
    each stream's task writes through ASGI events, with the same messages in the same order."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    with anyio.fail_after(TIMEOUT):
        async with (
            open_store(f"sqlite:{tmp_path / 'agent.sqlite3'}") as store,
            ReferenceAgent(store, side_effects=tmp_path / "effects") as agent,
        ):
            app = create_app(agent)
            config = uvicorn.Config(app, http="h11", lifespan="on", log_level="warning")
            server = uvicorn.Server(config)
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.serve, [sock])
                try:  # the socket listens already: clients wait in its backlog
                    seen, sid = await _keyed_turn_events(f"http://127.0.0.1:{port}")
                finally:
                    await app.state.acp.close_all()
                    server.should_exit = True
            _check_turns(seen, sid)
            assert await store.count_user_messages(sid) == 2


async def test_a_refused_session_stream_fails_the_send_not_the_connection_block(
    tmp_path: Path,
) -> None:
    """A session stream the server refuses (here: 404, its connection gone, as when a balancer
    sends it to another node after the first died) fails the `send` that opened it with
    `HttpRejected`, an `OSError` a reconnecting client catches; leaving the block raises
    nothing more (no exception group out of the reader's task)."""
    from acp_once.transports.http import HttpRejected, connect_http

    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {"protocolVersion": 2, "info": {"name": "t", "version": "1"}},
    }
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv:
            url = f"{srv.http}/acp"
            async with connect_http(url) as frames:
                await frames.send(json.dumps(init).encode())
                answer = await frames.receive()
                assert isinstance(answer, bytes) and json.loads(answer)["id"] == 0
                assert frames.connection_id is not None
                async with httpx.AsyncClient() as http:
                    gone = await http.delete(
                        url, headers={CONNECTION_ID_HEADER: frames.connection_id}
                    )
                assert gone.status_code in (200, 202, 204)
                request = {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "session/prompt",
                    "params": {"sessionId": "s-elsewhere", "prompt": []},
                }
                with pytest.raises(HttpRejected) as refused:
                    await frames.send(json.dumps(request).encode())
                assert refused.value.status == 404
                assert isinstance(refused.value, OSError)
                assert frames.ended


async def test_a_posts_202_is_one_write_on_a_kept_alive_connection_and_closes_when_asked(
    tmp_path: Path,
) -> None:
    """Under serve a POST's 202 is written at once (`send_accepted`): several POSTs on one
    kept-alive socket each get a whole 202 with no body, and `Connection: close` is honoured."""
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv, raw(srv) as conn:
            await conn.initialize()
            port = int(srv.http.rsplit(":", 1)[1])
            notification = json.dumps(
                {"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": 99}}
            ).encode()

            def post(close: bool) -> bytes:
                head = (
                    f"POST /acp HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Content-Type: application/json\r\n{CONNECTION_ID_HEADER}: {conn.cid}\r\n"
                    f"Content-Length: {len(notification)}\r\n"
                )
                if close:
                    head += "Connection: close\r\n"
                return head.encode() + b"\r\n" + notification

            async def answers(stream: anyio.abc.ByteStream, count: int) -> list[bytes]:
                data = b""
                while data.count(b"\r\n\r\n") < count:
                    data += await stream.receive()
                return data.split(b"\r\n\r\n")[:count]

            results: list[bool] = []

            def counted(scope: Any, headers: list[tuple[bytes, bytes]]) -> bool:
                results.append(http_protocol.send_accepted(scope, headers))
                return results[-1]

            with mock.patch("acp_once.server.app.send_accepted", counted):
                async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                    for _ in range(3):  # one after another on the same socket
                        await stream.send(post(close=False))
                        (head,) = await answers(stream, 1)
                        assert head.startswith(b"HTTP/1.1 202 Accepted\r\n"), head
                        assert b"content-length: 0" in head.lower()
                        assert b"date: " in head.lower()
                    await stream.send(post(close=True))
                    (head,) = await answers(stream, 1)
                    assert head.startswith(b"HTTP/1.1 202 Accepted\r\n")
                    assert b"connection: close" in head.lower()
                    with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                        while True:  # the server closes the socket
                            await stream.receive()
            assert results == [True] * 4  # the initialize's 200 is not a 202


async def test_a_202_goes_through_asgi_when_the_access_log_writes_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    results: list[bool] = []

    def counted(scope: Any, headers: list[tuple[bytes, bytes]]) -> bool:
        results.append(http_protocol.send_accepted(scope, headers))
        return results[-1]

    with anyio.fail_after(TIMEOUT), mock.patch("acp_once.server.app.send_accepted", counted):
        async with running(tmp_path) as srv, raw(srv) as conn:
            # uvicorn set its loggers' levels as the server started
            caplog.set_level(logging.INFO, logger="uvicorn.access")
            await conn.initialize()
            r = await conn.post({"jsonrpc": "2.0", "method": "$/cancel_request", "params": {}})
            assert r.status_code == 202 and r.content == b""
    assert results == [False]
    assert any("202" in record.getMessage() for record in caplog.records)
