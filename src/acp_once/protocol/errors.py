"""The ACP error tree and the one mapping between exceptions and JSON-RPC error objects.

    AcpError(code, message, data)          an error with a place on the wire
    ├── ParseError               -32700
    ├── InvalidRequest           -32600
    ├── MethodNotFound           -32601
    ├── InvalidParams            -32602
    ├── InternalError            -32603
    ├── RequestCancelled         -32800
    ├── AuthRequired             -32000
    ├── SessionNotFound          -32002   data: {"sessionId": ...}
    └── UnsupportedProtocolVersion -32022 data: {"requested": ..., "supported": [...]}

`RemoteError` (in `acp_once.rpc`) is what a caller catches when the peer answered with an error;
it carries the same code, message and data. Messages are one short sentence and never carry an
idempotency key or any other user input (keys are private).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import ValidationError

__all__ = [
    "AUTH_REQUIRED",
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "METHOD_NOT_FOUND",
    "PARSE_ERROR",
    "REQUEST_CANCELLED",
    "RESOURCE_NOT_FOUND",
    "UNSUPPORTED_PROTOCOL_VERSION",
    "AcpError",
    "AuthRequired",
    "InternalError",
    "InvalidParams",
    "InvalidRequest",
    "MethodNotFound",
    "ParseError",
    "RequestCancelled",
    "SessionNotFound",
    "UnsupportedProtocolVersion",
    "error_from_wire",
    "invalid_params_from_validation",
    "key_reused",
]

PARSE_ERROR = -32700
"""Invalid JSON; answered with `id: null`."""
INVALID_REQUEST = -32600
"""Not a valid request object, a batch, or a request out of order around `initialize`."""
METHOD_NOT_FOUND = -32601
"""Unknown or un-advertised method."""
INVALID_PARAMS = -32602
"""Params that break the schema, including a malformed `idempotencyKey`."""
INTERNAL_ERROR = -32603
"""Anything unexpected; the details go to the log, not the wire."""
REQUEST_CANCELLED = -32800
"""The request was cancelled (or its un-inserted prompt withdrawn) before it took effect."""
AUTH_REQUIRED = -32000
"""The agent needs the user to log in first."""
RESOURCE_NOT_FOUND = -32002
"""The session does not exist or is not active on this connection."""
UNSUPPORTED_PROTOCOL_VERSION = -32022
"""`initialize` asked for a version below every version the agent supports."""


class AcpError(Exception):
    """An error that has a JSON-RPC representation.

    Handlers raise these; the engine turns them into the error response.
    """

    code: ClassVar[int] = INTERNAL_ERROR
    default_message: ClassVar[str] = "Internal error"

    def __init__(self, message: str | None = None, data: Any = None, *, code: int | None = None):
        self.message = message or self.default_message
        self.data = data
        if code is not None:
            self.code = code  # type: ignore[misc]  # an instance may carry any wire code
        super().__init__(self.message)

    def to_wire(self) -> dict[str, Any]:
        """Return the JSON-RPC error object (`code`, `message`, and `data` when set)."""
        obj: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            obj["data"] = self.data
        return obj

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code}, message={self.message!r})"


class ParseError(AcpError):
    code = PARSE_ERROR
    default_message = "Parse error"


class InvalidRequest(AcpError):
    code = INVALID_REQUEST
    default_message = "Invalid request"


class MethodNotFound(AcpError):
    code = METHOD_NOT_FOUND
    default_message = "Method not found"


class InvalidParams(AcpError):
    code = INVALID_PARAMS
    default_message = "Invalid params"


def key_reused() -> InvalidParams:
    """The -32602 answer to a recorded `idempotencyKey` sent with a different prompt (RFD;
    R23). Its text never quotes the key (keys are private)."""
    return InvalidParams("idempotencyKey was already used with a different prompt")


class InternalError(AcpError):
    code = INTERNAL_ERROR
    default_message = "Internal error"


class RequestCancelled(AcpError):
    code = REQUEST_CANCELLED
    default_message = "Request cancelled"


class AuthRequired(AcpError):
    code = AUTH_REQUIRED
    default_message = "Authentication required"


class SessionNotFound(AcpError):
    """The session does not exist, or is not active on this connection."""

    code = RESOURCE_NOT_FOUND
    default_message = "Session not found"

    def __init__(self, session_id: str, message: str | None = None):
        super().__init__(message, {"sessionId": session_id})
        self.session_id = session_id


class UnsupportedProtocolVersion(AcpError):
    code = UNSUPPORTED_PROTOCOL_VERSION
    default_message = "Unsupported protocol version"

    def __init__(self, requested: int, supported: Sequence[int]):
        super().__init__(None, {"requested": requested, "supported": list(supported)})


_BY_CODE: dict[int, type[AcpError]] = {
    cls.code: cls
    for cls in (
        ParseError,
        InvalidRequest,
        MethodNotFound,
        InvalidParams,
        InternalError,
        RequestCancelled,
        AuthRequired,
    )
}


def error_from_wire(obj: Any) -> AcpError:
    """Build the matching `AcpError` subclass from a received JSON-RPC error object.

    Unknown codes are kept as a plain `AcpError` with that code; a malformed object becomes an
    `InternalError` describing that the peer sent a malformed error.
    """
    if not isinstance(obj, dict):
        return InternalError("Peer sent a malformed error object")
    code, message, data = obj.get("code"), obj.get("message"), obj.get("data")
    if not isinstance(code, int) or isinstance(code, bool):
        return InternalError("Peer sent a malformed error object")
    text = message if isinstance(message, str) else ""
    if code == RESOURCE_NOT_FOUND and isinstance(data, dict):
        session_id = data.get("sessionId")
        if isinstance(session_id, str):
            return SessionNotFound(session_id, text or None)
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls(text or None, data)
    return AcpError(text or None, data, code=code)


def invalid_params_from_validation(exc: ValidationError) -> InvalidParams:
    """Turn a pydantic validation error into -32602 without leaking library text or input.

    The message names the offending fields ("prompt.0.text: missing"); `data` lists them as
    `{"field", "reason"}` pairs (D3). Input values never appear: they may hold a key.
    """
    problems: list[dict[str, str]] = []
    for err in exc.errors(include_input=False, include_url=False, include_context=False):
        field = ".".join(str(part) for part in err["loc"]) or "params"
        problems.append({"field": field, "reason": err["type"]})
    summary = "; ".join(f"{p['field']}: {p['reason']}" for p in problems[:3])
    if len(problems) > 3:
        summary += f"; and {len(problems) - 3} more"
    return InvalidParams(f"Invalid params: {summary}", {"errors": problems[:20]})
