"""`acp-once serve`: the reference agent over WebSocket, with uvicorn."""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

import uvicorn
from starlette.applications import Starlette

from acp_once.server import DEFAULT_IDLE_TIMEOUT, DEFAULT_WRITE_TIMEOUT, create_app

if TYPE_CHECKING:
    from acp_once.agent.runtime import SessionAgent
    from acp_once.storage.base import SessionStore

__all__ = [
    "InsecureListen",
    "check_listen",
    "clustered",
    "is_loopback",
    "serve_reference",
    "uvicorn_config",
]

logger = logging.getLogger("acp_once.server")

_WS_HEADROOM = 1024 * 1024
"""uvicorn closes the socket (1009) above max_message_bytes + this; between the two a request
is answered -32600 and the connection lives on."""


class InsecureListen(ValueError):
    """Listening beyond this machine without a token."""


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_listen(host: str, token: str | None) -> None:
    """Refuse to serve beyond loopback without a token.

    Raises:
        InsecureListen: `host` is not a loopback address and there is no token.
    """
    if token is None and not is_loopback(host):
        raise InsecureListen(
            f"refusing to listen on {host} without a token: anyone who can reach it could "
            "drive the agent. Set ACP_ONCE_TOKEN (or pass --token), or listen on 127.0.0.1."
        )


_Agent = TypeVar("_Agent", bound="SessionAgent")


def clustered(
    agent: _Agent, store: SessionStore, *, node_id: str | None, lease_ttl: float
) -> _Agent:
    """`agent` as a cluster node when `store` is PostgreSQL (see `serve_reference`)."""
    from acp_once.storage.postgres import PostgresStore

    if isinstance(store, PostgresStore):
        from acp_once.agent.cluster import PostgresCoordinator

        coordinator = PostgresCoordinator(store, node_id=node_id, lease_ttl=lease_ttl)
        agent.use_coordinator(coordinator)
        logger.warning(
            "cluster node %s (instance %s), lease TTL %.1f s",
            coordinator.node_id,
            coordinator.instance,
            lease_ttl,
        )
    return agent


def uvicorn_config(
    app: Starlette,
    *,
    host: str,
    port: int,
    max_message_bytes: int,
    log_level: str = "info",
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",  # the app owns its HTTP connections; the agent is owned by the caller
        ws="websockets-sansio",
        ws_max_size=max_message_bytes + _WS_HEADROOM,
        log_level=log_level,
        timeout_graceful_shutdown=10,
    )


async def serve_reference(
    *,
    host: str,
    port: int,
    store: str,
    token: str | None,
    side_effects: Path,
    policy: Literal["hold", "steer"] = "hold",
    resume_interrupted: bool = False,
    max_connections: int,
    max_message_bytes: int,
    sock: socket.socket | None = None,
    on_server: Callable[[uvicorn.Server], None] | None = None,
    node_id: str | None = None,
    lease_ttl: float = 10.0,
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
    write_timeout: float = DEFAULT_WRITE_TIMEOUT,
) -> None:
    """Run the reference agent on `store` behind `create_app` until uvicorn is told to stop
    (SIGINT or SIGTERM, or `server.should_exit`); connections are closed, then the agent and
    the store.

    `sock`: an already listening socket to serve on instead of binding `host`:`port` (clients
    may connect at once: they wait in its backlog). `on_server` receives the uvicorn server
    before it starts (tests stop it with `should_exit`).

    On a PostgreSQL store the agent is a cluster node (`node_id`, default the host name;
    `lease_ttl` seconds before a dead node's sessions are taken over): any number of
    processes may serve the same store behind a load balancer (`acp_once.agent.cluster`).
    """
    from acp_once.agent.reference import ReferenceAgent
    from acp_once.storage import open_store

    check_listen(host, token)
    async with (
        open_store(store) as opened,
        clustered(
            ReferenceAgent(
                opened,
                side_effects=side_effects,
                policy=policy,
                resume_interrupted=resume_interrupted,
            ),
            opened,
            node_id=node_id,
            lease_ttl=lease_ttl,
        ) as agent,
    ):
        app = create_app(
            agent,
            token=token,
            max_connections=max_connections,
            max_message_bytes=max_message_bytes,
            idle_timeout=idle_timeout,
            write_timeout=write_timeout,
        )
        config = uvicorn_config(app, host=host, port=port, max_message_bytes=max_message_bytes)
        server = uvicorn.Server(config)
        if on_server is not None:
            on_server(server)
        shown = f"[{host}]" if ":" in host else host
        logger.warning(
            "ACP over WebSocket at ws://%s:%d/acp (%s)",
            shown,
            port,
            "bearer token required" if token is not None else "no token: loopback only",
        )
        await server.serve(sockets=[sock] if sock is not None else None)
