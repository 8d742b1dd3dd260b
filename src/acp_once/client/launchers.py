"""Launchers: how a client reaches its agent, one fresh connection per `connect()`.

    AcpClient(StdioLauncher(["acp-once", "agent"]))                # a subprocess over stdio
    AcpClient(WebSocketLauncher("ws://host:8765/acp", token=...))  # `acp-once serve`
    AcpClient(HttpLauncher("http://host:8765/acp", token=...))     # Streamable HTTP

`AcpClient` calls `connect()` again after a lost connection, then initializes, resumes its
sessions and resends what is pending with the same keys; the conformance suite opens a fresh
connection per check the same way. A stdio reconnect starts the agent again. A refused upgrade
(`WebSocketRejected`, e.g. 401 or 503) and an unreachable server are `OSError`s: the client's
first connection raises them, later ones are retried with backoff.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import anyio

from acp_once.protocol.framing import DEFAULT_MAX_FRAME, FrameEvent
from acp_once.rpc.streams import FrameStream
from acp_once.support.environment import child_environment
from acp_once.transports.stdio import AgentProcess, spawn

if TYPE_CHECKING:
    # The network transports need the `server` extra (websockets, httpx, starlette): they are
    # imported when a WebSocket or HTTP launcher connects, so a stdio client runs without it.
    # (Used in the quoted base classes below, which ruff does not read as annotations.)
    from acp_once.transports.http import ClientHttpFrames
    from acp_once.transports.websocket import ClientWebSocketFrames  # noqa: F401

__all__ = ["HttpLauncher", "Launcher", "StdioLauncher", "WebSocketLauncher"]

_T = TypeVar("_T")


class Launcher(Protocol):
    """How to reach the agent: each call opens a new connection (stdio: a new process)."""

    def connect(self) -> AbstractAsyncContextManager[FrameStream]: ...


class _Tracked(Generic[_T]):
    """The open connection (`current`, None between connections) and how many were opened
    (`connects`): tests and fault injectors kill or abort the current one."""

    def __init__(self) -> None:
        self.current: _T | None = None
        self.connects = 0

    @contextlib.asynccontextmanager
    async def _track(self, opening: AbstractAsyncContextManager[_T]) -> AsyncIterator[_T]:
        async with opening as opened:
            self.current = opened
            self.connects += 1
            try:
                yield opened
            finally:
                self.current = None


class StdioLauncher(_Tracked[AgentProcess]):
    """Launch the agent as a subprocess over stdio; a reconnect starts it again.

    Args:
        command: the agent command line.
        env: the agent's environment (None: ours without our secrets, `ACP_ONCE_TOKEN`).
        cwd: the agent's working directory (None: ours).
        stderr: where the agent's stderr goes (None: ours; e.g. `subprocess.DEVNULL`).
        shutdown_timeout: seconds the agent gets to exit after its stdin is closed before it is
            terminated.

    Attributes:
        current: the running process (tests and fault injectors kill it).
        connects: how many processes were started.

    Raises:
        ValueError: the command is empty.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stderr: int | None = None,
        shutdown_timeout: float = 5.0,
    ) -> None:
        if not command:
            raise ValueError("the agent command is empty")
        super().__init__()
        self.command = list(command)
        self.env = env
        self.cwd = cwd
        self.stderr = stderr
        self.shutdown_timeout = shutdown_timeout

    def launch(self) -> AbstractAsyncContextManager[AgentProcess]:
        """Start the agent and yield its process (frame stream and OS process); stopped on exit.

        Raises:
            OSError: the command could not be started.
        """
        return self._track(
            spawn(
                self.command,
                env=child_environment(self.env),
                cwd=self.cwd,
                stderr=self.stderr,
                shutdown_timeout=self.shutdown_timeout,
            )
        )

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[FrameStream]:
        """Start the agent and yield its frame stream (see `launch`)."""
        async with self.launch() as proc:
            yield proc.frames


def _check_url(url: str, schemes: tuple[str, ...], what: str) -> str:
    if not url.startswith(schemes):
        raise ValueError(f"not a {what} URL: {url!r}")
    return url


