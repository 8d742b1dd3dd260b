"""JSON-RPC 2.0 envelopes as ACP v2 uses them: decoding, validation and encoding.

`decode(frame)` never raises: it returns a `Request`, `Notification`, `Response` or
`ErrorResponse`, a `Batch` (a non-empty JSON array, D21), or an `Invalid` that says which error
to answer (-32700 for invalid JSON, -32600 for an invalid envelope or an empty array) and to
which id, if any. The entries of a batch are classified one by one with `decode_entry` (D40).

Ids are strings or integers, never null and never fractional (R45). Encoding uses orjson;
the hot path builds plain dicts and never goes through pydantic. Every value `decode` returns
can be encoded again (lone surrogates and integers beyond 64 bits included), and `encode_error`
never raises: an error answer can always be written, whatever the request held.
"""

from __future__ import annotations

import datetime
import enum
import json
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from acp_once.protocol.errors import INTERNAL_ERROR, INVALID_REQUEST, PARSE_ERROR, AcpError

__all__ = [
    "Batch",
    "ErrorResponse",
    "Invalid",
    "Message",
    "Notification",
    "Request",
    "RequestId",
    "Response",
    "Single",
    "Unencodable",
    "decode",
    "decode_entry",
    "decode_object",
    "encode_batch",
    "encode_error",
    "encode_notification",
    "encode_request",
    "encode_result",
    "is_request_id",
    "loads",
]

RequestId = int | str
"""A JSON-RPC request id: a string or an integer (int64); never null."""

_INT64 = 2**63


def is_request_id(value: object) -> bool:
    """True when `value` is a valid ACP v2 request id."""
    if isinstance(value, str):
        return True
    return isinstance(value, int) and not isinstance(value, bool) and -_INT64 <= value < _INT64


@dataclass(frozen=True, slots=True)
class Request:
    id: RequestId
    method: str
    params: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Notification:
    method: str
    params: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Response:
    id: RequestId
    result: Any


@dataclass(frozen=True, slots=True)
class ErrorResponse:
    id: RequestId | None
    error: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Invalid:
    """A frame that is not a usable message.

    Attributes:
        code: -32700 (not JSON) or -32600 (not a valid envelope).
        message: one short sentence for the error response.
        id: the request id to answer, when one could be read; otherwise None (`id: null`).
        answer: False when no error response may be sent (an invalid notification or response:
            JSON-RPC never answers those).
    """

    code: int
    message: str
    id: RequestId | None = None
    answer: bool = True


@dataclass(frozen=True, slots=True)
class Batch:
    """A JSON array of at least one entry (D21): each entry is still raw parsed JSON, to be
    classified with `decode_entry`."""

    entries: list[Any]


Single = Request | Notification | Response | ErrorResponse | Invalid
"""What one JSON object is (`decode_object`, `decode_entry`)."""
Message = Single | Batch


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(frame: bytes | str) -> Any:
    """Parse one frame of JSON as the engine does (orjson; escaped lone surrogates, which JSON
    allows and orjson refuses, through the stdlib).

    Raises:
        ValueError: not JSON (NaN and Infinity included).
        RecursionError: nested deeper than the stdlib parses.
    """
    try:
        return orjson.loads(frame)
    except orjson.JSONDecodeError:
        # orjson refuses escaped lone surrogates ("\ud800"), which JSON allows. Such a frame
        # is valid JSON with a value we cannot use; let the stdlib parse it so that validation
        # can answer -32602 for the field (an idempotencyKey, say) instead of -32700. The
        # stdlib also reads NaN and Infinity, which are not JSON: those stay a parse error.
        return json.loads(frame, parse_constant=_not_json)


def decode(frame: bytes | str) -> Message:
    """Classify one frame. Never raises."""
    try:
        obj = loads(frame)
    except (ValueError, RecursionError):
        return Invalid(PARSE_ERROR, "Parse error")
    if isinstance(obj, dict):
        return decode_object(obj)
    if isinstance(obj, list):
        if not obj:
            return Invalid(INVALID_REQUEST, "A batch must hold at least one message")
        return Batch(obj)
    return Invalid(INVALID_REQUEST, "A message must be a JSON object")


def decode_entry(entry: Any) -> Single:
    """Classify one entry of a batch (D40). Never raises.

    As `decode_object`, except that an entry which is not an object, or an object that is
    neither a request, a notification nor a response (`{"foo": 1}`), is answered -32600 inside
    the reply array, as the JSON-RPC 2.0 batch examples show. A nested array is such an entry.
    """
    if not isinstance(entry, dict):
        return Invalid(INVALID_REQUEST, "A batch entry must be a JSON object")
    msg = decode_object(entry)
    if (
        isinstance(msg, Invalid)
        and not msg.answer
        and "method" not in entry
        and "result" not in entry
        and "error" not in entry
    ):
        return Invalid(msg.code, msg.message, msg.id)
    return msg


