"""Caps per client, not per server: one address (or one tenant) flooding `initialize` POSTs
cannot keep another out, and behind a trusted reverse proxy the client is the address the
proxy names, never what an untrusted peer claims. Real sockets from several loopback
addresses (127.0.0.1, 127.0.0.2, ...) to one in-process server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from acp_once.server.proxies import TrustedProxies
from tests.remote.harness import running
from tests.remote.test_connection_caps import _open, _status
from tests.remote.test_hardening import INITIALIZE, _upgrade

pytestmark = pytest.mark.anyio

TIMEOUT = 20


@asynccontextmanager
async def client_from(address: str, token: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client whose sockets come from `address` (a loopback address)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    transport = httpx.AsyncHTTPTransport(local_address=address)
    async with httpx.AsyncClient(transport=transport, headers=headers) as client:
        yield client


async def initialize(client: httpx.AsyncClient, url: str, **headers: str) -> int:
    return (await client.post(url, json=INITIALIZE, headers=headers)).status_code


async def test_one_address_flooding_initialize_does_not_keep_another_out(
    tmp_path: Path,
) -> None:
    options = {"max_unopened_http": 20, "max_unopened_http_per_address": 5}
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path, app_options=options) as srv,
            client_from("127.0.0.1") as flood,
            client_from("127.0.0.2") as other,
        ):
            url = f"{srv.http}/acp"
            codes = [await initialize(flood, url) for _ in range(25)]
            assert codes == [200] * 5 + [503] * 20
            # another address still gets in, as often as its own cap allows
            assert [await initialize(other, url) for _ in range(5)] == [200] * 5
            assert srv.acp.rejected == 20


async def test_one_tenant_from_many_addresses_does_not_keep_another_tenant_out(
    tmp_path: Path,
) -> None:
    options: dict[str, Any] = {
        "tokens": {"alice": "alice-token", "bob": "bob-token"},
        "max_unopened_http": 20,
        "max_unopened_http_per_address": 4,
        "max_unopened_http_per_tenant": 6,
    }
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, app_options=options) as srv, AsyncExitStack() as stack:
            url = f"{srv.http}/acp"
            codes = []
            for n in range(1, 5):  # alice from four addresses
                alice = await stack.enter_async_context(client_from(f"127.0.0.{n}", "alice-token"))
                codes += [await initialize(alice, url) for _ in range(3)]
            assert codes.count(200) == 6 and codes.count(503) == 6
            bob = await stack.enter_async_context(client_from("127.0.0.9", "bob-token"))
            assert [await initialize(bob, url) for _ in range(4)] == [200] * 4


async def test_a_trusted_proxys_forwarded_address_is_the_client(tmp_path: Path) -> None:
    options: dict[str, Any] = {
        "forwarded_allow_ips": ["127.0.0.1"],
        "max_unopened_http": 20,
        "max_unopened_http_per_address": 3,
    }
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, app_options=options) as srv, client_from("127.0.0.1") as proxy:
            url = f"{srv.http}/acp"
            one = {"x-forwarded-for": "203.0.113.7"}
            codes = [await initialize(proxy, url, **one) for _ in range(5)]
            assert codes == [200] * 3 + [503] * 2
            # another client behind the same proxy: its own cap (X-Forwarded-For, then Forwarded)
            assert (
                await initialize(proxy, url, **{"x-forwarded-for": "198.51.100.1, 203.0.113.8"})
                == 200
            )
            assert await initialize(proxy, url, forwarded='for="[2001:db8::1]:4711"') == 200
            counted = set(srv.acp._http_addresses.values())
            assert counted == {"203.0.113.7", "203.0.113.8", "2001:db8::1"}


async def test_an_untrusted_peers_forwarded_header_is_ignored(tmp_path: Path) -> None:
    options: dict[str, Any] = {"max_unopened_http": 20, "max_unopened_http_per_address": 3}
    with anyio.fail_after(TIMEOUT):
        async with running(tmp_path, app_options=options) as srv, client_from("127.0.0.1") as peer:
            url = f"{srv.http}/acp"
            # a client cannot escape its cap by claiming to be many others
            codes = [
                await initialize(peer, url, **{"x-forwarded-for": f"203.0.113.{n}"})
                for n in range(5)
            ]
            assert codes == [200] * 3 + [503] * 2
            assert set(srv.acp._http_addresses.values()) == {"127.0.0.1"}


async def test_the_established_cap_counts_a_trusted_proxys_clients(tmp_path: Path) -> None:
    app = {"forwarded_allow_ips": ["127.0.0.0/8"]}
    listen = {"max_connections_per_address": 2}
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path, app_options=app, listen_options=listen) as srv,
            AsyncExitStack() as stack,
        ):

            def upgrade(client: str) -> bytes:
                head = _upgrade(srv.port)
                return head[:-2] + f"X-Forwarded-For: {client}\r\n\r\n".encode()

            held = [
                await _open(stack, srv.port, upgrade("203.0.113.7"), "127.0.0.1") for _ in range(2)
            ]
            assert [status for status, _ in held] == [101, 101]
            assert await _status(srv.port, upgrade("203.0.113.7"), "127.0.0.1") == 503
            # the same proxy, another client: served
            assert (await _open(stack, srv.port, upgrade("203.0.113.8"), "127.0.0.1"))[0] == 101


def test_trusted_proxies_read_the_nearest_untrusted_entry() -> None:
    proxies = TrustedProxies(["10.0.0.0/8", "127.0.0.1"])
    xff = [(b"x-forwarded-for", b"1.1.1.1, 2.2.2.2, 10.1.1.1")]
    assert proxies.client("127.0.0.1", xff) == "2.2.2.2"  # the client can forge 1.1.1.1 only
    assert proxies.client("192.0.2.1", xff) == "192.0.2.1"  # an untrusted peer
    assert proxies.client("127.0.0.1", [(b"x-forwarded-for", b"garbage")]) == "127.0.0.1"
    assert proxies.client("127.0.0.1", []) == "127.0.0.1"
    assert TrustedProxies().client("127.0.0.1", xff) == "127.0.0.1"  # off by default
    with pytest.raises(ValueError, match="not an IP address"):
        TrustedProxies(["proxy.example"])
