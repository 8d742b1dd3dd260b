"""Batches over the network (D21, D40, D43): WebSocket carries them both ways; Streamable HTTP
refuses them. The reference agent on SQLite, served by uvicorn on loopback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from acp_once.client import Client, ClientSideConnection
from acp_once.protocol.errors import INVALID_REQUEST
from acp_once.rpc.connection import BatchEntry
from acp_once.rpc.errors import BatchRefused
from acp_once.transports.http import connect_http
from acp_once.transports.websocket import ClientWebSocketFrames, connect_websocket
from tests.helpers import initialize_request
from tests.remote.harness import running
from tests.remote.test_websocket import TIMEOUT, new_session, prompt_params, session_conn

pytestmark = pytest.mark.anyio


async def _next_answer(frames: ClientWebSocketFrames) -> Any:
    """The next frame that is not a notification of the agent's (a turn's updates)."""
    while True:
        frame = await frames.receive()
        assert isinstance(frame, bytes)
        value = json.loads(frame)
        if isinstance(value, dict) and "method" in value and "id" not in value:
            continue
        return value


async def test_a_websocket_batch_with_two_prompts_of_one_key_inserts_once(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv:
            async with session_conn(srv.url) as (_, conn):
                sid = await new_session(conn)
            async with connect_websocket(srv.url) as frames:
                init = initialize_request("raw").model_dump(mode="json", by_alias=True)
                await frames.send(
                    json.dumps(
                        {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init}
                    ).encode()
                )
                assert (await _next_answer(frames))["id"] == 0
                resume = {"sessionId": sid, "cwd": "/w"}
                same = prompt_params(sid, "twice in one batch", key="batch-key")
                batch = [
                    {"jsonrpc": "2.0", "id": 1, "method": "session/resume", "params": resume},
                    {"jsonrpc": "2.0", "id": 2, "method": "session/list", "params": {}},
                    {"jsonrpc": "2.0", "method": "$/no_such_notification", "params": {}},
                    17,
                ]
                await frames.send(json.dumps(batch).encode())
                reply = await _next_answer(frames)
                assert isinstance(reply, list)  # one text frame holds the whole reply
                answers = {str(a["id"]): a for a in reply}
                assert answers.keys() == {"1", "2", "None"}
                assert "result" in answers["1"] and "sessions" in answers["2"]["result"]
                assert answers["None"]["error"]["code"] == INVALID_REQUEST
                # each keyed prompt of a batch follows the key rules on its own
                prompts = [
                    {"jsonrpc": "2.0", "id": n, "method": "session/prompt", "params": same}
                    for n in (3, 4)
                ]
                await frames.send(json.dumps(prompts).encode())
                reply = await _next_answer(frames)
                assert sorted(a["id"] for a in reply) == [3, 4]
                ids = {a["result"]["messageId"] for a in reply}
                assert len(ids) == 1, reply
            assert await srv.agent.store.count_user_messages(sid) == 1


async def test_our_client_sends_a_batch_over_websocket(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv, session_conn(srv.url) as (_, conn):
            sid = await new_session(conn)
            calls = await conn.rpc.start_batch(
                [
                    BatchEntry("session/prompt", prompt_params(sid, "one", key="k-one")),
                    BatchEntry("session/list", {}),
                    BatchEntry("session/prompt", prompt_params(sid, "two", key="k-two")),
                ]
            )
            first, listed, second = [await call.result(TIMEOUT) for call in calls]
            assert first["messageId"] != second["messageId"]
            assert [s["sessionId"] for s in listed["sessions"]] == [sid]
            assert await srv.agent.store.count_user_messages(sid) == 2


async def test_streamable_http_refuses_a_batch_post_and_our_client_sends_none(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path) as srv:
            url = f"{srv.http}/acp"
            async with httpx.AsyncClient(timeout=TIMEOUT) as http:
                init = initialize_request("raw").model_dump(mode="json", by_alias=True)
                batch = [{"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": init}]
                refused = await http.post(url, json=batch)
                assert refused.status_code == 400
                assert refused.json() == {"error": "batches are not supported"}
                assert not srv.acp.http_connections  # nothing was processed
            async with (
                connect_http(url) as frames,
                ClientSideConnection(Client(), frames) as conn,
            ):
                await conn.agent.initialize(initialize_request("t"))
                with pytest.raises(BatchRefused, match="send each message alone"):
                    await conn.rpc.start_batch([BatchEntry("session/list", {})])
                # nothing went out: the connection serves on
                listed = await conn.rpc.request("session/list", {})
                assert listed["sessions"] == []