def _require_server_extra(launcher: str, transport: str) -> None:
    """Import the network transport `transport` now, so a missing package of the `server`
    extra is reported when the launcher is made, naming the extra (an ImportError)."""
    try:
        importlib.import_module(f"acp_once.transports.{transport}")
    except ModuleNotFoundError as exc:
        missing = (exc.name or "?").partition(".")[0]
        raise ImportError(
            f"{launcher} needs the server extra (missing: {missing}): "
            "pip install 'acp-once[server]'",
            name=missing,
        ) from None


class WebSocketLauncher(_Tracked["ClientWebSocketFrames"]):
    """An agent served over WebSocket (`acp-once serve`): each `connect()` opens a new
    WebSocket, i.e. a new ACP connection, to the same server.

    Args:
        url: the `ws://` or `wss://` URL.
        token: bearer token sent on the upgrade (never in `repr`).
        max_frame: the largest frame accepted, in bytes.
        open_timeout: seconds the handshake may take.

    Attributes:
        current: the open connection's frame stream (tests and fault injectors abort it).
        connects: how many connections were opened.

    Raises:
        ValueError: `url` is not a `ws://` or `wss://` URL.
        ImportError: the `server` extra is not installed (the message names it).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        open_timeout: float = 10.0,
    ) -> None:
        super().__init__()
        self.url = _check_url(url, ("ws://", "wss://"), "WebSocket")
        _require_server_extra("WebSocketLauncher", "websocket")
        self._token = token
        self.max_frame = max_frame
        self.open_timeout = open_timeout

    def __repr__(self) -> str:  # never the token
        return f"WebSocketLauncher({self.url!r})"

    def connect(self) -> AbstractAsyncContextManager[FrameStream]:
        from acp_once.transports.websocket import connect_websocket

        return self._track(
            connect_websocket(
                self.url,
                token=self._token,
                max_frame=self.max_frame,
                open_timeout=self.open_timeout,
            )
        )


class HttpLauncher(_Tracked["ClientHttpFrames"]):
    """An agent served over Streamable HTTP (`acp-once serve`).

    Each `connect()` is a new ACP connection (a new initialize POST, new GET streams). A failed
    POST raises `anyio.BrokenResourceError` and a lost GET stream ends the connection, so
    `AcpClient` reconnects, resumes and resends with the same keys.

    Args:
        url: the `http://` or `https://` URL.
        token: bearer token sent with every request (never in `repr`).
        timeout: seconds a request may take to be accepted.

    Attributes:
        current: the open connection's frame stream (tests close its GET streams).
        connects: how many connections were opened.
        last_failure: why the latest failed POST failed (e.g. "initialize: HTTP 401"), or
            None: the engine reports only that the connection was lost.

    Raises:
        ValueError: `url` is not an `http://` or `https://` URL.
        ImportError: the `server` extra is not installed (the message names it).
    """

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 10.0) -> None:
        super().__init__()
        self.url = _check_url(url, ("http://", "https://"), "HTTP")
        _require_server_extra("HttpLauncher", "http")
        self._token = token
        self.timeout = timeout
        self.last_failure: str | None = None

    def __repr__(self) -> str:  # never the token
        return f"HttpLauncher({self.url!r})"

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[FrameStream]:
        from acp_once.transports.http import connect_http

        async with self._track(
            connect_http(self.url, token=self._token, timeout=self.timeout)
        ) as frames:
            yield _NotingFailures(frames, self)


class _NotingFailures:
    """An HTTP connection's frames that note on the launcher why a POST failed: the engine
    reports only a lost connection, and a refused token (401) should be said as such."""

    def __init__(self, frames: ClientHttpFrames, launcher: HttpLauncher) -> None:
        self._frames = frames
        self._launcher = launcher

    async def receive(self) -> FrameEvent:
        return await self._frames.receive()

    async def send(self, frame: bytes) -> None:
        try:
            await self._frames.send(frame)
        except anyio.BrokenResourceError as exc:
            if exc.args:
                self._launcher.last_failure = str(exc.args[0])
            raise

    async def aclose(self) -> None:
        await self._frames.aclose()
