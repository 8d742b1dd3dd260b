"""Ready-made servers: the reference agent (`acp-once serve`) and a bridged stdio agent
(`acp-once bridge`), each on uvicorn until SIGINT or SIGTERM."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

import uvicorn

from acp_once.bridge import Bridge

from .app import DEFAULT_IDLE_TIMEOUT, DEFAULT_WRITE_TIMEOUT, create_app
from .listen import check_listen, listen, serve_app

if TYPE_CHECKING:
    from acp_once.agent.runtime import SessionAgent
    from acp_once.storage.base import SessionStore

__all__ = ["clustered", "serve_bridge", "serve_reference"]

logger = logging.getLogger("acp_once.server")


_Agent = TypeVar("_Agent", bound="SessionAgent")


def clustered(
    agent: _Agent, store: SessionStore, *, node_id: str | None, lease_ttl: float
) -> _Agent:
    """`agent` as a cluster node when `store` is PostgreSQL (see `serve_reference`)."""
    from acp_once.storage.postgres import PostgresStore

    if isinstance(store, PostgresStore):
        from acp_once.cluster import PostgresCoordinator

        coordinator = PostgresCoordinator(store, node_id=node_id, lease_ttl=lease_ttl)
        agent.use_coordinator(coordinator)
        logger.warning(
            "cluster node %s (instance %s), lease TTL %.1f s",
            coordinator.node_id,
            coordinator.instance,
            lease_ttl,
        )
    return agent


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
    handle_signals: bool = True,
    allowed_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] = (),
) -> None:
    """Run the reference agent on `store` behind `create_app` until SIGINT or SIGTERM (with
    `handle_signals`) or `server.should_exit`; connections are closed, then the agent (a
    cluster node gives its leases up) and the store.

    `sock`: an already listening socket to serve on instead of binding `host`:`port` (clients
    may connect at once: they wait in its backlog). `on_server` receives the uvicorn server
    before it starts (tests stop it with `should_exit`).

    Raises:
        InsecureListen: `host` is not loopback and there is no token.
        OSError: `host`:`port` cannot be bound.

    On a PostgreSQL store the agent is a cluster node (`node_id`, default the host name;
    `lease_ttl` seconds before a dead node's sessions are taken over): any number of
    processes may serve the same store behind a load balancer (`acp_once.cluster`).
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
            allowed_origins=allowed_origins,
            allowed_hosts=allowed_hosts,
        )
        with contextlib.ExitStack() as owned:
            if sock is None:
                sock = owned.enter_context(listen(host, port))
            await serve_app(app, sock, on_server=on_server, handle_signals=handle_signals)


async def serve_bridge(
    command: Sequence[str],
    *,
    sock: socket.socket,
    token: str | None,
    max_connections: int,
    max_message_bytes: int,
    bridge: Callable[[Sequence[str]], Bridge] = Bridge,
    on_server: Callable[[uvicorn.Server], None] | None = None,
    handle_signals: bool = True,
    allowed_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] = (),
) -> None:
    """Start the agent `command`, then serve it at ws://HOST:PORT/acp (and http://) on `sock`
    until SIGINT or SIGTERM (or `server.should_exit`); then the connections are closed and the
    agent is stopped (stdin closed, then SIGTERM, then SIGKILL).

    Raises:
        InsecureListen: `sock` is not on a loopback address and there is no token.
        BridgeError: the agent could not be started or initialized.
    """
    check_listen(sock.getsockname()[0], token)
    async with bridge(command) as running:
        app = create_app(
            None,
            token=token,
            max_connections=max_connections,
            max_message_bytes=max_message_bytes,
            handler=running.serve,
            allowed_origins=allowed_origins,
            allowed_hosts=allowed_hosts,
        )
        await serve_app(app, sock, on_server=on_server, handle_signals=handle_signals)
