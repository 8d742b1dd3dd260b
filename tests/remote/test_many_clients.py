"""100 concurrent clients over WebSocket and over Streamable HTTP while a proxy cuts connections
at random: nothing is inserted twice, nothing is lost, and the server's memory stays bounded.

The server runs in this process (so its connection tables can be read) behind `FaultProxy`,
whose chaos mode resets the connection carrying a random share of server-to-client messages
(answers and updates alike). Each client is an `AcpClient` with its own session. Two waves run
per transport: after each, the connection tables must empty, and the resident set size after
the second wave must stay within a bound of the one after the first (a leak per connection or
per prompt would grow it).
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path
from typing import Literal

import anyio
import orjson
import pytest

from acp_once.client import AcpClient, HttpLauncher, WebSocketLauncher
from acp_once.faultproxy import FaultProxy
from acp_once.rpc.errors import TransportError
from acp_once.storage.base import SessionStore
from tests.remote.harness import Running, running
from tests.remote.test_websocket import FAST

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 120
CLIENTS = 100
PROMPTS = 3
CUT_RATE = 0.02
RSS_GROWTH_BOUND_KIB = 16 * 1024
"""Between the two waves (measured: +0.5 to +3 MiB). A wave opens over 200 connections and
submits 300 prompts, so a leak of 50 KiB per connection or per prompt would exceed it."""


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


async def user_texts(store: SessionStore, session_id: str) -> list[str]:
    texts: list[str] = []
    after = 0
    while page := await store.read_timeline(session_id, after_seq=after):
        for entry in page:
            update = orjson.loads(entry.update)
            if update.get("sessionUpdate") == "user_message":
                texts.append(str(update["content"][0]["text"]))
        after = page[-1].seq
    return texts


async def wave(
    srv: Running, proxy: FaultProxy, transport: Literal["ws", "http"], name: str
) -> dict[str, list[str]]:
    """Run CLIENTS clients at once, each submitting PROMPTS prompts to its own session;
    returns what each session should hold."""
    expected: dict[str, list[str]] = {}

    async def client(i: int) -> None:
        launcher = (
            WebSocketLauncher(proxy.url("ws"))
            if transport == "ws"
            else HttpLauncher(proxy.url("http"), timeout=30)
        )
        async with contextlib.AsyncExitStack() as stack:
            # a cut during the very first connection is reported to the caller (nothing was
            # submitted yet): start again, as an application would
            for _ in range(50):
                try:
                    acp = await stack.enter_async_context(
                        AcpClient(launcher, backoff=FAST, allow_duplicating=True)
                    )
                    break
                except (TransportError, OSError):
                    continue
            else:
                raise AssertionError("never connected")
            session = await acp.new_session("/w")
            texts = [f"{name} client {i} prompt {j}" for j in range(PROMPTS)]
            for text in texts:
                await session.prompt(text)
            expected[session.session_id] = texts

    async with anyio.create_task_group() as tg:
        for i in range(CLIENTS):
            tg.start_soon(client, i)
    return expected


async def settle(srv: Running, proxy: FaultProxy) -> None:
    """Until every connection the clients opened is gone from the server and the proxy."""
    while srv.acp.connections or srv.acp.http_connections or proxy.live:  # noqa: ASYNC110
        await anyio.sleep(0.02)  # server state: no event to wait on


@pytest.mark.parametrize("transport", ["ws", "http"])
async def test_many_clients_with_random_cuts(
    tmp_path: Path, transport: Literal["ws", "http"]
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path, max_connections=4 * CLIENTS) as srv,
            FaultProxy(("127.0.0.1", srv.port)) as proxy,
        ):
            proxy.chaos(CUT_RATE, seed=5)
            first = await wave(srv, proxy, transport, "first")
            await settle(srv, proxy)
            gc.collect()
            after_first = rss_kib()
            second = await wave(srv, proxy, transport, "second")
            await settle(srv, proxy)
            gc.collect()
            after_second = rss_kib()

            assert proxy.cuts > 0  # the faults did happen
            assert srv.acp.accepted > 2 * CLIENTS  # reconnections after the cuts
            store = srv.agent.store
            for expected in (first, second):
                assert len(expected) == CLIENTS
                for session_id, texts in expected.items():
                    # each submission inserted exactly once, in order
                    assert await user_texts(store, session_id) == texts
            assert after_second - after_first < RSS_GROWTH_BOUND_KIB, (after_first, after_second)
