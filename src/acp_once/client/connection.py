"""Binds a `Client` to a JSON-RPC connection, with typed calls to the agent.

A connection to an ACP v1 agent (`use_v1(...)`, after its `initialize` answer said so) hands
the `Client` the same typed v2 objects as a v2 one: what the agent sends is read through the
`Incoming` it is given (`acp_once.protocol.v1_to_v2.V1ToV2Messages`: v1 `session/update`s
translated, v1 permission requests as v2 ones; the answers have one shape in both versions).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, Self, TypeVar

import anyio
from pydantic import BaseModel

from acp_once.protocol import methods as m
from acp_once.protocol import schema as s
from acp_once.protocol.methods import SetSessionConfigOptionParams, to_wire
from acp_once.protocol.updates import validate_update_notification
from acp_once.rpc.connection import Connection, PendingCall, RequestContext
from acp_once.rpc.streams import FrameStream

__all__ = ["AgentPeer", "ClientSideConnection", "Handlers", "Incoming"]

_M = TypeVar("_M", bound=BaseModel)


class AgentPeer:
    """Typed calls from the client to the agent on one connection.

    Every request method raises `AcpError` (the agent answered with an error; e.g.
    `SessionNotFound`), `ConnectionClosed` (the outcome is unknown), or `RequestTimeout`.
    """

    def __init__(self, connection: Connection) -> None:
        self._conn = connection

    async def _call(self, method: str, params: Any, result: type[_M], timeout: float | None) -> _M:
        raw = await self._conn.request(method, to_wire(params), timeout=timeout)
        return result.model_validate(raw)

    async def initialize(
        self, params: s.InitializeRequest, *, timeout: float | None = 60.0
    ) -> s.InitializeResponse:
        return await self._call(m.INITIALIZE, params, s.InitializeResponse, timeout)

    async def new_session(
        self, params: s.NewSessionRequest, *, timeout: float | None = 60.0
    ) -> s.NewSessionResponse:
        return await self._call(m.SESSION_NEW, params, s.NewSessionResponse, timeout)

    async def list_sessions(
        self, params: s.ListSessionsRequest, *, timeout: float | None = 60.0
    ) -> s.ListSessionsResponse:
        return await self._call(m.SESSION_LIST, params, s.ListSessionsResponse, timeout)

    async def resume_session(
        self, params: s.ResumeSessionRequest, *, timeout: float | None = 300.0
    ) -> s.ResumeSessionResponse:
        return await self._call(m.SESSION_RESUME, params, s.ResumeSessionResponse, timeout)

    async def close_session(
        self, params: s.CloseSessionRequest, *, timeout: float | None = 60.0
    ) -> s.CloseSessionResponse:
        return await self._call(m.SESSION_CLOSE, params, s.CloseSessionResponse, timeout)

    async def delete_session(
        self, params: s.DeleteSessionRequest, *, timeout: float | None = 60.0
    ) -> s.DeleteSessionResponse:
        return await self._call(m.SESSION_DELETE, params, s.DeleteSessionResponse, timeout)

    async def fork_session(
        self, params: s.ForkSessionRequest, *, timeout: float | None = 60.0
    ) -> s.ForkSessionResponse:
        return await self._call(m.SESSION_FORK, params, s.ForkSessionResponse, timeout)

    async def prompt(
        self, params: s.PromptRequest, *, timeout: float | None = None
    ) -> s.PromptResponse:
        """Send `session/prompt`; returns once the agent inserted the message (a held prompt
        waits, so the default is no timeout)."""
        return await self._call(m.SESSION_PROMPT, params, s.PromptResponse, timeout)

    async def start_prompt(self, params: s.PromptRequest) -> PendingCall:
        """Send `session/prompt` and return the pending call (to cancel it or wait later)."""
        return await self._conn.start_request(m.SESSION_PROMPT, to_wire(params))

    async def set_config_option(
        self, params: SetSessionConfigOptionParams, *, timeout: float | None = 60.0
    ) -> s.SetSessionConfigOptionResponse:
        return await self._call(
            m.SESSION_SET_CONFIG_OPTION, params, s.SetSessionConfigOptionResponse, timeout
        )

    async def cancel(self, params: s.CancelSessionNotification) -> None:
        """Send `session/cancel` (a notification; never resent)."""
        await self._conn.notify(m.SESSION_CANCEL, to_wire(params))

    async def ext_request(
        self, method: str, params: Any = None, *, timeout: float | None = 60.0
    ) -> Any:
        return await self._conn.request(method, params, timeout=timeout)

    async def ext_notification(self, method: str, params: Any = None) -> None:
        await self._conn.notify(method, params)


_Route = Callable[[Any], Awaitable[Any]]


class Incoming(Protocol):
    """How a connection reads what the agent sends, as the v2 models its `Client` gets."""

    def session_updates(self, params: dict[str, Any] | None) -> list[s.UpdateSessionNotification]:
        """The notifications for the params of a `session/update` (pydantic's
        `ValidationError` when they are not valid)."""
        ...

    def permission_request(self, params: dict[str, Any] | None) -> s.RequestPermissionRequest:
        """The request for the params of a `session/request_permission` (pydantic's
        `ValidationError` when they are not valid)."""
        ...


class _V2Incoming:
    """A v2 agent's messages: validated as they are."""

    def session_updates(self, params: dict[str, Any] | None) -> list[s.UpdateSessionNotification]:
        return [validate_update_notification(params)]

    def permission_request(self, params: dict[str, Any] | None) -> s.RequestPermissionRequest:
        return s.RequestPermissionRequest.model_validate(params or {})


