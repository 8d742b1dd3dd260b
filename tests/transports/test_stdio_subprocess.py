"""A client spawns a tiny agent written with the package and talks to it over real pipes."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from unittest.mock import ANY

import anyio
import orjson
import pytest

from acp_once.client import Client, ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.protocol.errors import (
    INVALID_REQUEST,
    PARSE_ERROR,
    REQUEST_CANCELLED,
    MethodNotFound,
    RequestCancelled,
)
from acp_once.rpc.connection import BatchEntry
from acp_once.rpc.errors import ConnectionClosed
from acp_once.transports.stdio import AgentProcess, spawn
from tests.helpers import initialize_request

pytestmark = pytest.mark.anyio

TINY_AGENT = Path(__file__).parents[1] / "agents" / "tiny_agent.py"
TIMEOUT = 20


class RecordingClient(Client):
    def __init__(self) -> None:
        self.updates: list[s.UpdateSessionNotification] = []
        self.permission_asked = anyio.Event()

    async def session_update(self, params: s.UpdateSessionNotification) -> None:
        self.updates.append(params)

    async def request_permission(
        self, params: s.RequestPermissionRequest, connection: ClientSideConnection
    ) -> s.RequestPermissionResponse:
        self.permission_asked.set()
        return s.RequestPermissionResponse.model_validate(
            {"outcome": {"outcome": "selected", "optionId": "yes"}}
        )


@asynccontextmanager
async def tiny_agent(
    client: Client, *args: str
) -> AsyncIterator[tuple[ClientSideConnection, AgentProcess]]:
    async with (
        spawn([sys.executable, str(TINY_AGENT), *args]) as proc,
        ClientSideConnection(client, proc.frames) as conn,
    ):
        yield conn, proc


def _text(notification: s.UpdateSessionNotification) -> str:
    update = notification.update
    assert isinstance(update, s.SessionUpdateAgentMessage)
    assert update.content is not None
    block = update.content[0]
    assert isinstance(block, s.ContentBlockText)
    return block.text


def _prompt(session_id: str, text: str) -> s.PromptRequest:
    return s.PromptRequest.model_validate(
        {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}
    )


async def _ready(conn: ClientSideConnection) -> str:
    init = await conn.agent.initialize(initialize_request())
    assert init.protocol_version == 2
    new = await conn.agent.new_session(s.NewSessionRequest(cwd="/tmp"))
    return new.session_id


async def test_requests_both_ways_over_real_pipes() -> None:
    client = RecordingClient()
    with anyio.fail_after(TIMEOUT):
        async with tiny_agent(client) as (conn, _):
            session_id = await _ready(conn)
            answer = await conn.agent.prompt(_prompt(session_id, "hello"))
            assert answer.message_id.startswith("msg_")
            # agent -> client request inside a client -> agent request
            answer2 = await conn.agent.prompt(_prompt(session_id, "permission"))
            assert client.permission_asked.is_set()
            assert answer2.message_id != answer.message_id
            texts = [_text(u) for u in client.updates]
            assert texts == ["hello", "permission:yes"]


async def test_requests_before_initialize_are_refused_then_initialize_works() -> None:
    with anyio.fail_after(TIMEOUT):
        async with tiny_agent(Client()) as (conn, _):
            with pytest.raises(Exception) as info:
                await conn.agent.new_session(s.NewSessionRequest(cwd="/tmp"))
            assert getattr(info.value, "code", None) == INVALID_REQUEST
            session_id = await _ready(conn)
            assert session_id.startswith("sess_")
            # initialize after another request: -32600
            with pytest.raises(Exception) as again:
                await conn.agent.initialize(initialize_request())
            assert getattr(again.value, "code", None) == INVALID_REQUEST


async def test_a_batch_line_both_ways_over_real_pipes() -> None:
    # D21: our client sends one line holding an array; the agent answers with one array line
    with anyio.fail_after(TIMEOUT):
        async with tiny_agent(Client()) as (conn, _):
            session_id = await _ready(conn)
            calls = await conn.rpc.start_batch(
                [
                    BatchEntry("_echo", {"n": 1}),
                    BatchEntry("session/cancel", {"sessionId": session_id}, notification=True),
                    BatchEntry("no/such_method", {}),
                    BatchEntry("_echo", {"n": 2}),
                ]
            )
            assert await calls[0].result(TIMEOUT) == {"n": 1}
            with pytest.raises(Exception) as missing:
                await calls[1].result(TIMEOUT)
            assert getattr(missing.value, "code", None) == MethodNotFound.code
            assert await calls[2].result(TIMEOUT) == {"n": 2}
            # the connection goes on as before
            assert await conn.agent.ext_request("_echo", {"after": 1}) == {"after": 1}


async def test_a_raw_batch_line_gets_one_array_line() -> None:
    with anyio.fail_after(TIMEOUT):
        async with spawn([sys.executable, str(TINY_AGENT)]) as proc:
            init = {"protocolVersion": 2, "info": {"name": "raw", "version": "1"}}
            initialize = {"jsonrpc": "2.0", "id": "i", "method": "initialize", "params": init}
            await proc.frames.send(orjson.dumps([initialize]))
            reply = orjson.loads(await proc.frames.receive())  # type: ignore[arg-type]
            assert [a["id"] for a in reply] == ["i"] and reply[0]["result"]["protocolVersion"] == 2
            echo = {"jsonrpc": "2.0", "method": "_echo", "params": {"k": 1}}
            await proc.frames.send(
                orjson.dumps([{**echo, "id": 1}, echo, {**echo, "id": "two"}, {"x": 1}])
            )
            await proc.frames.send(orjson.dumps([echo]))  # notifications only: nothing back
            await proc.frames.send(b"[]")
            # the empty array's answer may come first: the reader answers it at once
            frames = [orjson.loads(await proc.frames.receive()) for _ in range(2)]  # type: ignore[arg-type]
            [reply] = [f for f in frames if isinstance(f, list)]
            [empty] = [f for f in frames if isinstance(f, dict)]
            assert sorted(map(str, (a["id"] for a in reply))) == ["1", "None", "two"]
            assert empty == {
                "jsonrpc": "2.0",
                "id": None,
                "error": {"code": INVALID_REQUEST, "message": ANY},
            }


async def test_ten_mebibyte_messages_both_directions() -> None:
    client = RecordingClient()
    size = 10 * 1024 * 1024
    with anyio.fail_after(TIMEOUT * 3):
        async with tiny_agent(client) as (conn, _):
            session_id = await _ready(conn)
            echoed = await conn.agent.ext_request("_echo", {"blob": "y" * size})
            assert echoed == {"blob": "y" * size}
            await conn.agent.prompt(_prompt(session_id, f"big:{size}"))
            text = _text(client.updates[-1])
            assert len(text) == size


async def test_malformed_line_gets_parse_error_and_agent_keeps_serving() -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            spawn([sys.executable, str(TINY_AGENT)]) as proc,
        ):
            await proc.frames.send(b'{"jsonrpc": "2.0", "id": 1, "method": ')
            reply = await proc.frames.receive()
            assert isinstance(reply, bytes)
            assert b'"code":' + str(PARSE_ERROR).encode() in reply
            assert b'"id":null' in reply
            # a batch of two invalid entries: one array, an error with id null for each (D21)
            await proc.frames.send(b"[1, 2]")
            batch_reply = await proc.frames.receive()
            assert isinstance(batch_reply, bytes)
            assert orjson.loads(batch_reply) == [
                {"jsonrpc": "2.0", "id": None, "error": error}
                for error in [{"code": INVALID_REQUEST, "message": ANY}] * 2
            ]
            # still serving
            await proc.frames.send(
                b'{"jsonrpc":"2.0","id":7,"method":"initialize","params":'
                b'{"protocolVersion":2,"info":{"name":"raw","version":"1"}}}'
            )
            ok = await proc.frames.receive()
            assert isinstance(ok, bytes)
            assert b'"id":7' in ok and b'"protocolVersion":2' in ok


async def test_oversized_frame_is_answered_and_connection_lives_on() -> None:
    with anyio.fail_after(TIMEOUT):
        async with tiny_agent(Client(), "4096") as (conn, _):
            await _ready(conn)
            with pytest.raises(Exception) as info:
                await conn.agent.ext_request("_echo", {"blob": "z" * 10_000})
            assert getattr(info.value, "code", None) == INVALID_REQUEST
            assert await conn.agent.ext_request("_echo", {"small": 1}) == {"small": 1}


async def test_cancel_request_gets_exactly_one_answer() -> None:
    with anyio.fail_after(TIMEOUT):
        async with tiny_agent(Client()) as (conn, _):
            session_id = await _ready(conn)
            call = await conn.agent.start_prompt(_prompt(session_id, "wait"))
            await call.cancel()
            with pytest.raises(RequestCancelled) as info:
                await call.result()
            assert info.value.code == REQUEST_CANCELLED
            # a second cancel for an answered id is ignored: no second answer, still serving
            await conn.rpc.notify("$/cancel_request", {"requestId": call.id})
            await conn.rpc.notify("$/cancel_request", {"requestId": 987654})
            assert await conn.agent.ext_request("_echo", {"after": True}) == {"after": True}
            with pytest.raises(MethodNotFound):
                await conn.agent.ext_request("_nope")


async def test_agent_dying_with_request_pending_fails_with_transport_error() -> None:
    with anyio.fail_after(TIMEOUT):
        async with tiny_agent(Client()) as (conn, proc):
            session_id = await _ready(conn)
            with pytest.raises(ConnectionClosed):
                await conn.agent.prompt(_prompt(session_id, "die"))
            await proc.process.wait()
            assert proc.returncode == 3
            with pytest.raises(ConnectionClosed):
                await conn.agent.ext_request("_echo", {})
