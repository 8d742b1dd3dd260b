"""The `Client` an application writes: handlers for what the agent sends.

Subclass `Client` and override what you need. `session_update` receives every `session/update`
in arrival order; `request_permission` answers the agent's permission requests (by default the
request is answered `cancelled`, which an agent must treat as "not approved").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from acp_once.protocol import schema as s
from acp_once.protocol.errors import MethodNotFound

if TYPE_CHECKING:
    from acp_once.client.connection import ClientSideConnection

__all__ = ["Client"]


class Client:
    """Base class for clients."""

    async def session_update(self, params: s.UpdateSessionNotification) -> None:
        """A `session/update` arrived. Runs in the reader: do not wait for agent answers here."""
        return None

    async def request_permission(
        self, params: s.RequestPermissionRequest, connection: ClientSideConnection
    ) -> s.RequestPermissionResponse:
        return s.RequestPermissionResponse.model_validate({"outcome": {"outcome": "cancelled"}})

    async def ext_method(self, method: str, params: dict[str, Any] | None) -> Any:
        raise MethodNotFound(f"Method not found: {method}")

    async def ext_notification(self, method: str, params: dict[str, Any] | None) -> None:
        return None
