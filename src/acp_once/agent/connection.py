"""Binds an `Agent` to a JSON-RPC connection, with typed calls back to the client.

Inbound requests are dispatched through an explicit table (method name -> params model ->
handler); the initialize rules are enforced by `InitializeGate` before anything is dispatched.
The first `initialize` that succeeds fixes the connection's protocol version
(`route_initialize`): v2 is served natively, v1 through a `V1Face` (`acp_once.agent.v1face`)
that translates between the client and the agent, which sees v2 only.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Self

import anyio
from pydantic import ValidationError

from acp_once.agent.calls import CallContext
from acp_once.agent.interface import Agent
from acp_once.protocol import methods as m
from acp_once.protocol import schema as s
from acp_once.protocol.initialization import InitializeGate, route_initialize
from acp_once.protocol.methods import to_wire
from acp_once.rpc.connection import Connection, RequestContext
from acp_once.rpc.streams import FrameStream

if TYPE_CHECKING:
    from acp_once.agent.v1face import V1Face

_logger = logging.getLogger("acp_once.agent")

__all__ = ["AgentSideConnection", "CallContext", "ClientPeer", "to_wire"]

_connection_ids = itertools.count(1)


class ClientPeer:
    """Typed calls from the agent to the client on one connection."""

    def __init__(self, connection: Connection) -> None:
        self._conn = connection
        self.v1_face: V1Face | None = None
        """Set on a v1 connection: updates and permission requests go out in v1's shape."""

    async def session_update(self, params: s.UpdateSessionNotification | dict[str, Any]) -> None:
        """Send a `session/update` notification (translated to v1 on a v1 connection).

        Raises:
            ConnectionClosed: the connection has ended.
        """
        if self.v1_face is not None:
            wire = to_wire(params)
            await self.v1_face.session_update(wire["sessionId"], wire["update"])
            return
        await self._conn.notify(m.SESSION_UPDATE, to_wire(params))

    async def request_permission(
        self, params: s.RequestPermissionRequest, *, timeout: float | None = None
    ) -> s.RequestPermissionResponse:
        """Ask the client's user for permission.

        Raises:
            AcpError: the client answered with an error.
            ConnectionClosed: the connection ended first.
            RequestTimeout: no answer within `timeout` (a `$/cancel_request` was sent).
        """
        if self.v1_face is not None:
            return await self.v1_face.request_permission(params, timeout=timeout)
        result = await self._conn.request(
            m.SESSION_REQUEST_PERMISSION, to_wire(params), timeout=timeout
        )
        return s.RequestPermissionResponse.model_validate(result)

    async def ext_request(
        self, method: str, params: Any = None, *, timeout: float | None = None
    ) -> Any:
        """Send any other request (extensions); returns the raw result."""
        return await self._conn.request(method, params, timeout=timeout)

    async def ext_notification(self, method: str, params: Any = None) -> None:
        """Send any other notification (extensions)."""
        await self._conn.notify(method, params)


_Route = Callable[[Any, CallContext], Awaitable[Any]]

# The explicit dispatch table: method -> the name of the `Agent` method that handles it, shared
# by every connection so that an idle connection holds no table of its own; the handler is
# looked up on the connection's agent per call. Params models come
# from acp_once.protocol.methods.AGENT_METHODS. `initialize` is not in it: its params are read
# by `route_initialize` before any model (they decide the version).
_ROUTES: dict[str, str] = {
    m.AUTH_LOGIN: "login",
    m.AUTH_LOGOUT: "logout",
    m.SESSION_NEW: "new_session",
    m.SESSION_LIST: "list_sessions",
    m.SESSION_RESUME: "resume_session",
    m.SESSION_CLOSE: "close_session",
    m.SESSION_DELETE: "delete_session",
    m.SESSION_FORK: "fork_session",
    m.SESSION_PROMPT: "prompt",
    m.SESSION_SET_CONFIG_OPTION: "set_config_option",
    m.TOOL_CALL_CANCEL: "cancel_tool_call",
    m.TERMINAL_CANCEL: "cancel_terminal",
}
_NOTIFICATION_ROUTES: dict[str, str] = {m.SESSION_CANCEL: "cancel"}


@functools.cache
def param_validators() -> dict[str, Callable[[Any], Any]]:
    """The params validator of each method an `AgentSideConnection` routes (`initialize`
    included), looked up once per process and shared by every connection."""
    return {
        method: m.AGENT_METHODS[method].params.validate_python
        for method in (m.INITIALIZE, *_ROUTES, *_NOTIFICATION_ROUTES)
    }


