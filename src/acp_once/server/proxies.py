"""Trusted reverse proxies: which address a request really comes from.

Behind a reverse proxy every socket's peer is the proxy, so per-address caps would count all
clients as one and logs would name the proxy. `TrustedProxies` (`acp-once serve
--forwarded-allow-ips`, `create_app(forwarded_allow_ips=...)`; none by default) names the
peers whose forwarding headers are believed. For a request from such a peer the client's
address is read from `X-Forwarded-For` (or, without it, from `Forwarded`'s `for=`): the
entries are walked from the right (the one the nearest proxy appended) past every trusted
proxy, and the first untrusted entry is the client; a header from any other peer is ignored,
as a client could write anything there.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["TrustedProxies"]

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _parse_address(value: str) -> str | None:
    """The IP address in a forwarded entry (`1.2.3.4`, `1.2.3.4:80`, `[::1]:80`, `"[::1]"`),
    normalized; None for anything else (`unknown`, an obfuscated name, garbage)."""
    value = value.strip().strip('"')
    if value.startswith("["):
        value = value[1:].partition("]")[0]
    elif value.count(":") == 1:
        value = value.partition(":")[0]
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return None


class TrustedProxies:
    """The reverse proxies whose forwarding headers are believed.

    `allow`: IP addresses and networks (`10.0.0.0/8`), or `"*"` for any peer (only when
    nothing but the proxy can reach the server). Empty (the default): no header is believed.

    Raises:
        ValueError: an entry that is neither an address, a network nor `"*"`.
    """

    def __init__(self, allow: Iterable[str] = ()) -> None:
        self.any = False
        networks: list[_Network] = []
        for entry in allow:
            entry = entry.strip()
            if not entry:
                continue
            if entry == "*":
                self.any = True
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                raise ValueError(f"not an IP address or network: {entry!r}") from None
        self.networks = tuple(networks)

    @property
    def enabled(self) -> bool:
        """Whether any peer's forwarding headers are believed."""
        return self.any or bool(self.networks)

    def trusts(self, host: str) -> bool:
        """Whether `host` (a socket peer, or an entry of a forwarding header) is a proxy."""
        if self.any:
            return True
        if not self.networks:
            return False
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return False
        return any(address in network for network in self.networks)

    def client(self, peer: str, headers: Mapping[str, str] | Sequence[tuple[bytes, bytes]]) -> str:
        """The client's address for a request whose socket peer is `peer`: the forwarded one
        when `peer` is a trusted proxy and a header names one, else `peer`.

        `headers`: a mapping with lower-case names, or ASGI's raw header pairs.
        """
        if not self.enabled or not self.trusts(peer):
            return peer
        forwarded_for, forwarded = _headers(headers)
        if forwarded_for:
            entries = [_parse_address(e) for e in ",".join(forwarded_for).split(",")]
        elif forwarded:
            entries = [
                _parse_address(pair.partition("=")[2])
                for element in ",".join(forwarded).split(",")
                for pair in element.split(";")
                if pair.strip().lower().startswith("for=")
            ]
        else:
            return peer
        for entry in reversed(entries):
            if entry is None:
                return peer  # an entry we cannot read: nothing to its left can be believed
            if not self.trusts(entry):
                return entry
        return entries[0] or peer  # a chain of proxies only: the first is the client


def _headers(
    headers: Mapping[str, str] | Sequence[tuple[bytes, bytes]],
) -> tuple[list[str], list[str]]:
    if isinstance(headers, Mapping):
        xff = headers.get("x-forwarded-for")
        fwd = headers.get("forwarded")
        return ([xff] if xff else [], [fwd] if fwd else [])
    forwarded_for: list[str] = []
    forwarded: list[str] = []
    for name, value in headers:
        if name == b"x-forwarded-for":
            forwarded_for.append(value.decode("latin-1"))
        elif name == b"forwarded":
            forwarded.append(value.decode("latin-1"))
    return forwarded_for, forwarded
