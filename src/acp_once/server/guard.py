"""Checks and limits that apply before authentication: who may call (`Origin`, `Host`) and how
long a socket may hold a slot without sending a request (half-open connections).

- `RequestGuard`: the browser checks. A request that carries `Origin` (a browser page) is
  refused unless its origin is allowed: by default only the loopback origins of the port being
  served, since browsers apply no CORS to WebSocket upgrades and any page could otherwise drive
  a token-less loopback agent. A `Host` that is neither the address the request came in on, a
  loopback name, nor an allowed host is refused too: that is what a DNS-rebinding page sends.
- `HalfOpenGuard` and `guarded_protocol`: uvicorn's h11 protocol with a deadline for a
  request's headers and a cap on connections waiting for them, in total and per client
  address. uvicorn itself times out only idle keep-alive connections and counts its
  `limit_concurrency` after the headers, so a peer that sends headers byte by byte (slow loris)
  would hold a file descriptor forever, and enough of them stop the server for everyone.
  The same guard caps the established connections of one client address (its requests' headers
  arrived: WebSocket, SSE streams, kept-alive HTTP): one more is answered 503 and closed, so
  one address cannot take every slot of the server's `max_connections` from the others.
  Behind a trusted proxy (`TrustedProxies`) that address is the client the proxy names in the
  first request's headers; the caps on connections waiting for headers count socket peers
  (there are no headers yet).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import time
from collections.abc import Iterable, Mapping
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from acp_once.support.server_options import DEFAULT_MAX_CONNECTIONS_PER_ADDRESS

from .proxies import TrustedProxies

__all__ = [
    "DEFAULT_HEADER_TIMEOUT",
    "DEFAULT_MAX_HALF_OPEN",
    "DEFAULT_MAX_CONNECTIONS_PER_ADDRESS",
    "DEFAULT_MAX_HALF_OPEN_PER_ADDRESS",
    "HalfOpenGuard",
    "RequestGuard",
    "guarded_protocol",
    "is_loopback",
]

DEFAULT_HEADER_TIMEOUT = 10.0
"""Seconds a connection may take to send a request's headers (or stay idle between requests)."""
DEFAULT_MAX_HALF_OPEN = 1024
"""Connections waiting for a request's headers, in total; one more evicts the oldest."""
DEFAULT_MAX_HALF_OPEN_PER_ADDRESS = 256
"""The same, per client address."""
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 40\r\nconnection: close\r\n\r\n"
    b"Too many connections from this address.\n"
)


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    return _is_loopback(host)


@functools.lru_cache(maxsize=256)  # asked for every request's Host; a client sends few
def _is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _host_name(host_header: str) -> str:
    """The name in a `Host` header, without its port (`[::1]:80` -> `::1`)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        return host.partition(":")[0]
    return host


class RequestGuard:
    """Decides whether a request's `Origin` and `Host` are acceptable (see the module docstring).

    `allowed_origins`: origins allowed beside the default loopback ones (`"*"`: any origin);
    `allowed_hosts`: host names allowed beside loopback names and the address a request came
    in on (`"*"`: any host, e.g. behind a reverse proxy that checks it).
    """

    def __init__(
        self, allowed_origins: Iterable[str] = (), allowed_hosts: Iterable[str] = ()
    ) -> None:
        self.allowed_origins = frozenset(o.strip().rstrip("/").lower() for o in allowed_origins)
        self.allowed_hosts = frozenset(_host_name(h) for h in allowed_hosts)

    def refusal(
        self, headers: Mapping[str, str], scope: Mapping[str, Any]
    ) -> tuple[int, str] | None:
        """None when the request may proceed, else `(status, reason)`: 403 for an origin not
        allowed, 421 for a `Host` that names neither this server nor an allowed host."""
        server = scope.get("server")
        bound = str(server[0]).lower() if server else None
        port = server[1] if server else None
        host_header = headers.get("host")
        if host_header is not None and "*" not in self.allowed_hosts:
            name = _host_name(host_header)
            if not (is_loopback(name) or name == bound or name in self.allowed_hosts):
                return 421, "this server does not answer for that Host"
        origin = headers.get("origin")
        if origin is not None and "*" not in self.allowed_origins:
            origin = origin.strip().rstrip("/").lower()
            loopback = {f"http://{name}:{port}" for name in ("127.0.0.1", "localhost", "[::1]")}
            if origin not in loopback and origin not in self.allowed_origins:
                return 403, "this Origin is not allowed"
        return None


class HalfOpenGuard:
    """The connections of one server still waiting for a request's headers, and its limits.

    Over a cap (in total, or for one client address) the oldest waiting connection is closed,
    not the new one: a held-open flood then cannot keep a real client (or a load balancer's
    `/healthz`) out, whose headers arrive at once.
    """

    def __init__(
        self,
        *,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        max_half_open: int = DEFAULT_MAX_HALF_OPEN,
        max_half_open_per_address: int = DEFAULT_MAX_HALF_OPEN_PER_ADDRESS,
        max_connections_per_address: int | None = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
        proxies: TrustedProxies | None = None,
    ) -> None:
        self.proxies = proxies or TrustedProxies()
        """Whose forwarding headers name the client counted by `establish`."""
        if header_timeout <= 0 or max_half_open < 1 or max_half_open_per_address < 1:
            raise ValueError("header_timeout and the half-open caps must be positive")
        if max_connections_per_address is not None and max_connections_per_address < 1:
            raise ValueError("max_connections_per_address must be positive (or None: no cap)")
        self.max_connections_per_address = max_connections_per_address
        self._established: dict[str, int] = {}
        self.refused = 0
        """Connections answered 503 for their address's established connections."""
        self.header_timeout = header_timeout
        self.max_half_open = max_half_open
        self.max_half_open_per_address = max_half_open_per_address
        # insertion order is age order: the first entry is the oldest
        self._waiting: dict[_GuardedH11, str] = {}
        self._per_address: dict[str, int] = {}
        self.evicted = 0
        """Connections closed to make room for a newer one."""
        self.timed_out = 0
        """Connections closed for not sending their headers within `header_timeout`."""

    @property
    def half_open(self) -> int:
        """How many connections are waiting for a request's headers now."""
        return len(self._waiting)

    def wait(self, protocol: _GuardedH11, address: str) -> None:
        self.release(protocol)
        self._waiting[protocol] = address
        self._per_address[address] = self._per_address.get(address, 0) + 1
        if self._per_address[address] > self.max_half_open_per_address:
            oldest = next(p for p, a in self._waiting.items() if a == address)
            self._evict(oldest)
        if len(self._waiting) > self.max_half_open:
            self._evict(next(iter(self._waiting)))

    def release(self, protocol: _GuardedH11) -> None:
        address = self._waiting.pop(protocol, None)
        if address is not None:
            left = self._per_address[address] - 1
            if left:
                self._per_address[address] = left
            else:  # no entry per address that ever connected: the map stays bounded
                del self._per_address[address]

    def establish(self, address: str) -> bool:
        """A connection of `address` has sent its first request's headers: False (refuse it)
        when the address has its cap of established connections already, else count it."""
        count = self._established.get(address, 0)
        if self.max_connections_per_address is not None and (
            count >= self.max_connections_per_address
        ):
            self.refused += 1
            return False
        self._established[address] = count + 1
        return True

    def leave(self, address: str) -> None:
        """An established connection of `address` has closed."""
        left = self._established[address] - 1
        if left:
            self._established[address] = left
        else:  # no entry per address that ever connected: the map stays bounded
            del self._established[address]

    def _evict(self, protocol: _GuardedH11) -> None:
        self.release(protocol)
        self.evicted += 1
        protocol.transport.close()


