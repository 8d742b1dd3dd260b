"""Launchers for remote agents: `AcpClient(WebSocketAgent("ws://host:8765/acp"), ...)`, or
`HttpAgent("http://host:8765/acp")` for Streamable HTTP.

Each `connect()` opens a new WebSocket, i.e. a new ACP connection; `AcpClient` then
initializes, resumes its sessions and resends what is pending with the same keys. A refused
upgrade (`WebSocketRejected`, e.g. 401 or 503) and an unreachable server are `OSError`s: the
client's first connection raises them, later ones are retried with backoff.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from acp_once.protocol.framing import DEFAULT_MAX_FRAME
from acp_once.rpc.streams import FrameStream
from acp_once.transports.http import ClientHttpFrames, connect_http
from acp_once.transports.websocket import ClientWebSocketFrames, connect_websocket

__all__ = ["HttpAgent", "WebSocketAgent"]


class WebSocketAgent:
    """An `AgentLauncher` for an agent served over WebSocket (`acp-once serve`).

    Attributes:
        current: the open connection's frame stream (tests and fault injectors abort it).
        connects: how many connections were opened.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        open_timeout: float = 10.0,
    ) -> None:
        self.url = url
        self._token = token
        self.max_frame = max_frame
        self.open_timeout = open_timeout
        self.current: ClientWebSocketFrames | None = None
        self.connects = 0

    def __repr__(self) -> str:  # never the token
        return f"WebSocketAgent({self.url!r})"

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[FrameStream]:
        async with connect_websocket(
            self.url, token=self._token, max_frame=self.max_frame, open_timeout=self.open_timeout
        ) as frames:
            self.current = frames
            self.connects += 1
            try:
                yield frames
            finally:
                self.current = None


class HttpAgent:
    """An `AgentLauncher` for an agent served over Streamable HTTP (digest 7.2).

    Each `connect()` is a new ACP connection (a new initialize POST, new GET streams). A failed
    POST raises `anyio.BrokenResourceError` and a lost GET stream ends the connection, so
    `AcpClient` reconnects, resumes and resends with the same keys.

    Attributes:
        current: the open connection's frame stream (tests close its GET streams).
        connects: how many connections were opened.
    """

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 10.0) -> None:
        self.url = url
        self._token = token
        self.timeout = timeout
        self.current: ClientHttpFrames | None = None
        self.connects = 0

    def __repr__(self) -> str:  # never the token
        return f"HttpAgent({self.url!r})"

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[FrameStream]:
        async with connect_http(self.url, token=self._token, timeout=self.timeout) as frames:
            self.current = frames
            self.connects += 1
            try:
                yield frames
            finally:
                self.current = None
