"""uvicorn's Events under `serve`'s h11 protocol (`acp_once.server.http_protocol`): the
connection's flow control and each request's message event are `LazyEvent`s, which allocate
nothing to wait with until someone waits, and still wake whoever waits on them."""

from __future__ import annotations

import collections
import gc
import json
import weakref
from pathlib import Path
from typing import Any
from unittest import mock

import anyio
import httpx
import pytest

from acp_once.server.http_protocol import LazyEvent, _DirectSseH11
from acp_once.transports.http import CONNECTION_ID_HEADER
from tests.remote.harness import Running, running
from tests.remote.test_websocket import TIMEOUT

pytestmark = pytest.mark.anyio


_INIT = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {"protocolVersion": 2, "info": {"name": "t", "version": "1"}},
}


def _has_deque(event: LazyEvent) -> bool:
    waiters: object = event._waiters
    return isinstance(waiters, collections.deque)


async def test_a_lazy_event_wakes_every_waiter_and_makes_no_deque_until_one_waits() -> None:
    event = LazyEvent()
    assert not event.is_set()
    assert not _has_deque(event)
    woken: list[int] = []

    async def waiter(n: int) -> None:
        assert await event.wait() is True
        woken.append(n)

    with anyio.fail_after(TIMEOUT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, 1)
            tg.start_soon(waiter, 2)
            await anyio.wait_all_tasks_blocked()
            assert woken == []
            assert _has_deque(event)
            event.set()
        assert sorted(woken) == [1, 2]
        event.clear()
        assert not event.is_set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, 3)
            await anyio.wait_all_tasks_blocked()
            assert sorted(woken) == [1, 2]  # cleared: the new waiter waits
            event.set()
        assert sorted(woken) == [1, 2, 3]

    already = LazyEvent()
    already.set()
    with anyio.fail_after(TIMEOUT):
        assert await already.wait() is True
    assert not _has_deque(already)  # it did not have to wait


def _protocol(srv: Running) -> _DirectSseH11:
    """The one connection the server holds."""
    (protocol,) = srv.server.server_state.connections
    assert isinstance(protocol, _DirectSseH11)
    return protocol


async def test_a_paused_socket_still_blocks_a_drain_until_it_resumes(tmp_path: Path) -> None:
    """The connection's flow control (uvicorn's `FlowControl`) waits on a `LazyEvent`: a send
    waiting for a full socket to drain waits until the transport resumes writing."""
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path) as srv,
            await anyio.connect_tcp("127.0.0.1", srv.port) as stream,
        ):
            await stream.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = await stream.receive()
            assert head.startswith(b"HTTP/1.1 200"), head
            protocol = _protocol(srv)  # the kept-alive connection
            flow = protocol.flow
            assert isinstance(flow._is_writable_event, LazyEvent)
            drained = anyio.Event()

            async def drain() -> None:
                await flow.drain()
                drained.set()

            async with anyio.create_task_group() as tg:
                flow.pause_writing()
                tg.start_soon(drain)
                await anyio.wait_all_tasks_blocked()
                assert not drained.is_set()
                flow.resume_writing()
                await drained.wait()


async def test_a_body_that_arrives_after_its_headers_wakes_the_request(tmp_path: Path) -> None:
    """A POST's app waits for its body on the request's message event (a `LazyEvent`); the
    body sent once it waits is read and the POST answered."""
    body = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {"protocolVersion": 2, "info": {"name": "t", "version": "1"}},
        }
    ).encode()
    head = (
        "POST /acp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Accept: application/json, text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    waiting = anyio.Event()
    wait = LazyEvent.wait

    async def spied(self: LazyEvent) -> Any:
        waiting.set()
        return await wait(self)

    with anyio.fail_after(TIMEOUT), mock.patch.object(LazyEvent, "wait", spied):
        async with (
            running(tmp_path) as srv,
            await anyio.connect_tcp("127.0.0.1", srv.port) as stream,
        ):
            await stream.send(head)
            await waiting.wait()  # the app waits for the body
            protocol = _protocol(srv)
            assert protocol.cycle is not None
            assert isinstance(protocol.cycle.message_event, LazyEvent)
            await stream.send(body)
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                answer += await stream.receive()
            assert answer.startswith(b"HTTP/1.1 200"), answer
            result = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert result["id"] == 0
            assert result["result"]["protocolVersion"] == 2


async def test_an_sse_stream_whose_client_left_is_freed_without_the_cyclic_collector(
    tmp_path: Path,
) -> None:
    """Once an SSE stream's socket is gone, its protocol (with its transport, request cycle and
    scope) is freed by reference counting: the direct writer in the scope forms no cycle that
    would wait for `acp-once serve`'s rare full collections."""
    gc.disable()
    try:
        with anyio.fail_after(TIMEOUT):
            async with running(tmp_path) as srv, httpx.AsyncClient() as http:
                answer = await http.post(f"{srv.http}/acp", json=_INIT)
                assert answer.status_code == 200, answer.text
                cid = answer.headers[CONNECTION_ID_HEADER]
                async with await anyio.connect_tcp("127.0.0.1", srv.port) as stream:
                    await stream.send(
                        "GET /acp HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n"
                        f"{CONNECTION_ID_HEADER}: {cid}\r\n\r\n".encode()
                    )
                    head = await stream.receive()
                    assert head.startswith(b"HTTP/1.1 200"), head
                    (protocol,) = [
                        p
                        for p in srv.server.server_state.connections
                        if isinstance(p, _DirectSseH11)
                        and p.cycle is not None
                        and p.cycle.scope["method"] == "GET"
                    ]
                    gone = weakref.ref(protocol)
                    del protocol
                while gone() is not None:  # noqa: ASYNC110 (polls for refcounting's work)
                    await anyio.sleep(0.01)
    finally:
        gc.enable()
