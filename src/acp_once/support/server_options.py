"""The network server's limits and timeouts as values: `ServerLimits` and `ServerTimeouts`,
taken by `acp_once.server.create_app` and `AcpServer` (`limits=`, `timeouts=`; both exported
by `acp_once.server`) and the source of `acp-once serve`'s defaults. Both are frozen: derive a
variant with `dataclasses.replace`. Here, with no third-party import, so the command line
reads the defaults without the `server` extra."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypedDict

__all__ = [
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_HTTP_OPEN_TIMEOUT",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_ADDRESS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_MAX_UNOPENED_HTTP",
    "DEFAULT_MAX_UNOPENED_HTTP_PER_ADDRESS",
    "DEFAULT_MAX_UNOPENED_HTTP_PER_TENANT",
    "DEFAULT_SSE_KEEPALIVE",
    "DEFAULT_TIMEOUTS",
    "DEFAULT_WRITE_TIMEOUT",
    "ServerLimits",
    "ServerOptions",
    "ServerTimeouts",
    "with_options",
]

DEFAULT_MAX_CONNECTIONS = 10_000
"""Open connections at most (WebSocket, and Streamable HTTP with a stream); one more is
answered 503. An idle WebSocket connection with an open session holds ~60 KB."""
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Largest text frame read as a message (uvicorn's own `ws_max_size` default is the same): a
larger request is answered -32600 and the connection lives on."""
DEFAULT_MAX_UNOPENED_HTTP = 100
"""Streamable HTTP connections at most that never opened a stream; they have a cap of their
own and do not count against `max_connections`, so a flood of initialize POSTs cannot keep
WebSocket clients or streaming HTTP clients out."""
DEFAULT_MAX_UNOPENED_HTTP_PER_ADDRESS = 10
"""The same, per client address: one address re-posting initialize cannot take the whole
`max_unopened_http` from the others (a real client opens its stream right after)."""
DEFAULT_MAX_UNOPENED_HTTP_PER_TENANT = 50
"""The same, per tenant (with `tokens`): one tenant's clients, from however many addresses,
cannot take the whole `max_unopened_http` from the other tenants."""
DEFAULT_MAX_CONNECTIONS_PER_ADDRESS = 512
"""Established connections per client address under `acp-once serve` (uvicorn's layer,
`acp_once.server.guard`); one more is answered 503. Well below `max_connections` (10,000), so
one address cannot take them all; well above what one editor or a test run opens."""
DEFAULT_IDLE_TIMEOUT = 300.0
"""Seconds without a message either way after which a connection is closed (WebSocket: 1000
"idle timeout"; Streamable HTTP: the connection ends, its SSE streams too). Its sessions stay
resumable; a client with work pending reconnects and resends by key."""
DEFAULT_WRITE_TIMEOUT = 30.0
"""Seconds one message may wait for a client that stopped reading (its socket's send buffer
full) before that connection is dropped: the agent is never held up longer."""
DEFAULT_HTTP_OPEN_TIMEOUT = 30.0
"""Seconds a Streamable HTTP connection may live after its initialize without ever opening an
SSE stream: one POST must not hold a connection (and its engine) for the idle timeout."""
DEFAULT_BODY_TIMEOUT = 30.0
"""Seconds a POST's body may take to arrive (answered 408 after)."""
DEFAULT_SSE_KEEPALIVE = 15.0
"""Seconds an SSE stream may stay silent before it gets a comment line (as the TypeScript
SDK's server does; the same value as `acp_once.transports.http.DEFAULT_SSE_KEEPALIVE`, not
imported from there: this module needs no third-party package)."""


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """How much the server holds at most (each field's default is the `DEFAULT_*` constant of
    the same name).

    Raises:
        ValueError: a limit that is not positive.
    """

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_unopened_http: int = DEFAULT_MAX_UNOPENED_HTTP
    max_unopened_http_per_address: int = DEFAULT_MAX_UNOPENED_HTTP_PER_ADDRESS
    max_unopened_http_per_tenant: int = DEFAULT_MAX_UNOPENED_HTTP_PER_TENANT

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_message_bytes < 1:
            raise ValueError("max_connections and max_message_bytes must be positive")
        if (
            min(
                self.max_unopened_http,
                self.max_unopened_http_per_address,
                self.max_unopened_http_per_tenant,
            )
            < 1
        ):
            raise ValueError("max_unopened_http and its per-address and per-tenant caps: positive")


@dataclass(frozen=True, slots=True)
class ServerTimeouts:
    """How long the server waits, in seconds (defaults: the `DEFAULT_*_TIMEOUT` constants).

    `idle`: a connection with no message either way (None: never closed for it); `write`: a
    client that stopped reading; `http_open`: an HTTP connection that opened no stream;
    `body`: a POST's body; `sse_keepalive`: silence on an SSE stream before a comment line
    (None: none).

    Raises:
        ValueError: a timeout that is not positive.
    """

    idle: float | None = DEFAULT_IDLE_TIMEOUT
    write: float = DEFAULT_WRITE_TIMEOUT
    http_open: float = DEFAULT_HTTP_OPEN_TIMEOUT
    body: float = DEFAULT_BODY_TIMEOUT
    sse_keepalive: float | None = DEFAULT_SSE_KEEPALIVE

    def __post_init__(self) -> None:
        if (self.idle is not None and self.idle <= 0) or self.write <= 0:
            raise ValueError("idle_timeout and write_timeout must be positive")
        if self.http_open <= 0 or self.body <= 0:
            raise ValueError("http_open_timeout and body_timeout must be positive")


class ServerOptions(TypedDict, total=False):
    """The limits and timeouts as single keyword arguments of `create_app` (the names they had
    before `ServerLimits` and `ServerTimeouts`); each one given replaces that field."""

    max_connections: int
    max_message_bytes: int
    max_unopened_http: int
    max_unopened_http_per_address: int
    max_unopened_http_per_tenant: int
    idle_timeout: float | None
    write_timeout: float
    http_open_timeout: float
    body_timeout: float
    sse_keepalive: float | None


_TIMEOUT_FIELDS = {
    "idle_timeout": "idle",
    "write_timeout": "write",
    "http_open_timeout": "http_open",
    "body_timeout": "body",
    "sse_keepalive": "sse_keepalive",
}


def with_options(
    limits: ServerLimits, timeouts: ServerTimeouts, options: ServerOptions
) -> tuple[ServerLimits, ServerTimeouts]:
    """`limits` and `timeouts` with the fields `options` names replaced.

    Raises:
        TypeError: an unknown option.
        ValueError: a limit or timeout that is not positive.
    """
    limit_changes: dict[str, Any] = {}
    timeout_changes: dict[str, Any] = {}
    for name, value in options.items():
        if name in _TIMEOUT_FIELDS:
            timeout_changes[_TIMEOUT_FIELDS[name]] = value
        elif name in ServerLimits.__dataclass_fields__:
            limit_changes[name] = value
        else:
            raise TypeError(f"unknown server option {name!r}")
    if limit_changes:
        limits = dataclasses.replace(limits, **limit_changes)
    if timeout_changes:
        timeouts = dataclasses.replace(timeouts, **timeout_changes)
    return limits, timeouts


DEFAULT_LIMITS = ServerLimits()
"""Every limit at its default."""
DEFAULT_TIMEOUTS = ServerTimeouts()
"""Every timeout at its default."""
