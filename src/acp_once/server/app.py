"""ACP over the network: a Starlette app serving one agent to many WebSocket connections.

    async with open_store("sqlite:sessions.db") as store, ReferenceAgent(store, ...) as agent:
        app = create_app(agent, token=os.environ["ACP_ONCE_TOKEN"])
        await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=8765)).serve()

- `GET /acp` with `Upgrade: websocket`: a new ACP connection (`AgentSideConnection`) on the
  shared agent, `Acp-Connection-Id` on the 101 response (R69). Sessions outlive
  connections: a client whose socket dropped resumes them on a new one.
- Streamable HTTP at `/acp` (R68): `POST` initialize (no `Acp-Connection-Id`) creates
  a connection and answers 200 with the initialize response and `Acp-Connection-Id`; any other
  POSTed message answers 202 and its response travels on an SSE `GET` stream (the connection's,
  or with `Acp-Session-Id` a session's); `DELETE` ends the connection (its sessions survive,
  inactive: D30). Status codes: 400 (bad headers or body, batches), 404 (unknown connection),
  406 (GET without `Accept: text/event-stream`), 409 (a second reader of a stream), 415 (POST
  not JSON), 503 (connection limit), 405 (other methods). Nothing is replayed: a response
  written to a GET stream that dropped is lost, as on a dropped socket. An SSE stream silent
  for `sse_keepalive` seconds (15) gets a comment line, as from the TypeScript SDK's server.
  The messages of one event loop turn for one stream leave as one write; `create_app` answers
  POSTs and GETs at `path` ahead of the router (the same code as the route's).
- `GET /healthz`: 200 `{"status": "ok"}`, without authentication (for load balancers).
- `connection_prefix` (`acp-once serve` on PostgreSQL: the node id and a dot, `n1.`): every
  `Acp-Connection-Id` issued begins with it, so a load balancer in front of several nodes
  sends a Streamable HTTP connection's later requests to the node that holds it by matching
  the header's beginning (docs/guide/postgres.md has an HAProxy configuration).
- Timeouts: a connection with no message either way for `idle_timeout` seconds (300; None:
  never) is closed (WebSocket close 1000 "idle timeout"; Streamable HTTP: the connection ends
  with its SSE streams, its id then answers 404), as is an HTTP connection that opened no
  stream within `http_open_timeout` (30), each kind by one sweeper of the lifespan that looks
  four times per timeout, at least every 5 s; a client that stops reading (its socket's
  send buffer full) for `write_timeout` seconds (30) is dropped, so a turn waits on it no
  longer than that. Under `acp-once serve` (its uvicorn protocol's direct channel) the stalled
  socket is dropped at once; plain ASGI has no way to reset one: the ASGI server closes it
  only once its buffer drains, but its ACP connection, engine and table entry are gone.
- `GET /ops/status` (token-protected like `/acp`): the agent's `ops_status()`; for a cluster
  node, every node sharing its database with sessions owned, prompts held and dedup hits.

With `token`, every request at `/acp` must carry `Authorization: Bearer <token>`; anything else
is refused with 401 before the upgrade, so no ACP message from it is ever read. The token is
compared in constant time and never logged. With `tokens` ({tenant name: token}, e.g. from
`acp_once.server.tenants.load_tokens`) instead, any of them is accepted and the connection
carries the name of the one that matched (`AgentSideConnection.tenant`): a `SessionAgent`
shows each tenant only its own sessions. `AcpServer.set_tokens` replaces them while serving
(`acp-once serve` does on SIGHUP): the open connections of a token no longer there are closed
at once (WebSocket close code 4401 `CLOSE_REVOKED`, "token revoked"; a Streamable HTTP
connection ends with its streams and its id then answers 404); the others go on. A Streamable
HTTP connection belongs to the tenant that opened it: another tenant's POST, GET or DELETE on
its id is answered 404, as for an unknown id.

The caller owns the agent (`async with agent`): its task group must outlive every connection.
The app is mountable in any Starlette or FastAPI app (`AcpServer.routes()` gives its routes).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any, Unpack

import anyio
from anyio.abc import TaskGroup
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from acp_once.agent.connection import AgentSideConnection
from acp_once.agent.interface import Agent
from acp_once.protocol import jsonrpc
from acp_once.protocol.methods import INITIALIZE
from acp_once.rpc.streams import FrameStream
from acp_once.server.guard import RequestGuard
from acp_once.server.http_protocol import BODY_COMPLETE_EXTENSION, send_accepted
from acp_once.server.proxies import TrustedProxies
from acp_once.support.server_options import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HTTP_OPEN_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_LIMITS,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_UNOPENED_HTTP,
    DEFAULT_TIMEOUTS,
    DEFAULT_WRITE_TIMEOUT,
    ServerLimits,
    ServerOptions,
    ServerTimeouts,
    with_options,
)
from acp_once.transports.http import (
    CONNECTION_ID_HEADER,
    SESSION_ID_HEADER,
    ServerHttpFrames,
    SseResponse,
    message_session_id,
)
from acp_once.transports.websocket import (
    CLOSE_GOING_AWAY,
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    ServerWebSocketFrames,
    redact_authorization,
    server_websocket_frames,
)

__all__ = [
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_HTTP_OPEN_TIMEOUT",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_UNOPENED_HTTP",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_WRITE_TIMEOUT",
    "CLOSE_REVOKED",
    "AcpServer",
    "ConnectionHandler",
    "ServerLimits",
    "ServerTimeouts",
    "create_app",
]

logger = logging.getLogger("acp_once.server")

CLOSE_REVOKED = 4401
"""WebSocket close code of a connection whose token was removed while it was open (the 4000s
are for applications; 4401 mirrors HTTP's 401): a reconnect with that token gets 401."""

# a header value a load balancer can match on, ended by a dot so that `n1.` never matches
# the ids of `n10`
_PREFIX = re.compile(r"[A-Za-z0-9_-]{1,64}\.")

_ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

ConnectionHandler = Callable[[FrameStream, str, str | None], Awaitable[None]]
"""`(frames, name, tenant)`: serves one accepted connection until it ends (`name` is for logs;
`tenant` is the name of the tenant whose token it carries, None without tenants). The default
runs an `AgentSideConnection` on the server's agent; `acp_once.bridge` passes its own, which
keeps tenants apart itself."""


class _Refused(enum.Enum):
    """Type of `_REFUSED`: `AcpServer._authenticate` found no valid token."""

    REFUSED = "REFUSED"


_REFUSED = _Refused.REFUSED


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", errors="surrogateescape")).digest()


class AcpServer:
    """Serves `agent` at `path` (see the module docstring). `create_app` wraps it in an app.

    Attributes:
        connections: the live WebSocket connections by `Acp-Connection-Id`.
    """

    def __init__(
        self,
        agent: Agent | None,
        *,
        token: str | None = None,
        tokens: Mapping[str, str] | None = None,
        path: str = "/acp",
        handler: ConnectionHandler | None = None,
        limits: ServerLimits = DEFAULT_LIMITS,
        timeouts: ServerTimeouts = DEFAULT_TIMEOUTS,
        allowed_origins: Iterable[str] = (),
        allowed_hosts: Iterable[str] = (),
        forwarded_allow_ips: Iterable[str] = (),
        connection_prefix: str = "",
        **options: Unpack[ServerOptions],
    ) -> None:
        limits, timeouts = with_options(limits, timeouts, options)
        if connection_prefix and not _PREFIX.fullmatch(connection_prefix):
            raise ValueError("connection_prefix: letters, digits, '_' and '-', then one '.'")
        self.connection_prefix = connection_prefix
        """What every issued `Acp-Connection-Id` begins with (see the module docstring)."""
        if agent is None and handler is None:
            raise ValueError("pass an agent, or a handler that serves each connection")
        if token is not None and not token:
            raise ValueError("an empty token would let anyone in; pass None for no token")
        if token is not None and tokens is not None:
            raise ValueError("pass one token or a tenants' tokens, not both")
        self.agent = agent
        self._handler = handler
        self._token_digest = _digest(token) if token is not None else None
        self._tenant_digests: tuple[tuple[bytes, str], ...] | None = None
        self._credentials: dict[str, tuple[bytes, str]] = {}
        """(token digest, tenant) of each live connection with tenants, by connection id."""
        self._closing: set[asyncio.Task[None]] = set()
        self.revoked_closed = 0
        """How many open connections were closed because their token was removed."""
        if tokens is not None:
            self.set_tokens(tokens)
        self._http_tenants: dict[str, str | None] = {}
        """The tenant of each live Streamable HTTP connection (None: no tenant)."""
        self._http_addresses: dict[str, str] = {}
        """The client address of each live Streamable HTTP connection."""
        self.limits = limits
        self.timeouts = timeouts
        self.max_connections = limits.max_connections
        self.max_message_bytes = limits.max_message_bytes
        self.path = path
        self.idle_timeout = timeouts.idle
        """None: connections are never closed for being idle."""
        self.write_timeout = timeouts.write
        self.sse_keepalive = timeouts.sse_keepalive
        """Seconds of silence before an SSE stream gets a comment line (None: never)."""
        self.guard = RequestGuard(allowed_origins, allowed_hosts)
        self.proxies = TrustedProxies(forwarded_allow_ips)
        """Whose `X-Forwarded-For`/`Forwarded` headers name the client (`client_address`)."""
        self.http_open_timeout = timeouts.http_open
        self.max_unopened_http = limits.max_unopened_http
        self.body_timeout = timeouts.body
        self.unopened_closed = 0
        """How many HTTP connections were closed for never opening a stream."""
        self.forbidden = 0
        """How many requests were refused for their Origin or Host."""
        self.idle_closed = 0
        """How many connections were closed for being idle."""
        self.connections: dict[str, ServerWebSocketFrames] = {}
        self.http_connections: dict[str, ServerHttpFrames] = {}
        """The live Streamable HTTP connections by `Acp-Connection-Id`."""
        self._unopened_http: set[str] = set()
        """Ids of HTTP connections that may have opened no stream yet (`_unopened` prunes)."""
        self._http_tasks: set[asyncio.Task[None]] = set()
        """The engine tasks of the live HTTP connections (`_initialize`)."""
        self._tg: TaskGroup | None = None
        self.accepted = 0
        """How many connections were accepted so far."""
        self.rejected = 0
        """How many upgrades were refused (authentication or the connection limit)."""
        # websockets logs handshake headers at DEBUG on uvicorn's logger: hide the token
        redact_authorization(logging.getLogger("uvicorn.error"))

    @property
    def token_required(self) -> bool:
        """Whether requests at `path` must carry the bearer token."""
        return self._token_digest is not None or self._tenant_digests is not None

    def set_tokens(self, tokens: Mapping[str, str]) -> int:
        """Serve these tenants from now on ({name: token}): a removed token's new requests
        are refused with 401, and its open connections are closed at once (WebSocket:
        `CLOSE_REVOKED`; Streamable HTTP: the connection ends). Returns how many are being
        closed; the other tenants' connections go on.

        Raises:
            ValueError: no tenant, an empty name or token, or this server takes one token.
        """
        if self._token_digest is not None:
            raise ValueError("this server takes one token, not tenants' tokens")
        if not tokens or any(not name or not token for name, token in tokens.items()):
            raise ValueError("tenants need a name and a non-empty token each")
        self._tenant_digests = tuple((_digest(t), name) for name, t in tokens.items())
        return self._close_revoked(frozenset(self._tenant_digests))

    def _close_revoked(self, valid: frozenset[tuple[bytes, str]]) -> int:
        revoked = [cid for cid, held in self._credentials.items() if held not in valid]
        for connection_id in revoked:
            del self._credentials[connection_id]  # closed once, however many reloads follow
            websocket = self.connections.get(connection_id)
            if websocket is not None:
                self._start(websocket.close(CLOSE_REVOKED, "token revoked"))
            http = self.http_connections.get(connection_id)
            if http is not None:
                self._start(http.aclose())
        if revoked:
            self.revoked_closed += len(revoked)
            logger.warning("closing %d connection(s) whose token was removed", len(revoked))
        return len(revoked)

    def _start(self, closing: Coroutine[Any, Any, None]) -> None:
        """Run `closing` in the background: in the lifespan's task group, else as a task."""
        if self._tg is not None:
            self._tg.start_soon(_run, closing)
            return
        task = asyncio.get_running_loop().create_task(closing)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _credential(self, headers: Mapping[str, str], tenant: str | None) -> bytes | None:
        """The digest of the bearer token in `headers` when `tenant` is a tenant's name."""
        if tenant is None:
            return None
        return _digest(headers.get("authorization", "").partition(" ")[2].strip())

    def routes(self) -> list[BaseRoute]:
        return [
            WebSocketRoute(self.path, self._websocket),
            Route(self.path, self._http, methods=_ALL_METHODS),
            Route("/healthz", self._healthz, methods=["GET"]),
            Route("/ops/status", self._ops_status, methods=["GET"]),
        ]

    def authorized(self, headers: Mapping[str, str]) -> bool:
        """Whether `headers` carry the bearer token, or a tenant's (always True without)."""
        return self._authenticate(headers) is not _REFUSED

    def _authenticate(self, headers: Mapping[str, str]) -> str | _Refused | None:
        """Who `headers` authenticate as: the tenant whose token they carry, None without
        tenants (one token or none), `_REFUSED` when a token is required and not there."""
        tenants = self._tenant_digests
        if self._token_digest is None and tenants is None:
            return None
        scheme, _, credentials = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return _REFUSED
        # compare fixed-length digests: constant time, and the length leaks nothing either
        digest = _digest(credentials.strip())
        if tenants is None:
            assert self._token_digest is not None
            return None if hmac.compare_digest(digest, self._token_digest) else _REFUSED
        found: str | _Refused | None = _REFUSED
        for expected, name in tenants:  # every one compared: the time says nothing of which
            if hmac.compare_digest(digest, expected):
                found = name
        return found

    @contextlib.asynccontextmanager
    async def lifespan(self, app: object) -> AsyncIterator[None]:
        """The app's lifespan: a task group for the sweepers of idle connections; leaving it
        closes every connection and ends the HTTP connections' engine tasks, so they end with
        the server (sessions stay resumable). Without a lifespan (an ASGI server run with
        lifespan off) those tasks end when their connection does."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            if self.idle_timeout is not None:
                tg.start_soon(self._sweep_idle_websockets, self.idle_timeout)
            tg.start_soon(self._sweep_http)
            try:
                yield
            finally:
                self._tg = None
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await self.close_all()
                await self._end_http_tasks()
                tg.cancel_scope.cancel()

    async def _end_http_tasks(self) -> None:
        """Cancel the HTTP connections' engine tasks still running and wait for them to end
        (at most 5 s): what leaving a task group that owned them would do."""
        tasks = list(self._http_tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            with anyio.CancelScope(shield=True):
                await asyncio.wait(tasks, timeout=5)

    async def close_all(self, code: int = CLOSE_GOING_AWAY, reason: str = "") -> int:
        """Close every live connection (a drain before shutdown, or a test's injected fault);
        returns how many. Their sessions stay resumable."""
        live = list(self.connections.values())
        for frames in live:
            await frames.close(code, reason)
        http = list(self.http_connections.values())
        for http_frames in http:
            await http_frames.aclose()
        return len(live) + len(http)

    def client_address(self, scope: Mapping[str, Any]) -> str:
        """The address a request (an ASGI `scope`) comes from: its socket's peer, or the
        client a trusted proxy names (`forwarded_allow_ips`; `acp_once.server.proxies`)."""
        client = scope.get("client")
        peer = str(client[0]) if client else "?"
        return self.proxies.client(peer, scope.get("headers") or ())

    def _unopened(self) -> int:
        """How many HTTP connections have opened no stream yet (at most `max_unopened_http`:
        counted without going through every connection)."""
        unopened = self._unopened_http
        for connection_id in [c for c in unopened if self._opened_or_gone(c)]:
            unopened.discard(connection_id)
        return len(unopened)

    def _opened_or_gone(self, connection_id: str) -> bool:
        frames = self.http_connections.get(connection_id)
        return frames is None or frames.opened.is_set()

    def _unopened_refusal(self, address: str, tenant: str | None) -> str | None:
        """Why one more HTTP connection without a stream is refused (None: it is not): the
        global cap, its address's or its tenant's."""
        if self._unopened() >= self.max_unopened_http:
            return "too many connections"
        by_address = by_tenant = 0
        for connection_id in self._unopened_http:
            by_address += self._http_addresses.get(connection_id) == address
            if tenant is not None:
                by_tenant += self._http_tenants.get(connection_id) == tenant
        if by_address >= self.limits.max_unopened_http_per_address:
            return "too many connections from this address"
        if by_tenant >= self.limits.max_unopened_http_per_tenant:
            return "too many connections for this tenant"
        return None

    def _full(self) -> bool:
        # HTTP connections that never opened a stream have a cap of their own (_initialize)
        live = len(self.connections) + len(self.http_connections) - self._unopened()
        return live >= self.max_connections

    def _refusal(self, headers: Mapping[str, str], scope: Mapping[str, Any]) -> Response | None:
        refused = self.guard.refusal(headers, scope)
        if refused is None:
            return None
        self.forbidden += 1
        logger.warning("refused a request from %s: %s", self.client_address(scope), refused[1])
        return _error(*refused)

    async def _websocket(self, websocket: WebSocket) -> None:
        refused = self._refusal(websocket.headers, websocket.scope)
        if refused is not None:
            self.rejected += 1
            await _deny_with(websocket, refused)
            return
        tenant = self._authenticate(websocket.headers)
        if isinstance(tenant, _Refused):
            self.rejected += 1
            logger.warning(
                "refused a WebSocket from %s: not authorized", self.client_address(websocket.scope)
            )
            await _deny(
                websocket,
                401,
                "missing or wrong bearer token",
                {"WWW-Authenticate": 'Bearer realm="acp"'},
            )
            return
        if self._full():
            self.rejected += 1
            logger.warning("refused a WebSocket: %d connections open", len(self.connections))
            await _deny(websocket, 503, "too many connections", {"Retry-After": "1"})
            return
        connection_id = self.connection_prefix + uuid.uuid4().hex
        frames = server_websocket_frames(
            websocket, max_frame=self.max_message_bytes, write_timeout=self.write_timeout
        )
        self.connections[connection_id] = frames  # counted before the first await
        credential = self._credential(websocket.headers, tenant)
        if credential is not None and tenant is not None:  # before any await: see set_tokens
            self._credentials[connection_id] = (credential, tenant)
        try:
            await frames.accept(connection_id)
            self.accepted += 1
            name = f"ws-{connection_id[:12]}"
            if self._tg is not None:
                # the lifespan's sweeper closes it when idle: no watching task of its own (with
                # 10,000 connections, a task group and a task each are ~4 KB per connection)
                await self._serve_connection(frames, name, tenant)
            else:
                await self._serve_frames(frames, name, tenant)
        except Exception:
            logger.exception("the WebSocket connection %s failed", connection_id)
            await frames.close(CLOSE_INTERNAL)
        finally:
            self.connections.pop(connection_id, None)
            self._credentials.pop(connection_id, None)
            await frames.close(CLOSE_NORMAL)

    async def _http(self, request: Request) -> Response:
        refused = self._refusal(request.headers, request.scope)
        if refused is not None:
            return refused
        tenant = self._authenticate(request.headers)
        if isinstance(tenant, _Refused):
            return _unauthorized()
        if request.method == "POST":
            answer = await self._post(request.headers, request.scope, request.receive, tenant)
            return _ACCEPTED if answer is None else answer
        if request.method == "GET":
            found = self._get(request.headers, tenant)
            return found if isinstance(found, Response) else SseResponse(*found)
        if request.method == "DELETE":
            return await self._delete(request, tenant)
        return _error(405, "use POST, GET or DELETE", {"Allow": "GET, POST, DELETE"})

    def _connection(
        self, headers: Mapping[str, str], tenant: str | None
    ) -> ServerHttpFrames | Response:
        connection_id = headers.get(_CONNECTION_ID)
        if not connection_id:
            return _error(400, f"missing {CONNECTION_ID_HEADER}")
        frames = self.http_connections.get(connection_id)
        if (
            frames is None
            or frames.closed.is_set()
            # another tenant's connection is answered as an unknown one
            or self._http_tenants.get(connection_id) != tenant
        ):
            return _error(404, f"unknown {CONNECTION_ID_HEADER}")
        return frames

    async def http_asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A `POST` or `GET` at `path` as plain ASGI: what the route does for it, without a
        `Request`, the router, or a `Response` for the 202 (`create_app` sends them here):
        one POST per prompt, and an SSE stream holds fewer frames for its whole life."""
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1").lower()
            if key not in headers:  # the first of repeated headers, as Starlette's `Headers`
                headers[key] = value.decode("latin-1")
        answer = self._refusal(headers, scope)
        stream: tuple[ServerHttpFrames, str | None] | None = None
        if answer is None:
            tenant = self._authenticate(headers)
            if isinstance(tenant, _Refused):
                answer = _unauthorized()
            elif scope["method"] == "GET":
                found = self._get(headers, tenant)
                if isinstance(found, Response):
                    answer = found
                else:
                    stream = found
            else:
                answer = await self._post(headers, scope, receive, tenant)
        del headers  # not held for the life of an SSE stream
        if stream is not None:
            # served from this frame, without an `SseResponse` and the frame of its call
            await stream[0].stream(stream[1], scope, receive, send)
        elif answer is None:
            if not send_accepted(scope, _ACCEPTED.raw_headers):
                await send(_ACCEPTED_START)
                await send(_EMPTY_BODY)
        else:
            await answer(scope, receive, send)

    async def _post(
        self, headers: Mapping[str, str], scope: Scope, receive: Receive, tenant: str | None
    ) -> Response | None:
        """The answer to a POST (lower-case `headers`), None for 202 Accepted."""
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            return _error(415, "POST a JSON-RPC message as application/json")
        complete = BODY_COMPLETE_EXTENSION in scope.get("extensions", ())
        body = await self._read_body(headers, receive, complete)
        if isinstance(body, Response):
            return body
        try:
            message: Any = jsonrpc.loads(body)  # as the engine parses it, at orjson's speed
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's
            return _error(400, "invalid JSON")
        if isinstance(message, list):
            return _error(400, "batches are not supported")
        if not isinstance(message, dict):
            return _error(400, "the body must be a JSON-RPC message (an object)")
        if _CONNECTION_ID not in headers:
            if message.get("method") != INITIALIZE:
                return _error(400, f"missing {CONNECTION_ID_HEADER}")
            if "id" not in message:
                return _error(400, "initialize must be a request (with an id)")
            address = self.client_address(scope)
            credential = self._credential(headers, tenant)
            return await self._initialize(body, message, tenant, address, credential)
        if message.get("method") == INITIALIZE:
            return _error(400, f"initialize opens a connection: no {CONNECTION_ID_HEADER}")
        found = self._connection(headers, tenant)
        if isinstance(found, Response):
            return found
        header_sid = headers.get(_SESSION_ID)
        message_scope: str | None = None
        if "method" in message:
            params_sid = message_session_id(message)
            if (params_sid is not None or header_sid is not None) and header_sid != params_sid:
                return _error(400, f"{SESSION_ID_HEADER} must equal params.sessionId")
            message_scope = params_sid
        try:
            await found.post(body, message, message_scope)
        except anyio.ClosedResourceError:
            return _error(404, f"unknown {CONNECTION_ID_HEADER}")
        return None

    async def _read_body(
        self, headers: Mapping[str, str], receive: Receive, complete: bool
    ) -> bytes | Response:
        """The body, read as it arrives against `max_message_bytes`: 413 as soon as it is
        exceeded (the rest is discarded by the ASGI server, never held), 408 when it takes
        longer than `body_timeout`. `complete`: the server has the whole body already (its
        `BODY_COMPLETE_EXTENSION`), so one `receive` returns it without waiting."""
        limit = self.max_message_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return _error(413, "message too large")
        first: Mapping[str, Any] | None = None
        if complete:
            first = await receive()
            if first["type"] == "http.request" and not first.get("more_body", False):
                body: bytes = first.get("body", b"")
                return body if len(body) <= limit else _error(413, "message too large")
        chunks: list[bytes] = []
        size = 0
        with anyio.move_on_after(self.body_timeout):
            while True:
                message = first if first is not None else await receive()
                first = None
                if message["type"] != "http.request":
                    return _error(400, "the client left before its body arrived")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    return _error(413, "message too large")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        return _error(408, "the body took too long", {"Connection": "close"})

    async def _initialize(
        self,
        body: bytes,
        message: dict[str, Any],
        tenant: str | None,
        address: str,
        credential: bytes | None,
    ) -> Response:
        refused = "too many connections" if self._full() else None
        refused = refused or self._unopened_refusal(address, tenant)
        if refused is not None:
            self.rejected += 1
            return _error(503, refused, {"Retry-After": "1"})
        connection_id = self.connection_prefix + uuid.uuid4().hex
        frames = ServerHttpFrames(
            connection_id,
            write_timeout=self.write_timeout,
            keepalive=self.sse_keepalive,
            on_close=lambda: self._forget_http(connection_id),
        )
        self.http_connections[connection_id] = frames
        self._unopened_http.add(connection_id)
        self._http_tenants[connection_id] = tenant
        self._http_addresses[connection_id] = address
        if credential is not None and tenant is not None:
            self._credentials[connection_id] = (credential, tenant)
        self.accepted += 1
        # A plain asyncio task, not one of the lifespan's task group: the engine outlives the
        # POST that starts it, and an anyio task costs ~2.6 KiB more for as long as it runs (a
        # handle with an event and its queue of waiters, a wrapper coroutine, a task state),
        # which an idle connection holds for its whole life. The lifespan ends those left
        # (`_end_http_tasks`), as its task group would.
        task = asyncio.get_running_loop().create_task(self._run_http(connection_id, frames, tenant))
        self._http_tasks.add(task)
        task.add_done_callback(self._http_tasks.discard)
        try:
            with anyio.fail_after(60):
                answer = await frames.call(body, message)
        except (anyio.ClosedResourceError, TimeoutError):
            await frames.aclose()
            return _error(500, "the connection ended before initialize was answered")
        if "error" in jsonrpc.loads(answer):
            await frames.aclose()
            return Response(answer, 500, media_type="application/json")
        return Response(
            answer,
            200,
            media_type="application/json",
            headers={CONNECTION_ID_HEADER: connection_id},
        )

    async def _run_http(
        self, connection_id: str, frames: ServerHttpFrames, tenant: str | None
    ) -> None:
        name = f"http-{connection_id[:12]}"
        try:
            if self._tg is not None:
                # the lifespan's HTTP sweeper ends it when idle or never opened (`_sweep_http`)
                await self._serve_connection(frames, name, tenant)
            else:
                await self._serve_frames(frames, name, tenant)
        except Exception:
            logger.exception("the HTTP connection %s failed", connection_id)
        finally:
            self._forget_http(connection_id)
            await frames.aclose()

    def _forget_http(self, connection_id: str) -> None:
        """Drop an HTTP connection from the tables (once it ends: its id then answers 404)."""
        self.http_connections.pop(connection_id, None)
        self._unopened_http.discard(connection_id)
        self._http_tenants.pop(connection_id, None)
        self._http_addresses.pop(connection_id, None)
        self._credentials.pop(connection_id, None)

    async def _serve_frames(self, frames: FrameStream, name: str, tenant: str | None) -> None:
        if self._tg is not None and isinstance(frames, ServerWebSocketFrames):
            # the lifespan's sweeper closes it when idle: no watching task of its own (with
            # 10,000 connections, a task group and a task each are ~4 KB per connection)
            await self._serve_connection(frames, name, tenant)
            return
        async with anyio.create_task_group() as watch:
            watch.start_soon(self._close_when_idle, frames, name)
            if isinstance(frames, ServerHttpFrames):
                watch.start_soon(self._close_unless_opened, frames, name)
            try:
                await self._serve_connection(frames, name, tenant)
            finally:
                watch.cancel_scope.cancel()

    async def _serve_connection(self, frames: FrameStream, name: str, tenant: str | None) -> None:
        if self._handler is not None:
            await self._handler(frames, name, tenant)
            return
        assert self.agent is not None
        # read in this task: no reader task per connection (idle connections are many)
        connection = AgentSideConnection(
            self.agent, frames, name=name, tenant=tenant, inline_reader=True
        )
        async with connection as conn:
            await conn.serve()

    async def _sweep_idle_websockets(self, timeout: float) -> None:
        """Close the WebSocket connections idle for `timeout` seconds, checking all of them a
        few times per timeout (a connection is closed within 1.25 timeouts of silence, and
        within 5 s past it for long timeouts). One task for every connection."""
        period = min(timeout / 4, 5.0)
        closing: set[ServerWebSocketFrames] = set()
        assert self._tg is not None
        tg = self._tg
        while True:
            await anyio.sleep(period)
            closing.intersection_update(self.connections.values())  # those that ended
            for connection_id, frames in list(self.connections.items()):
                if frames not in closing and frames.idle_for() >= timeout:
                    closing.add(frames)
                    tg.start_soon(self._close_idle, frames, f"ws-{connection_id[:12]}")

    async def _sweep_http(self) -> None:
        """End the HTTP connections idle for `idle_timeout` seconds, and those that opened no
        stream within `http_open_timeout` of their initialize, looking four times per timeout
        (at least every 5 s): one task for every connection, instead of a timer task each."""
        timeouts = [t for t in (self.idle_timeout, self.http_open_timeout) if t is not None]
        period = min([t / 4 for t in timeouts] + [5.0])
        idle = self.idle_timeout
        while True:
            await anyio.sleep(period)
            now = time.monotonic()
            self._unopened()  # forgets those opened or gone
            for connection_id in list(self._unopened_http):
                frames = self.http_connections[connection_id]
                if now - frames.created >= self.http_open_timeout:
                    self.unopened_closed += 1
                    logger.info(
                        "closing the connection http-%s: no stream opened", connection_id[:12]
                    )
                    frames.close()
            if idle is None:
                continue
            for connection_id, frames in list(self.http_connections.items()):
                if frames.idle_for() >= idle:
                    self.idle_closed += 1
                    logger.info(
                        "closing the connection http-%s: idle for %g s", connection_id[:12], idle
                    )
                    frames.close()

    async def _close_idle(self, frames: ServerWebSocketFrames, name: str) -> None:
        self.idle_closed += 1
        logger.info("closing the connection %s: idle for %g s", name, self.idle_timeout)
        await frames.close(CLOSE_NORMAL, "idle timeout")

    async def _close_unless_opened(self, frames: ServerHttpFrames, name: str) -> None:
        """End an HTTP connection that opened no SSE stream within `http_open_timeout`."""
        with anyio.move_on_after(self.http_open_timeout):
            await frames.opened.wait()
            return
        self.unopened_closed += 1
        logger.info("closing the connection %s: no stream opened", name)
        await frames.aclose()

    async def _close_when_idle(self, frames: FrameStream, name: str) -> None:
        """Close `frames` once no message went either way for `idle_timeout` seconds."""
        timeout = self.idle_timeout
        if timeout is None or not isinstance(frames, ServerWebSocketFrames | ServerHttpFrames):
            return
        while (remaining := timeout - frames.idle_for()) > 0:  # noqa: ASYNC110 (a timer)
            await anyio.sleep(remaining)
        self.idle_closed += 1
        logger.info("closing the connection %s: idle for %g s", name, timeout)
        if isinstance(frames, ServerWebSocketFrames):
            await frames.close(CLOSE_NORMAL, "idle timeout")
        else:
            await frames.aclose()

    def _get(
        self, headers: Mapping[str, str], tenant: str | None
    ) -> Response | tuple[ServerHttpFrames, str | None]:
        """The refusal of a GET, or the connection and scope of the stream it opens."""
        if "text/event-stream" not in headers.get("accept", ""):
            return _error(406, "GET needs Accept: text/event-stream (or a WebSocket upgrade)")
        found = self._connection(headers, tenant)
        if isinstance(found, Response):
            return found
        session_id = headers.get(_SESSION_ID) or None
        if found.reading(session_id):
            return _error(409, "this stream already has a reader")
        return found, session_id

    async def _delete(self, request: Request, tenant: str | None) -> Response:
        found = self._connection(request.headers, tenant)
        if isinstance(found, Response):
            return found
        await found.aclose()  # sessions survive, inactive (D30)
        return Response(status_code=202)

    async def _healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _ops_status(self, request: Request) -> Response:
        refused = self._refusal(request.headers, request.scope)
        if refused is not None:
            return refused
        # token-protected like /acp: it names sessions' owners and counts
        if not self.authorized(request.headers):
            return JSONResponse(
                {"error": "missing or wrong bearer token"},
                401,
                headers={"WWW-Authenticate": 'Bearer realm="acp"'},
            )
        status = getattr(self.agent, "ops_status", None)
        if status is None:
            return _error(404, "this agent reports no status")
        try:
            with anyio.fail_after(10):
                body = await status()
        except Exception:
            logger.exception("/ops/status failed")
            return _error(503, "status unavailable")
        body["connections"] = len(self.connections) + len(self.http_connections)
        return JSONResponse(body)


async def _deny(websocket: WebSocket, status: int, message: str, headers: dict[str, str]) -> None:
    """Refuse the upgrade with an HTTP answer where the server can send one (the ASGI
    denial-response extension), else close with 1008 (the server answers 403)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(JSONResponse({"error": message}, status, headers))
    else:
        await websocket.close(CLOSE_POLICY, message)


async def _deny_with(websocket: WebSocket, refused: Response) -> None:
    """`_deny` with an answer already made (the status and body of `refused`)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(refused)
    else:
        await websocket.close(CLOSE_POLICY, "refused")


async def _run(closing: Coroutine[Any, Any, None]) -> None:
    await closing


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"error": message}, status, headers=headers)


