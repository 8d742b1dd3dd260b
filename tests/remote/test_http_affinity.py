"""Cookie affinity over Streamable HTTP (digest 7.2): "Clients MUST accept, store and return
cookies for the connection's lifetime".

A load balancer that pins a connection to one node does it with a cookie set on the initialize
response. The test puts such a balancer (an ASGI wrapper) in front of the real server and checks
that every later request of the connection (POSTs, both GET streams, the DELETE) carries the
cookie back, and that a new connection starts without the old one's cookie.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
import uvicorn

from acp_once.agent.reference import ReferenceAgent
from acp_once.client import AcpClient, HttpLauncher
from acp_once.server import create_app
from acp_once.storage import open_store
from acp_once.transports.http import CONNECTION_ID_HEADER
from tests.remote.harness import listening_socket

pytestmark = pytest.mark.anyio

TIMEOUT = 30.0

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class StickyBalancer:
    """Sets `node=<n>` on each initialize response (a new value per connection) and records the
    `Cookie` header of every request to /acp."""

    app: App
    issued: list[str] = field(default_factory=list)
    seen: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    """(method, Acp-Connection-Id, Cookie) of each request after an initialize."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/acp":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        connection = headers.get(CONNECTION_ID_HEADER.lower())
        if connection is None and scope["method"] == "POST":
            cookie = f"node=n{len(self.issued) + 1}"
            self.issued.append(cookie)

            async def set_cookie(message: Message) -> None:
                if message["type"] == "http.response.start":
                    extra = (b"set-cookie", f"{cookie}; Path=/; HttpOnly".encode())
                    message = {**message, "headers": [*message.get("headers", []), extra]}
                await send(message)

            await self.app(scope, receive, set_cookie)
            return
        self.seen.append((scope["method"], connection, headers.get("cookie")))
        await self.app(scope, receive, send)


async def test_http_client_returns_the_affinity_cookie_for_the_connection_lifetime(
    tmp_path: Path,
) -> None:
    sock = listening_socket()
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/acp"
    with anyio.fail_after(TIMEOUT):
        async with (
            open_store(f"sqlite:{tmp_path / 'agent.sqlite3'}") as store,
            ReferenceAgent(store, side_effects=tmp_path / "effects") as agent,
        ):
            balancer = StickyBalancer(create_app(agent))
            # lifespan "on": the app owns its HTTP connections (as in `acp-once serve`)
            server = uvicorn.Server(uvicorn.Config(balancer, lifespan="on", log_level="warning"))
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.serve, [sock])
                try:
                    for _ in range(2):  # two connections, one after the other
                        async with AcpClient(HttpLauncher(url)) as client:
                            session = await client.new_session("/w")
                            await session.prompt("hello")
                finally:
                    server.should_exit = True

    assert balancer.issued == ["node=n1", "node=n2"]
    by_connection: dict[str | None, set[str | None]] = {}
    methods: dict[str | None, set[str]] = {}
    for method, connection, cookie in balancer.seen:
        by_connection.setdefault(connection, set()).add(cookie)
        methods.setdefault(connection, set()).add(method)
    assert None not in by_connection, "a request after initialize without Acp-Connection-Id"
    assert len(by_connection) == 2
    # each connection returned exactly its own cookie, on POSTs, GET streams and the DELETE
    assert sorted(by_connection.values(), key=str) == [{"node=n1"}, {"node=n2"}]
    for seen_methods in methods.values():
        assert {"POST", "GET", "DELETE"} <= seen_methods
