"""ACP v2 method names, and which wire models their params and results use.

This is the explicit table the typed faces dispatch on (no reflection on names). Each entry
names the method, its params model and its result model (None for notifications).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter

from acp_once.protocol import schema as s

__all__ = [
    "AGENT_METHODS",
    "AUTH_LOGIN",
    "AUTH_LOGOUT",
    "CANCEL_REQUEST",
    "CLIENT_METHODS",
    "INITIALIZE",
    "SESSION_CANCEL",
    "SESSION_CLOSE",
    "SESSION_DELETE",
    "SESSION_FORK",
    "SESSION_LIST",
    "SESSION_NEW",
    "SESSION_PROMPT",
    "SESSION_REQUEST_PERMISSION",
    "SESSION_RESUME",
    "SESSION_SET_CONFIG_OPTION",
    "SESSION_UPDATE",
    "TERMINAL_CANCEL",
    "TOOL_CALL_CANCEL",
    "MethodSpec",
    "SetSessionConfigOptionParams",
    "to_wire",
]

INITIALIZE = "initialize"
AUTH_LOGIN = "auth/login"
AUTH_LOGOUT = "auth/logout"
SESSION_NEW = "session/new"
SESSION_LIST = "session/list"
SESSION_RESUME = "session/resume"
SESSION_CLOSE = "session/close"
SESSION_DELETE = "session/delete"
SESSION_FORK = "session/fork"
SESSION_PROMPT = "session/prompt"
SESSION_CANCEL = "session/cancel"
SESSION_SET_CONFIG_OPTION = "session/set_config_option"
TOOL_CALL_CANCEL = "tool_call/cancel"
TERMINAL_CANCEL = "terminal/cancel"
SESSION_UPDATE = "session/update"
SESSION_REQUEST_PERMISSION = "session/request_permission"
CANCEL_REQUEST = "$/cancel_request"

SetSessionConfigOptionParams = (
    s.SetSessionConfigOptionRequestId
    | s.SetSessionConfigOptionRequestBoolean
    | s.SetSessionConfigOptionRequestOther
)


def to_wire(model: Any) -> Any:
    """The JSON-ready form of a wire model (camelCase, unset fields left out); anything else
    (a dict already in wire form) is returned as it is."""
    if isinstance(model, BaseModel):
        return model.model_dump(by_alias=True, exclude_unset=True)
    return model


@dataclass(frozen=True, slots=True)
class MethodSpec:
    """One method: its name, how to validate its params, and its result model."""

    method: str
    params: TypeAdapter[Any]
    result: type[Any] | None
    notification: bool = False


# An adapter over a union builds its validator at once unless told to wait; a model's
# adapter already waits (the models' own `defer_build`). Built at import, the union cost a few
# milliseconds of every process's start, for a method most sessions never call.
_DEFERRED = ConfigDict(defer_build=True)


def _spec(method: str, params: Any, result: type[Any] | None) -> MethodSpec:
    is_model = isinstance(params, type) and issubclass(params, BaseModel)
    adapter = TypeAdapter(params) if is_model else TypeAdapter(params, config=_DEFERRED)
    return MethodSpec(method, adapter, result, notification=result is None)


AGENT_METHODS: dict[str, MethodSpec] = {
    m.method: m
    for m in (
        _spec(INITIALIZE, s.InitializeRequest, s.InitializeResponse),
        _spec(AUTH_LOGIN, s.LoginAuthRequest, s.LoginAuthResponse),
        _spec(AUTH_LOGOUT, s.LogoutAuthRequest, s.LogoutAuthResponse),
        _spec(SESSION_NEW, s.NewSessionRequest, s.NewSessionResponse),
        _spec(SESSION_LIST, s.ListSessionsRequest, s.ListSessionsResponse),
        _spec(SESSION_RESUME, s.ResumeSessionRequest, s.ResumeSessionResponse),
        _spec(SESSION_CLOSE, s.CloseSessionRequest, s.CloseSessionResponse),
        _spec(SESSION_DELETE, s.DeleteSessionRequest, s.DeleteSessionResponse),
        _spec(SESSION_FORK, s.ForkSessionRequest, s.ForkSessionResponse),
        _spec(SESSION_PROMPT, s.PromptRequest, s.PromptResponse),
        _spec(
            SESSION_SET_CONFIG_OPTION,
            SetSessionConfigOptionParams,
            s.SetSessionConfigOptionResponse,
        ),
        _spec(TOOL_CALL_CANCEL, s.CancelToolCallRequest, s.CancelToolCallResponse),
        _spec(TERMINAL_CANCEL, s.CancelTerminalRequest, s.CancelTerminalResponse),
        _spec(SESSION_CANCEL, s.CancelSessionNotification, None),
    )
}
"""Methods an agent handles (client to agent)."""

CLIENT_METHODS: dict[str, MethodSpec] = {
    m.method: m
    for m in (
        _spec(SESSION_UPDATE, s.UpdateSessionNotification, None),
        _spec(SESSION_REQUEST_PERMISSION, s.RequestPermissionRequest, s.RequestPermissionResponse),
    )
}
"""Methods a client handles (agent to client)."""
