"""The `Agent` an agent author writes: one async method per client-to-agent method.

Subclass `Agent` and override what your agent supports; every method you leave alone answers
-32601 (method not found). Each handler receives the validated params model and a `CallContext`
(the connection it arrived on, with typed calls back to the client, and the request's own
context for cancellation). Return the result model; raise an `acp_once.protocol.errors.AcpError`
subclass to answer with an error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from acp_once.protocol import schema as s
from acp_once.protocol.errors import MethodNotFound
from acp_once.protocol.methods import SetSessionConfigOptionParams

if TYPE_CHECKING:
    from acp_once.agent.calls import AgentConnection, CallContext

__all__ = ["Agent"]


class Agent:
    """Base class for agents. One instance may serve many connections at once."""

    cooperative_cancel: frozenset[str] = frozenset()
    """Methods whose handlers decide what `$/cancel_request` means through
    `ctx.request.on_cancel` (see `RequestContext`); the engine cancels all others itself."""

    async def initialize(
        self, params: s.InitializeRequest, ctx: CallContext
    ) -> s.InitializeResponse:
        raise MethodNotFound("initialize is not implemented")

    async def login(self, params: s.LoginAuthRequest, ctx: CallContext) -> s.LoginAuthResponse:
        raise MethodNotFound("auth/login is not supported")

    async def logout(self, params: s.LogoutAuthRequest, ctx: CallContext) -> s.LogoutAuthResponse:
        raise MethodNotFound("auth/logout is not supported")

    async def new_session(
        self, params: s.NewSessionRequest, ctx: CallContext
    ) -> s.NewSessionResponse:
        raise MethodNotFound("session/new is not supported")

    async def list_sessions(
        self, params: s.ListSessionsRequest, ctx: CallContext
    ) -> s.ListSessionsResponse:
        raise MethodNotFound("session/list is not supported")

    async def resume_session(
        self, params: s.ResumeSessionRequest, ctx: CallContext
    ) -> s.ResumeSessionResponse:
        raise MethodNotFound("session/resume is not supported")

    async def close_session(
        self, params: s.CloseSessionRequest, ctx: CallContext
    ) -> s.CloseSessionResponse:
        raise MethodNotFound("session/close is not supported")

    async def delete_session(
        self, params: s.DeleteSessionRequest, ctx: CallContext
    ) -> s.DeleteSessionResponse:
        raise MethodNotFound("session/delete is not supported")

    async def fork_session(
        self, params: s.ForkSessionRequest, ctx: CallContext
    ) -> s.ForkSessionResponse:
        raise MethodNotFound("session/fork is not supported")

    async def prompt(self, params: s.PromptRequest, ctx: CallContext) -> s.PromptResponse:
        raise MethodNotFound("session/prompt is not supported")

    async def set_config_option(
        self, params: SetSessionConfigOptionParams, ctx: CallContext
    ) -> s.SetSessionConfigOptionResponse:
        raise MethodNotFound("session/set_config_option is not supported")

    async def cancel_tool_call(
        self, params: s.CancelToolCallRequest, ctx: CallContext
    ) -> s.CancelToolCallResponse:
        raise MethodNotFound("tool_call/cancel is not supported")

    async def cancel_terminal(
        self, params: s.CancelTerminalRequest, ctx: CallContext
    ) -> s.CancelTerminalResponse:
        raise MethodNotFound("terminal/cancel is not supported")

    async def cancel(self, params: s.CancelSessionNotification, ctx: CallContext) -> None:
        """`session/cancel` (a notification): stop the session's foreground work."""
        return None

    async def ext_method(self, method: str, params: dict[str, Any] | None, ctx: CallContext) -> Any:
        """A request this table does not know (`_custom` extensions, unstable extras)."""
        raise MethodNotFound(f"Method not found: {method}")

    async def ext_notification(
        self, method: str, params: dict[str, Any] | None, ctx: CallContext
    ) -> None:
        """A notification this table does not know; ignored by default."""
        return None

    async def connection_closed(self, connection: AgentConnection) -> None:
        """Called once when a connection ends (its sessions stop being active on it)."""
        return None
