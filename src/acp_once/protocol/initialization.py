"""The `initialize` rules of ACP v2 as a pure state machine (R49, D22, D23).

- A request other than `initialize` before an `initialize` has succeeded gets -32600 and changes
  nothing; the client may still initialize.
- `initialize` while another is in flight gets -32600.
- `initialize` may be repeated until the first other request is accepted (the latest successful
  one applies); afterwards it gets -32600. Only requests count: notifications never do.
- Notifications before initialization are ignored, except `$/cancel_request`.
- The agent answers the highest version it supports that is <= the requested one, or -32022.

`route_initialize` chooses between v1 and v2 on one connection the way the TypeScript SDK's
`AgentProtocolRouter` does (docs/guide/v1.md): 2 or more gets v2, 1 gets v1; the params of an
`initialize` asking for a newer version than v2 are read leniently; a repeated `initialize` never
changes the version, and one asking a v2 connection for less than v2 gets -32600.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import Any

from pydantic import ValidationError

from acp_once.protocol import schema as s
from acp_once.protocol._base import WireModel
from acp_once.protocol.errors import (
    InvalidParams,
    InvalidRequest,
    UnsupportedProtocolVersion,
    invalid_params_from_validation,
)
from acp_once.protocol.methods import CANCEL_REQUEST, INITIALIZE

__all__ = [
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "UNKNOWN_IMPLEMENTATION",
    "InitializeGate",
    "negotiate_version",
    "route_initialize",
]

PROTOCOL_VERSION = 2
"""The ACP protocol version this package speaks."""

SUPPORTED_VERSIONS = (1, 2)
"""The versions an acp-once agent serves: v1 through its v1 face, v2 natively."""

UNKNOWN_IMPLEMENTATION = {"name": "unknown", "version": "unknown"}
"""What stands for a missing or malformed `info` in an `initialize` asking for a version newer
than v2 (as the TypeScript SDK's router does)."""

_MAX_PROTOCOL_VERSION = 0xFFFF


def negotiate_version(requested: int, supported: Iterable[int]) -> int:
    """Return the highest supported version <= `requested`.

    Raises:
        UnsupportedProtocolVersion: no supported version is <= `requested` (-32022, with
            `{requested, supported}` as data).
    """
    versions = sorted(set(supported))
    candidates = [v for v in versions if v <= requested]
    if not candidates:
        raise UnsupportedProtocolVersion(requested, versions)
    return candidates[-1]


class _State(Enum):
    NEW = "new"
    INITIALIZING = "initializing"
    INITIALIZED = "initialized"
    LOCKED = "locked"  # another request was accepted: initialize is over for good


class InitializeGate:
    """Decides, message by message, what the initialize rules allow on one connection.

    Call `admit_request` when a request arrives (it raises or returns), and
    `initialize_done(ok)` when an admitted `initialize` finished (or the callback that
    `admit_request` returned for it: the engine gates requests without knowing their names).
    """

    __slots__ = ("_before", "_state")

    def __init__(self) -> None:
        self._state = _State.NEW
        self._before = _State.NEW

    @property
    def initialized(self) -> bool:
        """True once an `initialize` succeeded (and none is in flight)."""
        return self._state in (_State.INITIALIZED, _State.LOCKED)

    def admit_request(self, method: str) -> Callable[[bool], None] | None:
        """Admit a request or refuse it.

        Returns `initialize_done` for an admitted `initialize` (to be called with its outcome
        once it is answered), None for any other request.

        Raises:
            InvalidRequest: the initialize rules forbid this request now (-32600).
        """
        state = self._state
        if method == INITIALIZE:
            if state is _State.INITIALIZING:
                raise InvalidRequest("initialize is already in progress")
            if state is _State.LOCKED:
                raise InvalidRequest("initialize is not allowed after other requests")
            self._before = state
            self._state = _State.INITIALIZING
            return self.initialize_done
        if state is _State.LOCKED:
            return None
        if state is _State.INITIALIZED:
            self._state = _State.LOCKED
            return None
        if state is _State.INITIALIZING:
            raise InvalidRequest(f"'{method}' is not allowed while initialize is in progress")
        raise InvalidRequest(f"The connection must be initialized before '{method}'")

    def initialize_done(self, ok: bool) -> None:
        """Record the outcome of the admitted `initialize`: a failure keeps the earlier state."""
        if self._state is _State.INITIALIZING:
            self._state = _State.INITIALIZED if ok else self._before

    def admit_notification(self, method: str) -> bool:
        """True when a notification should be handled; before initialization only
        `$/cancel_request` is."""
        return method == CANCEL_REQUEST or self.initialized


def route_initialize(params: object, routed: int | None) -> tuple[int, dict[str, Any]]:
    """Choose the version of a connection from its `initialize` params (the TypeScript SDK's
    `AgentProtocolRouter` rules), and normalize the params for it.

    Args:
        params: the `initialize` params as received.
        routed: the version the connection was routed to by an earlier `initialize` that
            succeeded (None: not yet). A connection is never routed again: a repeat is answered
            in the version it has.

    Returns:
        `(version, params)`: 2 with v2 `initialize` params (as received when exactly 2 was
        asked for, to be validated strictly; read leniently for a newer version: a missing or
        malformed `info` becomes `UNKNOWN_IMPLEMENTATION`, capabilities or `_meta` that do not
        parse are dropped), or 1 with the validated v1 params (wire form).

    Raises:
        InvalidParams: `protocolVersion` is not an integer in 0..65535, or v1 params do not
            validate.
        UnsupportedProtocolVersion: the version asked for is below every supported one (0).
        InvalidRequest: a repeat asking a v2 connection for v1 (a repeat must use the
            connection's version).
    """
    if not isinstance(params, Mapping):
        raise InvalidParams("initialize.protocolVersion must be a valid ACP protocol version")
    requested = params.get("protocolVersion")
    if (
        not isinstance(requested, int)
        or isinstance(requested, bool)
        or not 0 <= requested <= _MAX_PROTOCOL_VERSION
    ):
        raise InvalidParams("initialize.protocolVersion must be a valid ACP protocol version")
    if requested < SUPPORTED_VERSIONS[0]:
        raise UnsupportedProtocolVersion(requested, SUPPORTED_VERSIONS)
    selected = 2 if requested >= 2 else 1
    if routed == 2 and selected == 1:
        raise InvalidRequest("A repeated initialize must ask for the connection's version (2)")
    if routed == 1 or selected == 1:
        return 1, _v1_params(params, requested)
    if requested == 2:
        return 2, dict(params)
    return 2, _newer_v2_params(params)


def _v1_params(params: Mapping[str, Any], requested: int) -> dict[str, Any]:
    # imported here: a process that never meets a v1 client does not build the v1 models
    from acp_once.protocol import v1

    fields = dict(params)
    if requested >= 2:
        # a repeat on a v1 connection asking for more: answered in v1, its params read as v1's
        # where they parse (the version is the connection's)
        fields = {"protocolVersion": 1, "_meta": params.get("_meta")}
        if isinstance(params.get("info"), Mapping):
            fields["clientInfo"] = params["info"]
    try:
        model = v1.InitializeRequest.model_validate(fields)
    except ValidationError as exc:
        if requested >= 2:
            model = v1.InitializeRequest(protocol_version=1)
        else:
            raise invalid_params_from_validation(exc) from None
    wire: dict[str, Any] = model.model_dump(by_alias=True, exclude_none=True, mode="json")
    wire["protocolVersion"] = 1
    return wire


def _parses(model: type[WireModel], value: Any) -> bool:
    try:
        model.model_validate(value)
    except ValidationError:
        return False
    return True


def _newer_v2_params(params: Mapping[str, Any]) -> dict[str, Any]:
    info = params.get("info")
    fields: dict[str, Any] = {
        "protocolVersion": 2,
        "info": info if _parses(s.Implementation, info) else UNKNOWN_IMPLEMENTATION,
    }
    capabilities = params.get("capabilities")
    if capabilities is not None and _parses(s.ClientCapabilities, capabilities):
        fields["capabilities"] = capabilities
    meta = params.get("_meta")
    if isinstance(meta, Mapping):
        fields["_meta"] = meta
    return fields
