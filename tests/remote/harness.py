"""In-process servers for the remote transport tests: uvicorn on a pre-bound loopback socket.

The socket is listening before uvicorn starts, so the port is known and a client may connect at
once (it waits in the backlog until the server accepts): nothing waits for "started".
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import anyio
import anyio.abc
import uvicorn

from acp_once.agent.reference import ReferenceAgent
from acp_once.server import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_WRITE_TIMEOUT,
    AcpServer,
    create_app,
)
from acp_once.server.listen import uvicorn_config
from acp_once.storage import open_store

Fault = Callable[[], Awaitable[None]]


def listening_socket(port: int = 0) -> socket.socket:
    """A TCP socket listening on 127.0.0.1 (`port` 0: a free one)."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP (accepted
    # sockets inherit it), and Nagle's algorithm would stall small replies ~40 ms
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
    write_timeout: float = DEFAULT_WRITE_TIMEOUT,
    app_options: dict[str, Any] | None = None,
    listen_options: dict[str, Any] | None = None,
) -> AsyncIterator[Running]:
    """The reference agent on SQLite (`tmp/agent.sqlite3`) served at ws://127.0.0.1:PORT/acp.
    `app_options` go to `create_app`, `listen_options` to `uvicorn_config`.

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
            agent,
            token=token,
            max_connections=max_connections,
            max_message_bytes=max_message_bytes,
            idle_timeout=idle_timeout,
            write_timeout=write_timeout,
            **(app_options or {}),
        )
        config = uvicorn_config(
            app,
            host="127.0.0.1",
            port=port,
            max_message_bytes=max_message_bytes,
            log_level="warning",
            **(listen_options or {}),
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


class ServeProcess:
    """`acp-once serve` as a real subprocess on SQLite (`tmp/serve.sqlite3`, side effects in
    `tmp/effects`), on a listening socket the harness keeps across restarts (`--fd`): a client
    may connect while the server is down and waits in the backlog for the next one.

    `async with ServeProcess(tmp) as srv:` starts it; `await srv.kill()` sends SIGKILL and waits
    for the exit; `await srv.start()` starts it again on the same database and port. Leaving
    the block kills a server still running.
    """

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.tmp = tmp
        self.db = tmp / "serve.sqlite3"
        self.effects = tmp / "effects"
        self.extra = extra
        self.sock = listening_socket()
        self.port: int = self.sock.getsockname()[1]
        self.process: anyio.abc.Process | None = None
        self.starts = 0

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def start(self) -> None:
        assert self.process is None or self.process.returncode is not None
        fd = self.sock.fileno()
        command = [
            sys.executable, "-m", "acp_once", "serve",
            "--store", f"sqlite:{self.db}", "--side-effects", str(self.effects),
            "--fd", str(fd), *self.extra,
        ]  # fmt: skip
        with open(self.tmp / "serve.stderr", "ab") as log:  # noqa: ASYNC230 (the child's log)
            self.process = await anyio.open_process(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(fd,)
            )
        self.starts += 1

    async def kill(self) -> None:
        """SIGKILL the server and wait until it has exited."""
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()

    async def restart(self) -> None:
        await self.kill()
        await self.start()

    def rss_kib(self) -> int:
        """The server's resident set size, from /proc."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    async def count(self, session_id: str, key: str | None = None) -> int:
        """User messages of a session in the server's store (or those with `key`)."""
        async with open_store(f"sqlite:{self.db}") as store:
            return await store.count_user_messages(session_id, idempotency_key=key)

    def effect_lines(self, session_id: str) -> list[str]:
        """The side-effect log of a session: one message id per `[tool]` run."""
        log = self.effects / f"{session_id}.log"
        return log.read_text().split() if log.exists() else []

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.kill()
        self.sock.close()
