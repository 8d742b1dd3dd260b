"""JSON-RPC batches in the engine (D21, R70-R73, D40-D42), over in-memory streams."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import orjson
import pytest

from acp_once.protocol.errors import INVALID_REQUEST, REQUEST_CANCELLED, InvalidRequest
from acp_once.protocol.framing import LineFramer, OversizedFrame
from acp_once.rpc.connection import BatchEntry, Connection, RequestContext
from acp_once.rpc.errors import BatchRefused
from acp_once.rpc.streams import MemoryFrameStream, memory_pair

pytestmark = pytest.mark.anyio


@pytest.fixture
async def pair() -> AsyncIterator[Callable[[], tuple[MemoryFrameStream, MemoryFrameStream]]]:
    made: list[MemoryFrameStream] = []

    def factory() -> tuple[MemoryFrameStream, MemoryFrameStream]:
        a, b = memory_pair(64)
        made.extend((a, b))
        return a, b

    yield factory
    for stream in made:
        await stream.aclose()


Pair = Callable[[], tuple[MemoryFrameStream, MemoryFrameStream]]


async def recv(peer: MemoryFrameStream) -> Any:
    with anyio.fail_after(5):
        frame = await peer.receive()
    assert isinstance(frame, bytes)
    return orjson.loads(frame)


async def send(peer: MemoryFrameStream, obj: object) -> None:
    with anyio.fail_after(5):
        await peer.send(orjson.dumps(obj))


def req(id: Any, method: str, params: Any = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
    if params is not None:
        msg["params"] = params
    return msg


def note(method: str, params: Any = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        msg["params"] = params
    return msg


async def echo(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
    if method == "fail":
        raise InvalidRequest("no")
    return {"method": method, "seq": ctx.seq}


async def test_a_mixed_batch_gets_one_array_with_one_answer_per_request(pair: Pair) -> None:
    seen: list[str] = []

    async def on_note(method: str, params: dict[str, Any] | None) -> None:
        seen.append(method)

    ours, peer = pair()
    async with Connection(ours, on_request=echo, on_notification=on_note):
        batch = [
            req(1, "a"),
            note("n/one"),
            req("two", "fail"),
            17,  # not an object
            {"foo": "boo"},  # neither request, notification nor response
            {"jsonrpc": "1.0", "id": 5, "method": "b"},  # bad version, readable id
            {"jsonrpc": "2.0", "id": None, "method": "c"},  # null id (R45)
            {"jsonrpc": "2.0", "method": 1},  # an invalid notification: never answered
            req(3, "d"),
        ]
        await send(peer, batch)
        reply = await recv(peer)
        assert isinstance(reply, list)
        by_id = {}
        nulls = []
        for answer in reply:
            assert answer["jsonrpc"] == "2.0"
            if answer["id"] is None:
                nulls.append(answer["error"]["code"])
            else:
                assert answer["id"] not in by_id  # one answer per request
                by_id[answer["id"]] = answer
        assert by_id.keys() == {1, "two", 3, 5}
        assert by_id[1]["result"]["method"] == "a"
        assert by_id["two"]["error"]["code"] == INVALID_REQUEST
        assert by_id[5]["error"]["code"] == INVALID_REQUEST
        assert by_id[3]["result"]["method"] == "d"
        assert nulls == [INVALID_REQUEST] * 3
        assert seen == ["n/one"]
        # each entry counts as an arrival of its own
        assert by_id[3]["result"]["seq"] - by_id[1]["result"]["seq"] == 8
        # nothing else was written for the batch: the next frame answers the next request
        await send(peer, req(9, "after"))
        assert (await recv(peer))["id"] == 9


async def test_an_empty_batch_gets_one_error_object_with_a_null_id(pair: Pair) -> None:
    ours, peer = pair()
    async with Connection(ours, on_request=echo):
        await send(peer, [])
        answer = await recv(peer)
        assert isinstance(answer, dict)
        assert answer["id"] is None and answer["error"]["code"] == INVALID_REQUEST


async def test_a_notification_only_batch_gets_no_reply(pair: Pair) -> None:
    seen: list[str] = []

    async def on_note(method: str, params: dict[str, Any] | None) -> None:
        seen.append(method)

    ours, peer = pair()
    async with Connection(ours, on_request=echo, on_notification=on_note):
        await send(peer, [note("x"), note("y"), {"jsonrpc": "2.0", "method": 7}])
        await send(peer, req(1, "next"))
        answer = await recv(peer)
        assert isinstance(answer, dict) and answer["id"] == 1  # no array came before it
        assert seen == ["x", "y"]


async def test_answers_to_our_requests_inside_a_batch_resolve_them_and_get_no_reply(
    pair: Pair,
) -> None:
    ours, peer = pair()
    async with Connection(ours, on_request=echo) as conn:
        first = await conn.start_request("one")
        second = await conn.start_request("two")
        ids = [(await recv(peer))["id"], (await recv(peer))["id"]]
        error = {"jsonrpc": "2.0", "id": ids[0], "error": {"code": -32002, "message": "gone"}}
        await send(peer, [{"jsonrpc": "2.0", "id": ids[1], "result": {"ok": 2}}, error])
        assert await second.result(5) == {"ok": 2}
        with pytest.raises(Exception, match="gone"):
            await first.result(5)
        await send(peer, req(1, "next"))
        assert (await recv(peer))["id"] == 1  # nothing was written for the responses


async def test_a_batch_over_the_limit_is_refused_whole(pair: Pair) -> None:
    calls: list[str] = []

    async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        calls.append(method)
        return {}

    ours, peer = pair()
    async with Connection(ours, on_request=handler, max_batch=3):
        await send(peer, [req(i, f"m{i}") for i in range(4)])
        answer = await recv(peer)
        assert isinstance(answer, dict) and answer["id"] is None
        assert answer["error"]["code"] == INVALID_REQUEST
        assert "at most 3" in answer["error"]["message"]
        await send(peer, [req(i, f"m{i}") for i in range(3)])  # at the limit: served
        assert len(await recv(peer)) == 3
    assert calls == ["m0", "m1", "m2"]


async def test_a_connection_that_refuses_batches_answers_one_error(pair: Pair) -> None:
    calls: list[str] = []

    async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        calls.append(method)
        return {}

    ours, peer = pair()
    async with Connection(ours, on_request=handler) as conn:
        conn.refuse_batches("Batches are not supported on ACP v1 connections")
        await send(peer, [req(1, "a"), note("b")])
        answer = await recv(peer)
        assert isinstance(answer, dict) and answer["id"] is None
        assert answer["error"] == {
            "code": INVALID_REQUEST,
            "message": "Batches are not supported on ACP v1 connections",
        }
        with pytest.raises(BatchRefused):
            await conn.start_batch([BatchEntry("a")])
    assert calls == []


async def test_a_slow_entry_holds_the_array_and_cancel_answers_it_once(pair: Pair) -> None:
    started = anyio.Event()

    async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        if method == "slow":
            started.set()
            await anyio.sleep_forever()
        return {"m": method}

    ours, peer = pair()
    async with Connection(ours, on_request=handler):
        await send(peer, [req(1, "fast"), req(2, "slow"), req(3, "fast")])
        with anyio.fail_after(5):
            await started.wait()
        # the fast answers are made but wait for the slow one: the array is written once
        with anyio.move_on_after(0.2):
            early = await peer.receive()
            pytest.fail(f"the array was written before its last answer: {early!r}")
        await send(peer, note("$/cancel_request", {"requestId": 2}))
        reply = await recv(peer)
        assert sorted(a["id"] for a in reply) == [1, 2, 3]
        cancelled = next(a for a in reply if a["id"] == 2)
        assert cancelled["error"]["code"] == REQUEST_CANCELLED
        # a second cancel of the answered entry is ignored: no second answer
        await send(peer, note("$/cancel_request", {"requestId": 2}))
        await send(peer, req(4, "fast"))
        assert (await recv(peer))["id"] == 4


async def test_a_duplicate_id_in_a_batch_is_refused_with_a_null_id(pair: Pair) -> None:
    release = anyio.Event()

    async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        await release.wait()
        return {"m": method}

    ours, peer = pair()
    async with Connection(ours, on_request=handler):
        await send(peer, [req(1, "first"), req(1, "second")])
        release.set()
        reply = await recv(peer)
        assert len(reply) == 2
        answered = [a for a in reply if a["id"] == 1]
        assert len(answered) == 1 and answered[0]["result"] == {"m": "first"}
        refused = [a for a in reply if a["id"] is None]
        assert refused[0]["error"]["code"] == INVALID_REQUEST


async def test_the_gate_admits_each_entry_on_its_own(pair: Pair) -> None:
    class Gate:
        def admit_request(self, method: str) -> Callable[[bool], None] | None:
            if method == "locked":
                raise InvalidRequest("not yet")
            return None

        def admit_notification(self, method: str) -> bool:
            return True

    ours, peer = pair()
    async with Connection(ours, on_request=echo, gate=Gate()):
        await send(peer, [req(1, "locked"), req(2, "open")])
        reply = {a["id"]: a for a in await recv(peer)}
        assert reply[1]["error"] == {"code": INVALID_REQUEST, "message": "not yet"}
        assert reply[2]["result"]["method"] == "open"


async def test_a_batch_larger_than_the_inflight_bound_is_answered(pair: Pair) -> None:
    ours, peer = pair()
    async with Connection(ours, on_request=echo, max_inflight=2):
        await send(peer, [req(i, "m") for i in range(20)])
        reply = await recv(peer)
        assert sorted(a["id"] for a in reply) == list(range(20))


async def test_outbound_batch_calls_are_answered_in_any_order(pair: Pair) -> None:
    ours, peer = pair()
    async with Connection(ours, on_request=echo) as conn:
        calls = await conn.start_batch(
            [BatchEntry("a", {"x": 1}), BatchEntry("n", notification=True), BatchEntry("b")]
        )
        sent = await recv(peer)
        assert isinstance(sent, list) and len(sent) == 3
        assert [m["method"] for m in sent] == ["a", "n", "b"]
        assert "id" not in sent[1] and sent[0]["params"] == {"x": 1}
        assert [c.id for c in calls] == [sent[0]["id"], sent[2]["id"]]
        await send(
            peer,
            [
                {"jsonrpc": "2.0", "id": sent[2]["id"], "result": "B"},
                {"jsonrpc": "2.0", "id": sent[0]["id"], "result": "A"},
            ],
        )
        assert [await c.result(5) for c in calls] == ["A", "B"]
        with pytest.raises(BatchRefused):
            await conn.start_batch([])


async def test_no_batch_goes_out_on_a_transport_that_carries_none(pair: Pair) -> None:
    ours, peer = pair()
    ours.carries_batches = False  # type: ignore[attr-defined]
    async with Connection(ours, on_request=echo) as conn:
        with pytest.raises(BatchRefused, match="send each message alone"):
            await conn.start_batch([BatchEntry("a")])
        await conn.notify("still/alive")
        assert (await recv(peer))["method"] == "still/alive"


async def test_a_batch_over_the_frame_limit_gets_one_error(pair: Pair) -> None:
    calls: list[str] = []

    async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        calls.append(method)
        return {}

    ours, peer = pair()
    framer = LineFramer(256)  # the transports' framing: too long a line is reported, not held
    async with Connection(ours, on_request=handler):
        line = orjson.dumps([req(i, "m", {"pad": "x" * 40}) for i in range(8)]) + b"\n"
        [event] = framer.feed(line)
        assert isinstance(event, OversizedFrame)
        await peer.send(event)  # type: ignore[arg-type]
        answer = await recv(peer)
        assert isinstance(answer, dict) and answer["id"] is None  # not the first entry's id
        assert answer["error"]["code"] == INVALID_REQUEST
        await send(peer, [req(1, "small")])
        assert [a["id"] for a in await recv(peer)] == [1]
    assert calls == ["small"]


async def test_after_the_peers_last_frame_a_pending_batch_is_still_answered(pair: Pair) -> None:
    release = anyio.Event()

    async def handler(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
        await release.wait()
        return {"m": method}

    ours, peer = pair()
    ours.writable_after_eof = True  # type: ignore[attr-defined]  # as a stdio pipe is
    async with Connection(ours, on_request=handler) as conn:
        await send(peer, [req(1, "a"), req(2, "b")])
        await peer._send.aclose()  # the peer's last frame; it still reads
        release.set()
        reply = await recv(peer)
        assert sorted(a["id"] for a in reply) == [1, 2]
        with anyio.fail_after(5):
            await conn.wait_closed()
