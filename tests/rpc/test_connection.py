"""The JSON-RPC engine over in-memory streams, driven frame by frame from the peer's side."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import orjson
import pytest
from pydantic import BaseModel

from acp_once.protocol.errors import InvalidParams, SessionNotFound
from acp_once.rpc.connection import Connection, RequestContext
from acp_once.rpc.errors import ConnectionClosed
from acp_once.rpc.streams import MemoryFrameStream, memory_pair

pytestmark = pytest.mark.anyio

PairFactory = Callable[..., tuple[MemoryFrameStream, MemoryFrameStream]]


@pytest.fixture
async def pair() -> AsyncIterator[PairFactory]:
    """memory_pair(), with every stream closed at the end of the test."""
    made: list[MemoryFrameStream] = []

    def factory(buffer: int = 0) -> tuple[MemoryFrameStream, MemoryFrameStream]:
        a, b = memory_pair(buffer)
        made.extend((a, b))
        return a, b

    yield factory
    for stream in made:
        await stream.aclose()


class Params(BaseModel):
    n: int


async def recv(peer: MemoryFrameStream) -> dict[str, Any]:
    with anyio.fail_after(5):
        frame = await peer.receive()
    assert isinstance(frame, bytes)
    value = orjson.loads(frame)
    assert isinstance(value, dict)
    return value


async def send(peer: MemoryFrameStream, obj: object) -> None:
    with anyio.fail_after(5):
        await peer.send(orjson.dumps(obj))


async def test_inbound_request_results_and_error_boundary(
    caplog: pytest.LogCaptureFixture, pair: PairFactory
) -> None:
    async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        if method == "add":
            p = Params.model_validate(params)
            return {"n": p.n + 1}
        if method == "missing":
            raise SessionNotFound("s-1")
        raise RuntimeError("secret-internal-detail")

    ours, peer = pair()
    async with Connection(ours, on_request=handler):
        await send(peer, {"jsonrpc": "2.0", "id": 1, "method": "add", "params": {"n": 41}})
        assert await recv(peer) == {"jsonrpc": "2.0", "id": 1, "result": {"n": 42}}
        await send(peer, {"jsonrpc": "2.0", "id": "b", "method": "add", "params": {"n": "PRIVATE"}})
        bad = await recv(peer)
        assert bad["id"] == "b" and bad["error"]["code"] == InvalidParams.code
        assert "PRIVATE" not in orjson.dumps(bad).decode()
        assert "pydantic" not in bad["error"]["message"]
        await send(peer, {"jsonrpc": "2.0", "id": 3, "method": "missing"})
        assert (await recv(peer))["error"] == {
            "code": -32002,
            "message": "Session not found",
            "data": {"sessionId": "s-1"},
        }
        with caplog.at_level(logging.ERROR, logger="acp_once.rpc"):
            await send(peer, {"jsonrpc": "2.0", "id": 4, "method": "boom"})
            internal = await recv(peer)
        assert internal["error"] == {"code": -32603, "message": "Internal error"}
        assert "secret-internal-detail" in caplog.text  # logged, not sent


async def test_cancel_request_answers_exactly_once(pair: PairFactory) -> None:
    started = anyio.Event()

    async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        started.set()
        await anyio.sleep_forever()

    ours, peer = pair()
    async with Connection(ours, on_request=handler):
        await send(peer, {"jsonrpc": "2.0", "id": 9, "method": "slow"})
        with anyio.fail_after(5):
            await started.wait()
        await send(
            peer, {"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": 9}}
        )
        answer = await recv(peer)
        assert answer == {
            "jsonrpc": "2.0",
            "id": 9,
            "error": {"code": -32800, "message": "Request cancelled"},
        }
        # repeated and unknown cancels are ignored; the next answer is for the next request
        await send(
            peer, {"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": 9}}
        )
        await send(
            peer, {"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": 77}}
        )
        await send(peer, {"jsonrpc": "2.0", "id": 10, "method": "unknown-to-test", "params": {}})
        started = anyio.Event()
        with anyio.fail_after(5):
            await started.wait()
        await send(
            peer, {"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": 10}}
        )
        assert (await recv(peer))["id"] == 10


async def test_handler_can_take_over_cancellation(pair: PairFactory) -> None:
    """A handler that registered on_cancel decides the answer (an inserted prompt succeeds)."""
    decided = anyio.Event()

    async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        ctx.on_cancel(decided.set)
        await decided.wait()
        return {"messageId": "m-1"}

    ours, peer = pair()
    async with Connection(ours, on_request=handler):
        await send(peer, {"jsonrpc": "2.0", "id": 1, "method": "session/prompt"})
        await send(
            peer, {"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": 1}}
        )
        assert await recv(peer) == {"jsonrpc": "2.0", "id": 1, "result": {"messageId": "m-1"}}


async def test_duplicate_inflight_id_is_refused_and_original_still_answered(
    pair: PairFactory,
) -> None:
    release = anyio.Event()

    async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        await release.wait()
        return "done"

    ours, peer = pair()
    async with Connection(ours, on_request=handler):
        await send(peer, {"jsonrpc": "2.0", "id": 5, "method": "m"})
        await send(peer, {"jsonrpc": "2.0", "id": 5, "method": "m"})
        dup = await recv(peer)
        assert dup["id"] is None and dup["error"]["code"] == -32600
        release.set()
        assert await recv(peer) == {"jsonrpc": "2.0", "id": 5, "result": "done"}


async def test_outbound_requests_and_peer_errors(pair: PairFactory) -> None:
    ours, peer = pair()
    async with Connection(ours) as conn, anyio.create_task_group() as tg:
        results: dict[str, Any] = {}

        async def call(name: str) -> None:
            try:
                results[name] = await conn.request("m", {"who": name})
            except Exception as exc:
                results[name] = exc

        tg.start_soon(call, "a")
        tg.start_soon(call, "b")
        first, second = await recv(peer), await recv(peer)
        by_who = {first["params"]["who"]: first, second["params"]["who"]: second}
        assert by_who["a"]["id"] != by_who["b"]["id"]
        await send(
            peer,
            {"jsonrpc": "2.0", "id": by_who["b"]["id"], "error": {"code": -32602, "message": "no"}},
        )
        await send(peer, {"jsonrpc": "2.0", "id": by_who["a"]["id"], "result": {"ok": True}})
    assert results["a"] == {"ok": True}
    assert isinstance(results["b"], InvalidParams)


async def test_pending_requests_fail_with_connection_closed_when_peer_leaves(
    pair: PairFactory,
) -> None:
    ours, peer = pair(1)
    async with Connection(ours) as conn:
        call = await conn.start_request("m", None)
        await recv(peer)
        await peer.aclose()
        with anyio.fail_after(5), pytest.raises(ConnectionClosed):
            await call.result()
        assert conn.closed
        with pytest.raises(ConnectionClosed):
            await conn.request("again")


async def test_caller_cancellation_sends_cancel_request(pair: PairFactory) -> None:
    ours, peer = pair(4)
    async with Connection(ours) as conn:
        async with anyio.create_task_group() as tg:
            tg.start_soon(conn.request, "slow")
            sent = await recv(peer)
            tg.cancel_scope.cancel()
        cancel = await recv(peer)
        assert cancel["method"] == "$/cancel_request"
        assert cancel["params"] == {"requestId": sent["id"]}


async def test_inflight_bound_applies_backpressure(pair: PairFactory) -> None:
    gate = anyio.Event()
    running = 0
    peak = 0

    async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await gate.wait()
        running -= 1
        return None

    ours, peer = pair(100)
    async with Connection(ours, on_request=handler, max_inflight=3):
        for i in range(10):
            await send(peer, {"jsonrpc": "2.0", "id": i, "method": "m"})
        with anyio.fail_after(5):
            while running < 3:
                await anyio.wait_all_tasks_blocked()
        assert peak == 3
        gate.set()
        ids = sorted([(await recv(peer))["id"] for _ in range(10)])
        assert ids == list(range(10))
        assert peak == 3


async def test_gate_decides_which_requests_it_follows(pair: PairFactory) -> None:
    """The engine knows no method names: a gate for any method gets its outcome reported."""
    outcomes: list[tuple[str, bool]] = []

    class OpenGate:
        def admit_request(self, method: str) -> Callable[[bool], None] | None:
            if method == "locked":
                raise InvalidParams("refused by the gate")
            if method.startswith("watched/"):
                return lambda ok: outcomes.append((method, ok))
            return None

        def admit_notification(self, method: str) -> bool:
            return True

    async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        if method == "watched/fail":
            raise SessionNotFound("s-1")
        return {}

    ours, peer = pair()
    async with Connection(ours, on_request=handler, gate=OpenGate()):
        await send(peer, {"jsonrpc": "2.0", "id": 1, "method": "locked"})
        assert (await recv(peer))["error"]["message"] == "refused by the gate"
        for id, method in enumerate(("watched/ok", "initialize", "watched/fail"), start=2):
            await send(peer, {"jsonrpc": "2.0", "id": id, "method": method})
            assert (await recv(peer))["id"] == id
    assert outcomes == [("watched/ok", True), ("watched/fail", False)]


async def test_after_the_peers_last_frame_its_requests_are_still_answered(
    pair: PairFactory,
) -> None:
    """A stream whose peer reads after it stopped sending (stdin closed, stdout open)."""
    started, release = anyio.Event(), anyio.Event()

    async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        started.set()
        await release.wait()
        return {"done": method}

    ours, peer = pair(16)
    ours.writable_after_eof = True  # type: ignore[attr-defined]
    with anyio.fail_after(5):
        async with Connection(ours, on_request=handler) as conn:
            asked = await conn.start_request("ours/pending")
            await send(peer, {"jsonrpc": "2.0", "id": 1, "method": "slow"})
            await started.wait()
            await peer._send.aclose()  # the peer's last frame
            with pytest.raises(ConnectionClosed):
                await asked.result()  # nobody can answer ours any more
            with pytest.raises(ConnectionClosed):
                await conn.request("ours/late")
            assert not conn.closed
            release.set()
            assert (await recv(peer))["method"] == "ours/pending"  # sent before the end
            assert await recv(peer) == {"jsonrpc": "2.0", "id": 1, "result": {"done": "slow"}}
            await conn.wait_closed()
