"""`acp-once serve`: the reference agent over WebSocket, with uvicorn."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

import anyio
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
    "listen",
    "serve_reference",
    "serve_until_stopped",
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


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on `host`:`port` (`port` 0: a free one), ready for uvicorn.

    Raises:
        OSError: the address cannot be bound (in use, not local, ...).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and the
    # accepted ones inherit it. With Nagle on, an answer written just after an update waits
    # for the client's delayed ACK: 40 ms per prompt. (uvicorn binds with proto 0.)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: it re-raises SIGTERM once it has stopped,
    which would end the process before the agent, its leases and its store are closed."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_until_stopped(
    config: uvicorn.Config,
    sock: socket.socket,
    *,
    token: str | None,
    on_server: Callable[[uvicorn.Server], None] | None = None,
    handle_signals: bool = True,
) -> None:
    """Serve `config.app` on `sock` until SIGINT or SIGTERM (a second one stops waiting for
    open connections) or `server.should_exit`; announces the URL on the `acp_once.server`
    logger first (tests and the demo read it)."""
    server = _Server(config)
    if on_server is not None:
        on_server(server)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    logger.warning(
        "ACP over WebSocket at ws://%s:%d/acp (%s)",
        shown,
        port,
        "bearer token required" if token is not None else "no token: loopback only",
    )
    async with anyio.create_task_group() as tg:
        # signal handlers can only be set from the main thread (as in uvicorn's own)
        if handle_signals and threading.current_thread() is threading.main_thread():
            tg.start_soon(_stop_on_signals, server)
        await server.serve(sockets=[sock])
        tg.cancel_scope.cancel()


async def _stop_on_signals(server: uvicorn.Server) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            if server.should_exit:
                server.force_exit = True  # a second signal: stop waiting for connections
            server.should_exit = True


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
    handle_signals: bool = True,
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
        )
        config = uvicorn_config(app, host=host, port=port, max_message_bytes=max_message_bytes)
        with contextlib.ExitStack() as owned:
            if sock is None:
                sock = owned.enter_context(listen(host, port))
            await serve_until_stopped(
                config, sock, token=token, on_server=on_server, handle_signals=handle_signals
            )
