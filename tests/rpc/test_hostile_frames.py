"""The engine over odd JSON: exactly one answer per request, and the connection lives on."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acp_once.protocol import jsonrpc
from acp_once.protocol.errors import PARSE_ERROR, InvalidParams
from acp_once.protocol.initialization import InitializeGate
from acp_once.rpc.connection import Connection, RequestContext
from acp_once.rpc.streams import memory_pair
from tests.protocol.test_encoding import _TEXT, DEPTHS, IDS, ODD_VALUES

TIMEOUT = 10


async def echo(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
    if method.startswith("fail"):
        raise InvalidParams(f"refused: {method}", data=params)  # the params echoed as data
    return params


def request(id: Any, method: str, params_text: str) -> bytes:
    head = json.dumps({"jsonrpc": "2.0", "id": id, "method": method}, ensure_ascii=True)[:-1]
    return f'{head},"params":{{"v":{params_text}}}}}'.encode("ascii")


PARAMS = ODD_VALUES.map(lambda v: json.dumps(v, ensure_ascii=True)) | DEPTHS.map(
    lambda n: "[" * n + "]" * n
)
METHODS = st.sampled_from(["initialize", "echo", "fail"]) | _TEXT


def expected_id(id: Any, frame: bytes) -> Any:
    msg = jsonrpc.decode(frame)
    return None if isinstance(msg, jsonrpc.Invalid) and msg.code == PARSE_ERROR else id


async def exchange(frames: list[tuple[Any, bytes]]) -> None:
    ours, peer = memory_pair(64)
    try:
        with anyio.fail_after(TIMEOUT):
            async with Connection(ours, on_request=echo, gate=InitializeGate()):
                for _, frame in frames:
                    await peer.send(frame)
                ids = []
                for _ in frames:
                    raw = await peer.receive()
                    assert isinstance(raw, bytes)
                    ids.append(repr(json.loads(raw)["id"]))
                # exactly one answer per request, with its id (null for one too deep to parse)
                assert sorted(ids) == sorted(repr(expected_id(id, frame)) for id, frame in frames)
                # and the connection still serves
                await peer.send(b'{"jsonrpc":"2.0","id":"last","method":"initialize"}')
                last = await peer.receive()
                assert isinstance(last, bytes) and json.loads(last)["id"] == "last"
    finally:
        await peer.aclose()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(IDS, METHODS, PARAMS), min_size=1, max_size=6, unique_by=lambda r: r[0]))
def test_odd_json_requests_get_one_answer_each_and_the_connection_lives(
    requests: list[tuple[Any, str, str]],
) -> None:
    frames = [(id, request(id, method, params)) for id, method, params in requests]
    anyio.run(exchange, frames)


@pytest.mark.parametrize("depth", [300, 1_000, 1_030, 5_000])
def test_deep_params_are_answered(depth: int) -> None:
    text = "[" * depth + "]" * depth
    anyio.run(
        exchange, [(1, request(1, "initialize", text)), ("\ud800", request("\ud800", "fail", text))]
    )
