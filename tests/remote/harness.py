"""In-process servers for the remote transport tests: uvicorn on a pre-bound loopback socket.

The socket is listening before uvicorn starts, so the port is known and a client may connect at
once (it waits in the backlog until the server accepts): nothing waits for "started".
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import uvicorn

from acp_once.agent.reference import ReferenceAgent
from acp_once.cli.serve import uvicorn_config
from acp_once.server import DEFAULT_MAX_MESSAGE_BYTES, AcpServer, create_app
from acp_once.storage import open_store

Fault = Callable[[], Awaitable[None]]


def listening_socket(port: int = 0) -> socket.socket:
    """A TCP socket listening on 127.0.0.1 (`port` 0: a free one)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


class FaultyAgent(ReferenceAgent):
    """The reference agent with faults injected right after an insertion is committed, before
    anyone is answered: each insertion pops the next fault (if any) and records its message id
    in `cut`."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.faults: list[Fault] = []
        self.cut: list[str] = []

    async def after_insert(self, session_id: str, message_id: str) -> None:
        if self.faults:
            fault = self.faults.pop(0)
            self.cut.append(message_id)
            await fault()


@dataclass
class Running:
    url: str
    port: int
    acp: AcpServer
    agent: FaultyAgent
    server: uvicorn.Server

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@asynccontextmanager
async def running(
    tmp: Path,
    *,
    sock: socket.socket | None = None,
    token: str | None = None,
    max_connections: int = 100,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> AsyncIterator[Running]:
    """The reference agent on SQLite (`tmp/agent.sqlite3`) served at ws://127.0.0.1:PORT/acp.

    Leaving the block stops uvicorn (closing its connections and its listening socket), then
    the agent and the store.
    """
    sock = sock or listening_socket()
    port = sock.getsockname()[1]
    async with (
        open_store(f"sqlite:{tmp / 'agent.sqlite3'}") as store,
        FaultyAgent(store, side_effects=tmp / "effects") as agent,
    ):
        app = create_app(
            agent, token=token, max_connections=max_connections, max_message_bytes=max_message_bytes
        )
        config = uvicorn_config(
            app,
            host="127.0.0.1",
            port=port,
            max_message_bytes=max_message_bytes,
            log_level="warning",
        )
        server = uvicorn.Server(config)
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            try:
                yield Running(f"ws://127.0.0.1:{port}/acp", port, app.state.acp, agent, server)
            finally:
                # end the Streamable HTTP connections (their SSE streams and engine tasks)
                for http_connection in list(app.state.acp.http_connections.values()):
                    await http_connection.aclose()
                server.should_exit = True


class Background:
    """`running(...)` in a task of `tg`, so it can stop while the caller's other contexts (a
    client's task group) stay open: `srv = await bg.start()`, later `await bg.stop()`."""

    def __init__(self, tg: anyio.abc.TaskGroup, tmp: Path, **kw: Any) -> None:
        self._tg = tg
        self._tmp = tmp
        self._kw = kw
        self._stop = anyio.Event()
        self._stopped = anyio.Event()

    async def start(self) -> Running:
        result: Running = await self._tg.start(self._run)
        return result

    async def _run(self, *, task_status: anyio.abc.TaskStatus[Running]) -> None:
        try:
            async with running(self._tmp, **self._kw) as srv:
                task_status.started(srv)
                await self._stop.wait()
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        self._stop.set()
        await self._stopped.wait()
