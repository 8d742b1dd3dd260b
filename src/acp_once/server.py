"""ACP over the network: a Starlette app serving one agent to many WebSocket connections.

    async with open_store("sqlite:sessions.db") as store, ReferenceAgent(store, ...) as agent:
        app = create_app(agent, token=os.environ["ACP_ONCE_TOKEN"])
        await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=8765)).serve()

- `GET /acp` with `Upgrade: websocket`: a new ACP connection (`AgentSideConnection`) on the
  shared agent, `Acp-Connection-Id` on the 101 response (digest 7.3). Sessions outlive
  connections: a client whose socket dropped resumes them on a new one.
- Any other request at `/acp`: 405 (Streamable HTTP, digest 7.2, is not served yet).
- `GET /healthz`: 200 `{"status": "ok"}`, without authentication (for load balancers).

With `token`, every request at `/acp` must carry `Authorization: Bearer <token>`; anything else
is refused with 401 before the upgrade, so no ACP message from it is ever read. The token is
compared in constant time and never logged.

The caller owns the agent (`async with agent`): its task group must outlive every connection.
The app is mountable in any Starlette or FastAPI app (`AcpServer.routes()` gives its routes).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import uuid
from collections.abc import Mapping

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from acp_once.agent.connection import AgentSideConnection
from acp_once.agent.interface import Agent
from acp_once.transports.websocket import (
    CLOSE_GOING_AWAY,
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    ServerWebSocketFrames,
    redact_authorization,
)

__all__ = ["DEFAULT_MAX_CONNECTIONS", "DEFAULT_MAX_MESSAGE_BYTES", "AcpServer", "create_app"]

logger = logging.getLogger("acp_once.server")

DEFAULT_MAX_CONNECTIONS = 1000
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Largest text frame read as a message (uvicorn's own `ws_max_size` default is the same): a
larger request is answered -32600 and the connection lives on."""


_ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", errors="surrogateescape")).digest()


class AcpServer:
    """Serves `agent` at `path` (see the module docstring). `create_app` wraps it in an app.

    Attributes:
        connections: the live WebSocket connections by `Acp-Connection-Id`.
    """

    def __init__(
        self,
        agent: Agent,
        *,
        token: str | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        path: str = "/acp",
    ) -> None:
        if token is not None and not token:
            raise ValueError("an empty token would let anyone in; pass None for no token")
        if max_connections < 1 or max_message_bytes < 1:
            raise ValueError("max_connections and max_message_bytes must be positive")
        self.agent = agent
        self._token_digest = _digest(token) if token is not None else None
        self.max_connections = max_connections
        self.max_message_bytes = max_message_bytes
        self.path = path
        self.connections: dict[str, ServerWebSocketFrames] = {}
        self.accepted = 0
        """How many connections were accepted so far."""
        self.rejected = 0
        """How many upgrades were refused (authentication or the connection limit)."""
        # websockets logs handshake headers at DEBUG on uvicorn's logger: hide the token
        redact_authorization(logging.getLogger("uvicorn.error"))

    def routes(self) -> list[BaseRoute]:
        return [
            WebSocketRoute(self.path, self._websocket),
            Route(self.path, self._http, methods=_ALL_METHODS),
            Route("/healthz", self._healthz, methods=["GET"]),
        ]

    def authorized(self, headers: Mapping[str, str]) -> bool:
        """Whether `headers` carry the bearer token (always True without a token)."""
        if self._token_digest is None:
            return True
        scheme, _, credentials = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        # compare fixed-length digests: constant time, and the length leaks nothing either
        return hmac.compare_digest(_digest(credentials.strip()), self._token_digest)

    async def close_all(self, code: int = CLOSE_GOING_AWAY, reason: str = "") -> int:
        """Close every live connection (a drain before shutdown, or a test's injected fault);
        returns how many. Their sessions stay resumable."""
        live = list(self.connections.values())
        for frames in live:
            await frames.close(code, reason)
        return len(live)

    async def _websocket(self, websocket: WebSocket) -> None:
        if not self.authorized(websocket.headers):
            self.rejected += 1
            logger.warning("refused a WebSocket from %s: not authorized", _peer(websocket))
            await _deny(
                websocket,
                401,
                "missing or wrong bearer token",
                {"WWW-Authenticate": 'Bearer realm="acp"'},
            )
            return
        if len(self.connections) >= self.max_connections:
            self.rejected += 1
            logger.warning("refused a WebSocket: %d connections open", len(self.connections))
            await _deny(websocket, 503, "too many connections", {"Retry-After": "1"})
            return
        connection_id = uuid.uuid4().hex
        frames = ServerWebSocketFrames(websocket, max_frame=self.max_message_bytes)
        self.connections[connection_id] = frames  # counted before the first await
        try:
            await frames.accept(connection_id)
            self.accepted += 1
            async with AgentSideConnection(
                self.agent, frames, name=f"ws-{connection_id[:12]}"
            ) as conn:
                await conn.wait_closed()
        except Exception:
            logger.exception("the WebSocket connection %s failed", connection_id)
            await frames.close(CLOSE_INTERNAL)
        finally:
            self.connections.pop(connection_id, None)
            await frames.close(CLOSE_NORMAL)

    async def _http(self, request: Request) -> Response:
        if not self.authorized(request.headers):
            return JSONResponse(
                {"error": "missing or wrong bearer token"},
                401,
                headers={"WWW-Authenticate": 'Bearer realm="acp"'},
            )
        return JSONResponse(
            {"error": "only WebSocket upgrades are served here (Streamable HTTP: not yet)"},
            405,
            headers={"Allow": "GET"},
        )

    async def _healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})


async def _deny(websocket: WebSocket, status: int, message: str, headers: dict[str, str]) -> None:
    """Refuse the upgrade with an HTTP answer where the server can send one (the ASGI
    denial-response extension), else close with 1008 (the server answers 403)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(JSONResponse({"error": message}, status, headers))
    else:
        await websocket.close(CLOSE_POLICY, message)


def _peer(websocket: WebSocket) -> str:
    client = websocket.client
    return f"{client.host}:{client.port}" if client is not None else "?"


def create_app(
    agent: Agent,
    *,
    token: str | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    path: str = "/acp",
) -> Starlette:
    """A Starlette app serving `agent` (entered by the caller) at `path`; see the module
    docstring. `app.state.acp` is its `AcpServer`."""
    server = AcpServer(
        agent,
        token=token,
        max_connections=max_connections,
        max_message_bytes=max_message_bytes,
        path=path,
    )
    app = Starlette(routes=server.routes())
    app.state.acp = server
    return app