class AgentSideConnection(anyio.AsyncContextManagerMixin):
    """Serves one `Agent` on one frame stream.

    Use as `async with AgentSideConnection(agent, stream) as conn: await conn.wait_closed()`.

    The connection's protocol version is fixed by the first `initialize` that succeeds
    (`version`: None before, then 1 or 2); a v1 connection is served by its `v1_face`.

    `tenant` is who the connection was authenticated as (the name of the token that matched
    in `acp-once serve --tokens`), fixed for the connection's life; None (stdio, a single
    token) is the single-tenant case. `SessionAgent` shows a connection only its tenant's
    sessions.

    With `inline_reader`, the client's messages are read by the task that awaits `serve()`
    (`async with ... as conn: await conn.serve()`), not by a task of the connection's own.
    """

    def __init__(
        self,
        agent: Agent,
        stream: FrameStream,
        *,
        name: str | None = None,
        max_inflight: int = 256,
        tenant: str | None = None,
        inline_reader: bool = False,
    ) -> None:
        self.agent = agent
        self.id = f"conn-{next(_connection_ids)}"
        self.tenant = tenant
        self._gate = InitializeGate()
        self._rpc = Connection(
            stream,
            on_request=self._on_request,
            on_notification=self._on_notification,
            gate=self._gate,
            max_inflight=max_inflight,
            name=name or self.id,
            cooperative_cancel=agent.cooperative_cancel,
            inline_reader=inline_reader,
        )
        self.client = ClientPeer(self._rpc)
        self._client_info: s.InitializeRequest | bytes | None = None
        self.version: int | None = None
        self._validators = param_validators()

    @property
    def client_info(self) -> s.InitializeRequest | None:
        """What the client's `initialize` said about it (None before `initialize`)."""
        info = self._client_info
        if isinstance(info, bytes):
            info = self._client_info = s.InitializeRequest.model_validate_json(info)
        return info

    @client_info.setter
    def client_info(self, request: s.InitializeRequest | None) -> None:
        # Kept as its JSON, validated again when read: a validated request is ~1.3 KiB and few
        # agents read it, while an idle server holds one per connection.
        self._client_info = (
            None
            if request is None
            else request.model_dump_json(by_alias=True, exclude_unset=True).encode()
        )

    @property
    def v1_face(self) -> V1Face | None:
        """What serves a v1 connection (None on v2, and before `initialize`); kept by the
        `ClientPeer`, whose calls to the client go through it too."""
        return self.client.v1_face

    @property
    def rpc(self) -> Connection:
        """The underlying JSON-RPC connection."""
        return self._rpc

    @contextlib.asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncIterator[Self]:
        try:
            async with self._rpc:
                yield self
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                await self.agent.connection_closed(self)

    @property
    def closed(self) -> bool:
        return self._rpc.closed

    async def wait_closed(self) -> None:
        """Wait until the client goes away."""
        await self._rpc.wait_closed()

    async def serve(self) -> None:
        """Serve the client until it goes away: with `inline_reader`, its messages are read
        in this task (one task less per connection; call it once); otherwise the same as
        `wait_closed`."""
        await self._rpc.serve()

    async def _initialize(self, params: dict[str, Any] | None, ctx: CallContext) -> Any:
        """Answer `initialize` in the version it selects; the first success fixes the version
        (the initialize gate lets no other request run meanwhile)."""
        version, fields = route_initialize(params, self.version)
        if version == 1:
            from acp_once.agent.v1face import V1Face  # only v1 connections need it

            face = self.v1_face or V1Face(self)
            result = await face.initialize(fields, ctx)
            self.client.v1_face = face
            self.version = 1
            self._rpc.refuse_batches("Batches are not supported on ACP v1 connections")  # D42
            return result
        typed = self._validators[m.INITIALIZE](fields)
        result = to_wire(await self.agent.initialize(typed, ctx))
        self.client_info = typed
        self.version = 2
        return result

    async def _on_request(
        self, method: str, params: dict[str, Any] | None, req: RequestContext
    ) -> Any:
        ctx = CallContext(self, req)
        if method == m.INITIALIZE:
            return await self._initialize(params, ctx)
        face = self.v1_face
        if face is not None:
            return await face.handle_request(method, params, ctx)
        handler = _ROUTES.get(method)
        if handler is None:
            return await self.agent.ext_method(method, params, ctx)
        typed = self._validators[method](params or {})
        route: _Route = getattr(self.agent, handler)
        return to_wire(await route(typed, ctx))

    async def _on_notification(self, method: str, params: dict[str, Any] | None) -> None:
        ctx = CallContext(self, None)
        if self.v1_face is not None:
            await self.v1_face.handle_notification(method, params, ctx)
            return
        handler = _NOTIFICATION_ROUTES.get(method)
        if handler is None:
            if method != m.CANCEL_REQUEST:
                await self.agent.ext_notification(method, params, ctx)
            return
        try:
            typed = self._validators[method](params or {})
        except ValidationError as exc:
            # a notification has no answer to carry the error: the client's mistake is logged
            # (without its values, which could quote a key) and the notification dropped
            _logger.warning(
                "%s: dropped a %s notification with invalid params (%d errors)",
                self.id,
                method,
                exc.error_count(),
            )
            return
        route: _Route = getattr(self.agent, handler)
        await route(typed, ctx)