def decode_object(obj: dict[str, Any]) -> Single:
    """Classify an already parsed JSON object. Never raises."""
    has_id = "id" in obj
    raw_id: Any = obj.get("id")
    id_ok = is_request_id(raw_id)
    method = obj.get("method")
    if obj.get("jsonrpc") != "2.0":
        return Invalid(
            INVALID_REQUEST,
            'jsonrpc must be "2.0"',
            raw_id if id_ok else None,
            answer=has_id and method is not None,
        )
    if method is not None:
        if not isinstance(method, str):
            return Invalid(INVALID_REQUEST, "method must be a string", answer=has_id)
        params = obj.get("params")
        if params is not None and not isinstance(params, dict):
            return Invalid(
                INVALID_REQUEST,
                "params must be an object",
                raw_id if id_ok else None,
                answer=has_id,
            )
        if not has_id:
            return Notification(method, params)
        if not id_ok:
            # R45: null or fractional ids get -32600 with id null, unprocessed
            return Invalid(INVALID_REQUEST, "Request id must be a string or an integer")
        return Request(raw_id, method, params)
    if "result" in obj:
        if not id_ok:
            return Invalid(INVALID_REQUEST, "Response id is invalid", answer=False)
        return Response(raw_id, obj["result"])
    if "error" in obj:
        error = obj["error"]
        if not isinstance(error, dict):
            return Invalid(INVALID_REQUEST, "error must be an object", answer=False)
        return ErrorResponse(raw_id if id_ok else None, error)
    return Invalid(
        INVALID_REQUEST,
        "Not a request, notification or response",
        raw_id if id_ok else None,
        answer=has_id,
    )


class Unencodable(ValueError):
    """A value JSON cannot carry: not a JSON type (a `set`, a pydantic `AnyUrl`...), NaN or an
    infinity beside a lone surrogate, or nesting deeper than the encoder goes."""


def _dumps(message: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(message)
    except TypeError:
        return _dumps_escaped(message)


def _as_orjson_writes(value: Any) -> Any:
    """The types orjson writes natively that the stdlib does not (a model dumped without JSON
    mode holds datetimes), written as orjson writes them."""
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON")


def _dumps_escaped(message: dict[str, Any]) -> bytes:
    """`_dumps` of what orjson refuses. The hot encoders try orjson inline and call this only
    when it raises: a function call less per frame (~5 a prompt turn)."""
    # a lone surrogate ("\ud800", valid JSON that `decode` accepts), an integer beyond 64 bits
    # or nesting deeper than orjson writes (254 levels): the stdlib writes them, escaped
    try:
        text = json.dumps(
            message,
            ensure_ascii=True,
            separators=(",", ":"),
            allow_nan=False,
            default=_as_orjson_writes,
        )
    except (TypeError, ValueError, RecursionError) as exc:
        raise Unencodable(f"Cannot encode as JSON: {type(exc).__name__}") from None
    return text.encode("ascii")


def encode_request(id: RequestId, method: str, params: Any) -> bytes:
    """Encode a request; `params` None leaves the member out.

    Raises:
        Unencodable: `params` holds a value JSON cannot carry (also for the other encoders
            but `encode_error`).
    """
    if params is None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
    else:
        message = {"jsonrpc": "2.0", "id": id, "method": method, "params": params}
    try:
        return orjson.dumps(message)
    except TypeError:
        return _dumps_escaped(message)


def encode_notification(method: str, params: Any) -> bytes:
    """Encode a notification; `params` None leaves the member out."""
    if params is None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    else:
        message = {"jsonrpc": "2.0", "method": method, "params": params}
    try:
        return orjson.dumps(message)
    except TypeError:
        return _dumps_escaped(message)


def encode_result(id: RequestId, result: Any) -> bytes:
    """Encode a success response."""
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "result": result}
    try:
        return orjson.dumps(message)
    except TypeError:
        return _dumps_escaped(message)


def encode_batch(frames: list[bytes]) -> bytes:
    """Join encoded messages (`encode_request`, `encode_result`...) into one batch array."""
    return b"[" + b",".join(frames) + b"]"


def encode_error(id: RequestId | None, error: AcpError | dict[str, Any]) -> bytes:
    """Encode an error response; `id` None is written as `null`.

    Never raises for an id that `decode` returned: an error whose `data` cannot be encoded is
    written without it, and one whose code or message cannot be either (a relayed error object
    holds whatever the peer sent) as -32603 "Internal error".
    """
    body = error.to_wire() if isinstance(error, AcpError) else error
    try:
        return _dumps({"jsonrpc": "2.0", "id": id, "error": body})
    except Unencodable:
        pass
    short = {"code": body.get("code"), "message": body.get("message")}
    if not isinstance(short["code"], int) or not isinstance(short["message"], str):
        short = {"code": INTERNAL_ERROR, "message": "Internal error"}
    return _dumps({"jsonrpc": "2.0", "id": id, "error": short})
