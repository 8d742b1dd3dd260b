"""The bridge's id translation per hop (`acp_once.bridge.translation`), without processes or
sockets."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import anyio
import pytest

from acp_once.bridge.routing import Remote
from acp_once.bridge.supervisor import Child
from acp_once.bridge.translation import Translator
from acp_once.protocol import jsonrpc

pytestmark = pytest.mark.anyio


@pytest.fixture
def remote() -> Iterator[Callable[[], Remote]]:
    made: list[Remote] = []

    def make() -> Remote:
        made.append(Remote(cast(Any, None), "remote", queue=4, stall=0.1))
        return made[-1]

    yield make
    for r in made:
        r.out_send.close()
        r.out_recv.close()


def _child(tg: anyio.abc.TaskGroup) -> Child:
    return Child(cast(Any, None), tg, send_timeout=1.0)


async def test_a_request_gets_a_child_id_and_its_answer_the_remote_id_back(
    remote: Callable[[], Remote],
) -> None:
    async with anyio.create_task_group() as tg:
        hops, conn, child = Translator(), remote(), _child(tg)
        key = "k-\ud800"  # a lone surrogate: valid JSON, the agent's to judge (-32602)
        request = jsonrpc.Request(
            "r-1", "session/prompt", {"sessionId": "s", "idempotencyKey": key}
        )
        forward, frame = hops.forward(conn, request, child)
        sent = jsonrpc.decode(frame)
        assert isinstance(sent, jsonrpc.Request)
        assert sent.id == forward.child_id != "r-1"
        assert sent.params == request.params  # the key reaches the child as the client sent it
        assert b"\\ud800" in frame
        assert hops.in_use(conn, "r-1")

        answered = hops.answered(child, jsonrpc.Response(forward.child_id, {"messageId": "m"}))
        assert answered is not None
        assert jsonrpc.decode(answered[1]) == jsonrpc.Response("r-1", {"messageId": "m"})
        assert not hops.in_use(conn, "r-1")
        assert hops.answered(child, jsonrpc.Response(forward.child_id, {})) is None  # once


async def test_cancel_request_is_translated_per_hop_and_dropped_when_unknown(
    remote: Callable[[], Remote],
) -> None:
    async with anyio.create_task_group() as tg:
        hops, conn, child = Translator(), remote(), _child(tg)
        forward, _ = hops.forward(conn, jsonrpc.Request(7, "session/prompt", {}), child)
        cancel = hops.cancel_from_remote(conn, {"requestId": 7})
        assert cancel is not None and cancel[0] is child
        assert jsonrpc.decode(cancel[1]) == jsonrpc.Notification(
            "$/cancel_request", {"requestId": forward.child_id}
        )
        assert hops.cancel_from_remote(conn, {"requestId": 8}) is None
        assert hops.cancel_from_remote(remote(), {"requestId": 7}) is None

        # the child's request: an id of the remote connection, answered under the child's id
        ask = hops.ask(child, jsonrpc.Request(3, "fs/read", {"sessionId": "s"}))
        assert ask is not None
        assert hops.ask(child, jsonrpc.Request(3, "fs/read", None)) is None  # id in use
        sent = jsonrpc.decode(hops.send_ask(ask, conn))
        assert isinstance(sent, jsonrpc.Request) and sent.id != 3
        back = hops.cancel_from_child(child, {"requestId": 3})
        assert back is not None and back[0] is conn
        assert jsonrpc.decode(back[1]) == jsonrpc.Notification(
            "$/cancel_request", {"requestId": sent.id}
        )
        answer = hops.answer_ask(conn, jsonrpc.Response(sent.id, {"content": "x"}))
        assert answer is not None and answer[0] is child
        assert jsonrpc.decode(answer[1]) == jsonrpc.Response(3, {"content": "x"})
        assert hops.answer_ask(conn, jsonrpc.Response(sent.id, {})) is None  # once


async def test_a_permission_request_nobody_can_answer_is_cancelled() -> None:
    async with anyio.create_task_group() as tg:
        hops, child = Translator(), _child(tg)
        ask = hops.ask(child, jsonrpc.Request(1, "session/request_permission", {"sessionId": "s"}))
        assert ask is not None
        answer = jsonrpc.decode(hops.withdraw(ask))
        assert answer == jsonrpc.Response(1, {"outcome": {"outcome": "cancelled"}})
        assert not hops.asking(ask)
        other = hops.ask(child, jsonrpc.Request(2, "fs/read", {"sessionId": "s"}))
        assert other is not None
        error = jsonrpc.decode(hops.withdraw(other))
        assert isinstance(error, jsonrpc.ErrorResponse) and error.error["code"] == -32800
