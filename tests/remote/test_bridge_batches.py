"""Batches through the bridge (D44): split into lone messages for the child, the answers joined
into one array for the client. `serve_bridge` in this process, the tiny test agent as its
child, a real WebSocket on loopback."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from acp_once.protocol.errors import INVALID_REQUEST, METHOD_NOT_FOUND, AcpError
from acp_once.rpc.connection import BatchEntry
from tests.cluster.harness import until
from tests.remote.test_bridge import connection, in_process, tiny
from tests.remote.test_websocket import TIMEOUT

pytestmark = pytest.mark.anyio


def _arrays(received: list[bytes]) -> list[list[Any]]:
    return [json.loads(f) for f in received if f.startswith(b"[")]


async def test_a_batch_is_split_per_hop_and_answered_in_one_array() -> None:
    with anyio.fail_after(TIMEOUT):
        async with in_process(tiny()) as (bridge, url), connection("ws", url) as (frames, conn):
            calls = await conn.rpc.start_batch(
                [
                    BatchEntry("_echo", {"n": 1}),
                    BatchEntry("session/cancel", {"sessionId": "sess_x"}, notification=True),
                    BatchEntry("no/such_method", {}),
                    BatchEntry("_echo", {"n": 2}),
                ]
            )
            assert await calls[0].result(TIMEOUT) == {"n": 1}
            with pytest.raises(AcpError) as missing:
                await calls[1].result(TIMEOUT)
            assert missing.value.code == METHOD_NOT_FOUND
            assert await calls[2].result(TIMEOUT) == {"n": 2}
            [reply] = _arrays(frames.received)  # the three answers came in one frame
            assert sorted(a["id"] for a in reply) == sorted(c.id for c in calls)

            # entries the bridge answers itself join the array too: an id used twice in one
            # batch (D19), an entry that is no message, and the initialize rules per entry
            raw = [
                {"jsonrpc": "2.0", "id": "d", "method": "_echo", "params": {"d": 1}},
                {"jsonrpc": "2.0", "id": "d", "method": "_echo", "params": {"d": 2}},
                17,
                {"jsonrpc": "2.0", "id": "i", "method": "initialize", "params": {}},
                {"jsonrpc": "2.0", "method": "$/nothing", "params": {}},
            ]
            await frames.send(json.dumps(raw).encode())
            await until(lambda: len(_arrays(frames.received)) == 2)
            second = _arrays(frames.received)[1]
            assert len(second) == 4
            by_id: dict[Any, list[dict[str, Any]]] = {}
            for answer in second:
                by_id.setdefault(answer["id"], []).append(answer)
            assert [a["result"] for a in by_id["d"]] == [{"d": 1}]
            assert by_id["i"][0]["error"]["code"] == INVALID_REQUEST  # after other requests
            assert [a["error"]["code"] for a in by_id[None]] == [INVALID_REQUEST] * 2

            # a notification-only batch gets nothing; the connection serves on
            await frames.send(json.dumps([raw[-1]]).encode())
            assert await conn.rpc.request("_echo", {"after": 1}, timeout=10) == {"after": 1}
            assert len(_arrays(frames.received)) == 2
            assert bridge.restarts == 0
