"""The cap on established connections per client address (`max_connections_per_address`): one
address over it is answered 503, on a WebSocket upgrade and on a plain request, while other
addresses are served; a slot is given back when its connection closes."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import anyio.abc
import pytest

from acp_once.server.guard import HalfOpenGuard
from tests.remote.harness import running
from tests.remote.test_hardening import _read_head, _upgrade
from tests.remote.test_websocket import new_session, session_conn

pytestmark = pytest.mark.anyio

TIMEOUT = 20
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


async def _open(
    stack: AsyncExitStack, port: int, request: bytes, address: str
) -> tuple[int, anyio.abc.SocketStream]:
    """Send `request` from `address` on a new socket kept open in `stack`; the status code."""
    stream = await anyio.connect_tcp("127.0.0.1", port, local_host=address)
    await stack.enter_async_context(stream)
    await stream.send(request)
    head = await _read_head(stream)
    return int(head.split(b" ", 2)[1]), stream


async def _status(port: int, request: bytes, address: str) -> int:
    async with AsyncExitStack() as stack:
        return (await _open(stack, port, request, address))[0]


async def test_an_address_over_its_cap_gets_503_and_others_are_served(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path, listen_options={"max_connections_per_address": 2}) as srv,
            AsyncExitStack() as stack,
        ):
            guard: HalfOpenGuard = srv.server.config.http.guard  # type: ignore[union-attr]
            upgrade = _upgrade(srv.port)
            held = [await _open(stack, srv.port, upgrade, "127.0.0.1") for _ in range(2)]
            assert [status for status, _ in held] == [101, 101]
            # the third connection of 127.0.0.1: refused, upgrade or not
            assert await _status(srv.port, upgrade, "127.0.0.1") == 503
            assert await _status(srv.port, HEALTHZ, "127.0.0.1") == 503
            assert guard.refused == 2
            # another address is served meanwhile
            assert (await _open(stack, srv.port, upgrade, "127.0.0.2"))[0] == 101
            assert await _status(srv.port, HEALTHZ, "127.0.0.2") == 200
            # one of 127.0.0.1's WebSockets closes: its slot comes back once the server has
            # seen the close (polled, bounded by the fail_after above)
            await held[0][1].aclose()
            while await _status(srv.port, HEALTHZ, "127.0.0.1") != 200:  # noqa: ASYNC110 (no event)
                await anyio.sleep(0.05)
            async with session_conn(srv.url) as (_, conn):  # a real client of 127.0.0.1
                await new_session(conn)
                assert await _status(srv.port, upgrade, "127.0.0.1") == 503
            await stack.aclose()
            # every slot is given back: the per-address counts do not outlive connections
            while guard._established:  # noqa: ASYNC110 (the server's state, no event to wait on)
                await anyio.sleep(0.05)


def test_the_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_connections_per_address"):
        HalfOpenGuard(max_connections_per_address=0)
    assert HalfOpenGuard(max_connections_per_address=None).max_connections_per_address is None