def _unauthorized() -> Response:
    return JSONResponse(
        {"error": "missing or wrong bearer token"},
        401,
        headers={"WWW-Authenticate": 'Bearer realm="acp"'},
    )


_CONNECTION_ID = CONNECTION_ID_HEADER.lower()
_SESSION_ID = SESSION_ID_HEADER.lower()
_ACCEPTED = Response(status_code=202)
"""The answer to every POST but initialize (a Response may be sent any number of times)."""
_ACCEPTED_START: dict[str, Any] = {
    "type": "http.response.start",
    "status": 202,
    "headers": _ACCEPTED.raw_headers,
}
_EMPTY_BODY: dict[str, Any] = {"type": "http.response.body", "body": b"", "more_body": False}


def _at_acp_path(scope: Scope, path: str) -> bool:
    """An HTTP request `AcpServer.http_asgi` serves: a POST or GET at the ACP path."""
    return scope["path"] == path and scope["method"] in ("POST", "GET")


class _HttpFirst:
    """The app's outermost layer below Starlette's error handler: a `POST` or `GET` at the ACP
    path goes straight to `AcpServer.http_asgi`; everything else (WebSocket upgrades too) to
    the router."""

    def __init__(self, app: ASGIApp, server: AcpServer) -> None:
        self.app = app
        self.server = server
        self.path = server.path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _at_acp_path(scope, self.path):
            await self.server.http_asgi(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def create_app(
    agent: Agent | None,
    *,
    token: str | None = None,
    tokens: Mapping[str, str] | None = None,
    path: str = "/acp",
    handler: ConnectionHandler | None = None,
    limits: ServerLimits = DEFAULT_LIMITS,
    timeouts: ServerTimeouts = DEFAULT_TIMEOUTS,
    allowed_origins: Iterable[str] = (),
    allowed_hosts: Iterable[str] = (),
    forwarded_allow_ips: Iterable[str] = (),
    connection_prefix: str = "",
    **options: Unpack[ServerOptions],
) -> Starlette:
    """A Starlette app serving `agent` (entered by the caller) at `path`; see the module
    docstring. `app.state.acp` is its `AcpServer`. With `handler`, each connection is served
    by it instead (the bridge's use; `agent` may then be None).

    `limits` and `timeouts` (`ServerLimits`, `ServerTimeouts`) bound what the server holds
    and how long it waits; a single one may be given as a keyword instead (`ServerOptions`:
    `max_connections=`, `idle_timeout=`, ...), which replaces that field.

    `allowed_origins` and `allowed_hosts` extend the `Origin` and `Host` checks (module
    docstring; `"*"` turns one off). `forwarded_allow_ips`: the reverse proxies (addresses,
    networks, `"*"`) whose `X-Forwarded-For`/`Forwarded` headers name the client for the
    per-address caps and the logs (none by default: `acp_once.server.proxies`).

    `tokens` ({tenant name: token}) serves several tenants instead of one `token` (module
    docstring).

    `connection_prefix`: what every issued `Acp-Connection-Id` begins with, e.g. `n1.` (up to
    64 letters, digits, `_` or `-`, then a dot; module docstring); none by default.

    Raises:
        ValueError: neither an agent nor a handler, an empty token, both `token` and
            `tokens`, a non-positive limit or timeout, a proxy that is not an address, or a
            `connection_prefix` of other characters.
        TypeError: an unknown option.
    """
    server = AcpServer(
        agent,
        token=token,
        tokens=tokens,
        path=path,
        handler=handler,
        limits=limits,
        timeouts=timeouts,
        allowed_origins=allowed_origins,
        allowed_hosts=allowed_hosts,
        forwarded_allow_ips=forwarded_allow_ips,
        connection_prefix=connection_prefix,
        **options,
    )
    # a WebSocket to any other path is answered 404, not Starlette's bare close (403, which a
    # client would take for a refused token)
    routes = [*server.routes(), WebSocketRoute("/{path:path}", _no_endpoint)]
    app = _AcpApp(
        server,
        routes=routes,
        lifespan=server.lifespan,
        middleware=[Middleware(_HttpFirst, server=server)],
    )
    app.state.acp = server
    return app


class _AcpApp(Starlette):
    """Starlette, with WebSockets, POSTs and GETs at the ACP path handed to `AcpServer`
    directly (unless middleware was added beyond the app's own `_HttpFirst`, which then
    routes them): Starlette's middleware and routing would stay on the stack of every
    connection's task and SSE stream while it lives, ~4 KiB each, and cost every POST its
    frames, for nothing (the handlers catch their own errors; uvicorn answers 500 to one that
    escapes before a response, as Starlette's error handler would). Everything else goes
    through Starlette."""

    def __init__(self, server: AcpServer, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._acp = server
        self._own_middleware = len(self.user_middleware)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if len(self.user_middleware) == self._own_middleware:
            kind = scope["type"]
            if kind == "http":
                if _at_acp_path(scope, self._acp.path):
                    scope["app"] = self
                    await self._acp.http_asgi(scope, receive, send)
                    return
            elif kind == "websocket":
                path: str = scope["path"]
                root: str = scope.get("root_path", "")
                if root and path.startswith(root):
                    path = path[len(root) :]
                if path == self._acp.path:
                    scope["app"] = self
                    await self._acp._websocket(WebSocket(scope, receive, send))
                    return
        await super().__call__(scope, receive, send)


async def _no_endpoint(websocket: WebSocket) -> None:
    await _deny(websocket, 404, "no ACP endpoint at this path", {})
