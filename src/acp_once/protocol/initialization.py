"""The `initialize` rules of ACP v2 as a pure state machine (R49, D22, D23).

- A request other than `initialize` before an `initialize` has succeeded gets -32600 and changes
  nothing; the client may still initialize.
- `initialize` while another is in flight gets -32600.
- `initialize` may be repeated until the first other request is accepted (the latest successful
  one applies); afterwards it gets -32600. Only requests count: notifications never do.
- Notifications before initialization are ignored, except `$/cancel_request`.
- The agent answers the highest version it supports that is <= the requested one, or -32022.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import Enum

from acp_once.protocol.errors import InvalidRequest, UnsupportedProtocolVersion
from acp_once.protocol.methods import CANCEL_REQUEST, INITIALIZE

__all__ = [
    "PROTOCOL_VERSION",
    "InitializeGate",
    "negotiate_version",
]

PROTOCOL_VERSION = 2
"""The ACP protocol version this package speaks."""


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
