"""`acp-once bridge -- CMD ARGS`: a stdio agent over WebSocket and Streamable HTTP, with uvicorn.

The same endpoint as `acp-once serve` (`/acp`, `/healthz`, bearer token, limits), with
`acp_once.bridge.Bridge` serving each connection from one child process.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Iterator, Sequence

import anyio
import uvicorn

from acp_once.bridge import Bridge, BridgeError
from acp_once.cli.serve import check_listen, uvicorn_config
from acp_once.server import create_app

__all__ = ["listen", "run_bridge", "serve_bridge"]

logger = logging.getLogger("acp_once.bridge")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: it re-raises SIGTERM once it has stopped,
    which would end the process before the bridge stops its agent."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on `host`:`port` (`port` 0: a free one), ready for uvicorn.

    Raises:
        OSError: the address cannot be bound (in use, not local, ...).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and the
    # accepted ones inherit it. With Nagle on, an answer written just after an update waits
    # for the client's delayed ACK: 40 ms per prompt.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


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
) -> None:
    """Start the agent `command`, then serve it at ws://HOST:PORT/acp (and http://) on `sock`
    until SIGINT or SIGTERM (or `server.should_exit`); then the connections are closed and the
    agent is stopped (stdin closed, then SIGTERM, then SIGKILL).

    Raises:
        InsecureListen: `sock` is not on a loopback address and there is no token.
        BridgeError: the agent could not be started or initialized.
    """
    host, port = sock.getsockname()[:2]
    check_listen(host, token)
    async with bridge(command) as running:
        app = create_app(
            None,
            token=token,
            max_connections=max_connections,
            max_message_bytes=max_message_bytes,
            handler=running.serve,
        )
        config = uvicorn_config(app, host=host, port=port, max_message_bytes=max_message_bytes)
        server = _Server(config)
        if on_server is not None:
            on_server(server)
        shown = f"[{host}]" if ":" in host else host
        logger.warning(
            "ACP over WebSocket at ws://%s:%d/acp (%s)",
            shown,
            port,
            "bearer token required" if token is not None else "no token: loopback only",
        )
        async with anyio.create_task_group() as tg:
            if handle_signals:
                tg.start_soon(_stop_on_signals, server)
            await server.serve(sockets=[sock])
            tg.cancel_scope.cancel()


async def _stop_on_signals(server: uvicorn.Server) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            if server.should_exit:
                server.force_exit = True  # a second signal: stop waiting for connections
            server.should_exit = True


def run_bridge(
    command: Sequence[str],
    *,
    host: str,
    port: int,
    token: str | None,
    max_connections: int,
    max_message_bytes: int,
) -> int:
    """What `acp-once bridge` runs; returns the exit code (1: the address or the agent failed,
    with the reason on stderr)."""
    try:
        sock = listen(host, port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        return 1
    try:
        anyio.run(
            lambda: serve_bridge(
                command,
                sock=sock,
                token=token,
                max_connections=max_connections,
                max_message_bytes=max_message_bytes,
            )
        )
    except BridgeError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        sock.close()
    return 0