class Handlers(Protocol):
    """What a connection calls on the application's side: `Client` (client/interface.py) and
    any class with these four coroutines. A protocol, so that this module needs no import of the
    `Client` base class, whose handlers take this connection."""

    async def session_update(self, params: s.UpdateSessionNotification) -> None: ...

    async def request_permission(
        self, params: s.RequestPermissionRequest, connection: ClientSideConnection
    ) -> s.RequestPermissionResponse: ...

    async def ext_method(self, method: str, params: dict[str, Any] | None) -> Any: ...

    async def ext_notification(self, method: str, params: dict[str, Any] | None) -> None: ...


class ClientSideConnection(anyio.AsyncContextManagerMixin):
    """Serves one `Client` on one frame stream and gives typed calls to the agent (`.agent`).

    Use as `async with ClientSideConnection(client, stream) as conn:`.
    """

    def __init__(self, client: Handlers, stream: FrameStream, *, name: str = "client") -> None:
        self.client: Handlers = client
        self._rpc = Connection(
            stream, on_request=self._on_request, on_notification=self._on_notification, name=name
        )
        self.agent = AgentPeer(self._rpc)
        self.protocol_version = 2
        self._incoming: Incoming = _V2Incoming()

    @property
    def rpc(self) -> Connection:
        return self._rpc

    @property
    def closed(self) -> bool:
        return self._rpc.closed

    async def wait_closed(self) -> None:
        await self._rpc.wait_closed()

    def use_v1(self, incoming: Incoming) -> None:
        """The agent speaks ACP v1: read what it sends through `incoming` (its translation into
        v2) from now on, and send no batches (`rpc.start_batch` raises `BatchRefused`, D42)."""
        self.protocol_version = 1
        self._incoming = incoming
        self._rpc.refuse_batches("Batches are not supported on ACP v1 connections")

    @contextlib.asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncIterator[Self]:
        async with self._rpc:
            yield self

    async def _on_request(
        self, method: str, params: dict[str, Any] | None, req: RequestContext
    ) -> Any:
        if method == m.SESSION_REQUEST_PERMISSION:
            typed = self._incoming.permission_request(params)
            return to_wire(await self.client.request_permission(typed, self))
        return await self.client.ext_method(method, params)

    async def _on_notification(self, method: str, params: dict[str, Any] | None) -> None:
        if method == m.SESSION_UPDATE:
            for update in self._incoming.session_updates(params):
                await self.client.session_update(update)
        elif method != m.CANCEL_REQUEST:
            await self.client.ext_notification(method, params)