class _GuardedH11(H11Protocol):
    guard: HalfOpenGuard

    # In slots: five more keys in the instance dict of uvicorn's protocol would take it past
    # CPython's shared-key limit, a table of its own (~0.8 KiB) for every connection.
    __slots__ = ("_admitted", "_counted_as", "_deadline", "_limit_concurrency", "_since")
    _deadline: asyncio.TimerHandle | None
    _since: float
    _admitted: bool | None
    """None until the first request's headers; then whether the address's cap let it in."""
    _counted_as: str
    """The client address the established connection is counted for (`_admit`)."""
    _limit_concurrency: int | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._deadline = None
        self._since = 0.0
        self._admitted = None
        self._counted_as = "?"
        self._limit_concurrency = None
        super().__init__(*args, **kwargs)

    @property
    def _address(self) -> str:
        client = self.client
        return client[0] if client else "?"

    def _admit(self) -> bool:
        if self._admitted is None:
            # the first request's headers have arrived (uvicorn set `headers` before asking)
            headers = getattr(self, "headers", ())
            self._counted_as = self.guard.proxies.client(self._address, headers)
            self._admitted = self.guard.establish(self._counted_as)
        return self._admitted

    # uvicorn reads `limit_concurrency` once a request's headers have arrived and answers 503
    # (`service_unavailable`, closing the connection) when the connections reach it: a limit of
    # 0 for a connection its address's cap refuses reuses that path for plain HTTP requests
    @property
    def limit_concurrency(self) -> int | None:
        return self._limit_concurrency if self._admit() else 0

    @limit_concurrency.setter
    def limit_concurrency(self, value: int | None) -> None:
        self._limit_concurrency = value

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._waiting()

    def _waiting(self) -> None:
        """From now on a request's headers are due within `header_timeout`."""
        self._since = time.monotonic()
        self.guard.wait(self, self._address)
        if self._deadline is None:
            # else the armed check comes earlier and arms itself again for what is left
            # (`_check_deadline`): no timer replaced on every request of a kept-alive socket
            self._arm(self.guard.header_timeout)

    def _arm(self, delay: float) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(delay, self._check_deadline)

    def _check_deadline(self) -> None:
        self._deadline = None
        if self not in self.guard._waiting or self.transport.is_closing():
            return
        left = self._since + self.guard.header_timeout - time.monotonic()
        if left > 0:
            self._arm(left)
            return
        self.guard.release(self)
        self.guard.timed_out += 1
        self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        # a request's headers arrived: its body and answer have their own timeouts
        if self.cycle is not None and not self.cycle.response_complete:
            self.guard.release(self)

    def handle_websocket_upgrade(self, event: Any) -> None:
        # the WebSocket protocol takes the socket over: it is no longer waiting for headers
        self.guard.release(self)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if not self._admit():
            self.transport.write(_REFUSED)
            self.transport.close()
            return
        super().handle_websocket_upgrade(event)
        # the WebSocket protocol owns the socket now and gets its connection_lost, not us
        websocket = self.transport.get_protocol()
        lost = websocket.connection_lost
        guard, address = self.guard, self._counted_as
        self._admitted = None  # counted by the WebSocket's end from here on

        def connection_lost(exc: Exception | None) -> None:
            guard.leave(address)
            lost(exc)

        websocket.connection_lost = connection_lost  # type: ignore[method-assign]

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # (super() may have started a pipelined request already: that one is not waiting)
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self.transport.is_closing():
            self._waiting()  # a kept-alive connection: the next request's headers are due

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.release(self)
        if self._admitted:
            self._admitted = False
            self.guard.leave(self._counted_as)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)


def guarded_protocol(guard: HalfOpenGuard) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol bound to `guard` (pass it as `uvicorn.Config(http=...)`)."""
    return type("GuardedH11Protocol", (_GuardedH11,), {"guard": guard})
