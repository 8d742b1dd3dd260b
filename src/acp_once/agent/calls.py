"""What an `Agent`'s handler is given: `CallContext`, and the connection it names.

The connection is described by protocols (`AgentConnection`, `Peer`, `Face`) rather than by
`AgentSideConnection` itself, so that the `Agent` interface and the v1 face know the connection
without importing the module that implements it (`acp_once.agent.connection`, which imports
both): no import cycle, even for type checking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from acp_once.protocol import schema as s
    from acp_once.rpc.connection import Connection, RequestContext

__all__ = ["AgentConnection", "CallContext", "Face", "Peer"]


class Peer(Protocol):
    """Typed calls from the agent to the client on one connection (`ClientPeer`)."""

    async def session_update(self, params: s.UpdateSessionNotification | dict[str, Any]) -> None:
        """Send a `session/update` notification (translated to v1 on a v1 connection)."""
        ...

    async def request_permission(
        self, params: s.RequestPermissionRequest, *, timeout: float | None = None
    ) -> s.RequestPermissionResponse:
        """Ask the client's user for permission."""
        ...

    async def ext_request(
        self, method: str, params: Any = None, *, timeout: float | None = None
    ) -> Any:
        """Send any other request (extensions); returns the raw result."""
        ...

    async def ext_notification(self, method: str, params: Any = None) -> None:
        """Send any other notification (extensions)."""
        ...


class Face(Protocol):
    """What serves a v1 connection (`acp_once.agent.v1face.V1Face`), as its users see it."""

    async def session_update(self, session_id: str, update: dict[str, Any]) -> None:
        """Send a v2 update of `session_id` to the v1 client, translated."""
        ...

    def turn_ended(self, session_id: str, message_id: str, idle: dict[str, Any]) -> None:
        """The turn of `message_id` ended with the idle update `idle`."""
        ...


class AgentConnection(Protocol):
    """The connection a call arrived on (`AgentSideConnection`), as a handler uses it."""

    @property
    def id(self) -> str:
        """Unique in this process."""
        ...

    @property
    def tenant(self) -> str | None:
        """Who the connection was authenticated as (None: the single-tenant case)."""
        ...

    @property
    def agent(self) -> Any:
        """The `Agent` it serves."""
        ...

    @property
    def client(self) -> Peer:
        """Calls to the client."""
        ...

    @property
    def rpc(self) -> Connection:
        """The underlying JSON-RPC connection."""
        ...

    @property
    def v1_face(self) -> Face | None:
        """What serves a v1 connection (None on v2, and before `initialize`)."""
        ...

    client_info: s.InitializeRequest | None
    """What the client's `initialize` said about it."""


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a handler knows about the call it serves.

    Attributes:
        connection: the connection the call arrived on (its `id` is unique in this process).
        request: the request's engine context (None for notifications); `request.on_cancel`
            lets a handler decide what `$/cancel_request` means for it.
    """

    connection: AgentConnection
    request: RequestContext | None

    @property
    def client(self) -> Peer:
        return self.connection.client
