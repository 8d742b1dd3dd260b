"""What an idle WebSocket connection of `acp-once serve` still holds, over real sockets: the
handshake's headers are dropped once the upgrade is accepted, and the connection still serves
every method, cancellation and close; the direct channel's inbox and writable flag."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import pytest
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from acp_once.client import Client, ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.protocol.errors import AcpError
from acp_once.server.websocket_protocol import _PAUSE_AT, DirectChannel, _Writable
from acp_once.transports.websocket import (
    CLOSE_GOING_AWAY,
    DirectWebSocketFrames,
    WebSocketRejected,
    connect_websocket,
)
from tests.helpers import UpdateRecorder, initialize_request
from tests.remote.harness import Running, running

pytestmark = pytest.mark.anyio

TIMEOUT = 30


def _prompt(sid: str, text: str, key: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}
    if key is not None:
        params["idempotencyKey"] = key
    return params


async def test_after_the_handshake_is_dropped_every_method_is_served(tmp_path: Path) -> None:
    recorder = UpdateRecorder()
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, token="secret-token") as srv:
            await _serve_every_method(srv, recorder)


async def _serve_every_method(srv: Running, recorder: UpdateRecorder) -> None:
    async with (
        connect_websocket(srv.url, token="secret-token") as frames,
        ClientSideConnection(recorder, frames) as conn,
    ):
        await conn.agent.initialize(initialize_request("t"))
        (served,) = srv.acp.connections.values()
        assert isinstance(served, DirectWebSocketFrames)
        # the upgrade request's headers (the token among them) and the 101's are gone
        assert served.websocket.scope["headers"] == []
        protocol: Any = served.channel._protocol  # type: ignore[attr-defined]
        assert len(protocol.request.headers) == 0
        assert len(protocol.response.headers) == 0
        # uvicorn's attributes are in slots (the guard adds one hook of its own)
        assert set(vars(protocol)) <= {"connection_lost"}

        sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id
        first = await conn.rpc.request("session/prompt", _prompt(sid, "one", "k-1"))
        again = await conn.rpc.request("session/prompt", _prompt(sid, "one", "k-1"))
        assert again["messageId"] == first["messageId"]  # the key still dedups
        await recorder.wait_for(
            lambda ups: sum(u.get("stopReason") == "end_turn" for u in ups) >= 1
        )
        listed = await conn.rpc.request("session/list", {})
        assert sid in [entry["sessionId"] for entry in listed["sessions"]]
        # a long turn, cancelled by session/cancel: it ends, the connection goes on
        await conn.rpc.request("session/prompt", _prompt(sid, "wait [work:30]", None))
        await conn.rpc.notify("session/cancel", {"sessionId": sid})
        await recorder.wait_for(lambda ups: any(u.get("stopReason") == "cancelled" for u in ups))
        with pytest.raises(AcpError):
            await conn.rpc.request("no/such/method", {})
        assert await srv.agent.store.count_user_messages(sid) == 2

        # closed by the server (a shutdown's drain): the client sees 1001, the session
        # is resumed on a new connection
        assert await srv.acp.close_all() == 1
        await conn.wait_closed()
    assert frames.close_code == CLOSE_GOING_AWAY
    async with (
        connect_websocket(srv.url, token="secret-token") as frames2,
        ClientSideConnection(Client(), frames2) as conn2,
    ):
        await conn2.agent.initialize(initialize_request("t"))
        await conn2.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/w"))


async def test_other_paths_and_added_middleware_still_go_through_starlette(
    tmp_path: Path,
) -> None:
    seen: list[str] = []

    class Spy:
        def __init__(self, app: ASGIApp) -> None:
            self.app = app

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            seen.append(scope["type"])
            await self.app(scope, receive, send)

    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv:
            with pytest.raises(WebSocketRejected) as refused:
                async with connect_websocket(srv.url.replace("/acp", "/elsewhere")):
                    pass
            assert refused.value.status == 404
            async with httpx.AsyncClient() as http:
                health = await http.get(f"{srv.http}/healthz")
            assert health.status_code == 200
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path / "b") as srv:
            app: Any = srv.server.config.app
            app.user_middleware.insert(0, Middleware(Spy))
            app.middleware_stack = None  # rebuilt on the next call, with the spy
            async with (
                connect_websocket(srv.url) as frames,
                ClientSideConnection(Client(), frames) as conn,
            ):
                await conn.agent.initialize(initialize_request("t"))
            assert seen.count("websocket") == 1


class _Transport:
    def __init__(self) -> None:
        self.paused = 0
        self.resumed = 0

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self) -> None:
        self.resumed += 1

    def is_closing(self) -> bool:
        return False


async def test_the_inbox_keeps_order_and_lets_go_of_what_was_read() -> None:
    transport = _Transport()
    protocol: Any = SimpleNamespace(
        loop=asyncio.get_running_loop(), transport=transport, read_paused=False
    )
    channel = DirectChannel(protocol)
    sent = [f"m{i}".encode() for i in range(400)]
    received: list[bytes] = []
    for message in sent[:100]:
        channel._push(message)
    for message in sent[100:]:  # reading keeps 100 behind: the inbox never empties
        channel._push(message)
        received.append(await channel.receive())
        assert len(channel._inbox) <= 2 * 100 + 1  # what was read is let go
    assert len(channel._inbox) - channel._head == 100
    while len(received) < 400:
        received.append(await channel.receive())
    assert received == sent
    assert channel._inbox == [] and channel.queued == 0
    # reading pauses once _PAUSE_AT bytes wait, and resumes when half is read
    big = b"x" * (_PAUSE_AT // 4)
    for _ in range(4):
        channel._push(big)
    assert protocol.read_paused and transport.paused == 1
    await channel.receive()
    await channel.receive()
    await channel.receive()
    assert not protocol.read_paused and transport.resumed == 1
    channel._end(1000)
    await channel.receive()
    with pytest.raises(anyio.EndOfStream):
        await channel.receive()


async def test_the_writable_flag_wakes_its_waiters() -> None:
    flag = _Writable(asyncio.get_running_loop())
    assert flag.is_set()
    await flag.wait()  # set: no wait
    flag.clear()
    woken: list[int] = []

    async def waiter(n: int) -> None:
        await flag.wait()
        woken.append(n)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, 1)
            tg.start_soon(waiter, 2)
            await anyio.wait_all_tasks_blocked()
            assert woken == []
            flag.set()
        assert sorted(woken) == [1, 2]
        # a cancelled waiter leaves nothing behind
        flag.clear()
        with anyio.move_on_after(0.01):
            await flag.wait()
        assert not flag._waiters


def _ping_in_flight(protocol: Any) -> bytes | None:
    payload: bytes | None = protocol.pending_ping_payload
    return payload


async def test_a_peer_heard_from_is_not_pinged_a_silent_one_is(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path) as srv,
            connect_websocket(srv.url) as frames,
            ClientSideConnection(Client(), frames) as conn,
        ):
            await conn.agent.initialize(initialize_request("t"))
            (served,) = srv.acp.connections.values()
            assert isinstance(served, DirectWebSocketFrames)
            protocol: Any = served.channel._protocol  # type: ignore[attr-defined]
            assert protocol.heard  # the initialize arrived
            if protocol.ping_timer is not None:
                protocol.ping_timer.cancel()
            protocol.send_keepalive_ping()  # due: heard from, so no ping, the next one planned
            assert _ping_in_flight(protocol) is None
            assert protocol.ping_timer is not None and not protocol.heard
            protocol.ping_timer.cancel()
            protocol.send_keepalive_ping()  # due again, nothing heard since: a ping
            assert _ping_in_flight(protocol) is not None
            # the client answers it at once (websockets does), before it reads the answer
            # written after the ping: so the pong is in before the next request
            await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))
            await conn.rpc.request("session/list", {})
            assert _ping_in_flight(protocol) is None  # answered: the keepalive goes on
            assert protocol.ping_timer is not None


def test_text_frames_are_encoded_as_websockets_encodes_them() -> None:
    """The channel builds a server's text frames itself (header and payload); websockets,
    which it replaces on that path, must produce the same bytes for every header size, and a
    control frame websockets queued (a pong) goes out first."""
    from websockets.extensions.permessage_deflate import PerMessageDeflate
    from websockets.frames import Frame, Opcode
    from websockets.protocol import Protocol, Side, State

    def server() -> Protocol:
        conn = Protocol(Side.SERVER)
        conn.state = State.OPEN
        return conn

    sizes = [0, 1, 125, 126, 127, 65535, 65536, 70000]
    frames = [bytes([65 + i]) * size for i, size in enumerate(sizes)]
    reference = server()
    for frame in frames:
        reference.send_text(frame)
    expected = b"".join(reference.data_to_send())

    conn = server()
    channel = DirectChannel(SimpleNamespace(conn=conn, close_sent=False))  # type: ignore[arg-type]
    assert channel.encode(frames) == expected
    assert channel.encode([]) == b""

    conn.send_pong(b"p")  # queued by websockets, not yet written
    pong = Frame(Opcode.PONG, b"p").serialize(mask=False)
    assert channel.encode([b"x"]) == pong + b"\x81\x01x"
    assert conn.data_to_send() == []  # taken with the frames, not written twice

    # an extension transforms the payload: websockets' own path, as negotiated
    deflating = server()
    deflating.extensions = [PerMessageDeflate(False, False, 15, 15)]
    deflated = DirectChannel(SimpleNamespace(conn=deflating, close_sent=False))  # type: ignore[arg-type]
    assert deflated.encode([b"hello hello hello"])[:1] == b"\xc1"  # FIN, RSV1 (compressed), text

    # closing: nothing more is written
    conn.state = State.CLOSING
    with pytest.raises(anyio.ClosedResourceError):
        channel.encode([b"late"])
