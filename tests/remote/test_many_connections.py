"""What `acp-once serve` needs for many connections: few tasks per connection (idle ones are
closed by one sweeper), the open files limit raised at start, and the per-address cap on
established connections as a command-line option."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

import anyio
import pytest

from acp_once.transports.websocket import CLOSE_NORMAL, WebSocketRejected, connect_websocket
from tests.remote.harness import listening_socket, running
from tests.remote.test_websocket import session_conn

pytestmark = pytest.mark.anyio

TIMEOUT = 30


def test_the_soft_open_files_limit_is_raised_to_the_hard_one() -> None:
    script = textwrap.dedent(
        """
        import logging, resource, sys
        from acp_once.server.listen import raise_open_files_limit
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        low = 64 if hard == resource.RLIM_INFINITY else min(64, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE), hard)
        print(raise_open_files_limit())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    first, second = done.stdout.splitlines()
    hard = int(first.rsplit(" ", 1)[1])
    if hard == 64:
        pytest.fail("the hard limit is 64 here: nothing to raise, the test proves nothing")
    # on Linux the hard limit is finite (nr_open): the soft one now equals it
    assert first == f"(64, {hard}) ({hard}, {hard}) {hard}"
    assert second == f"({hard}, {hard})"  # already raised: nothing to do
    assert f"open files limit raised from 64 to {hard}" in done.stderr


@contextmanager
def served(*options: str) -> Iterator[str]:
    """`acp-once serve --store memory` in a subprocess on an inherited listening socket."""
    sock = listening_socket()
    sock.setblocking(True)
    port = sock.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "acp_once", "serve", "--store", "memory",
         "--fd", str(sock.fileno()), "--side-effects", os.devnull, *options],
        pass_fds=[sock.fileno()], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    sock.close()  # the child has its own copy; clients wait in its backlog meanwhile
    try:
        yield f"ws://127.0.0.1:{port}/acp"
    finally:
        process.terminate()
        process.communicate(timeout=30)


async def test_serve_caps_the_connections_of_one_address_as_told(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT), served("--max-connections-per-address", "2") as url:
        async with AsyncExitStack() as stack:
            for _ in range(2):
                await stack.enter_async_context(connect_websocket(url))
            with pytest.raises(WebSocketRejected) as refused:
                async with connect_websocket(url):
                    pass
            assert refused.value.status == 503


def test_serve_refuses_a_negative_cap() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "acp_once", "serve", "--store", "memory",
         "--max-connections-per-address", "-1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--max-connections-per-address" in done.stderr


async def test_an_idle_websocket_needs_no_task_of_its_own_to_be_closed(tmp_path: Path) -> None:
    # the idle timeout is one sweeper for every connection: 20 connections take as many tasks
    # (here and in the clients, same process) with a timeout as without one
    count = 20
    added: dict[float | None, int] = {}
    with anyio.fail_after(TIMEOUT):
        for idle_timeout in (None, 1.0):
            async with (
                running(tmp_path / str(idle_timeout), idle_timeout=idle_timeout) as srv,
                AsyncExitStack() as stack,
            ):
                before = len(asyncio.all_tasks())
                opened = [
                    await stack.enter_async_context(session_conn(srv.url)) for _ in range(count)
                ]
                added[idle_timeout] = len(asyncio.all_tasks()) - before
                if idle_timeout is None:
                    continue
                # and the sweeper closes them once idle, with the idle close code
                for frames, conn in opened:
                    await conn.rpc.wait_closed()
                    assert frames.close_code == CLOSE_NORMAL
                assert srv.acp.idle_closed == count
    assert added[1.0] - added[None] < count // 2, added
