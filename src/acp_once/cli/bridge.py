"""`acp-once bridge -- CMD ARGS`: a stdio agent over WebSocket and Streamable HTTP, with uvicorn.

The same endpoint as `acp-once serve` (`/acp`, `/healthz`, bearer token, limits), with
`acp_once.bridge.Bridge` serving each connection from one child process.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence

import uvicorn

from acp_once.bridge import Bridge, BridgeError
from acp_once.cli import _eventloop
from acp_once.cli.serve import check_listen, listen, serve_until_stopped, uvicorn_config
from acp_once.server import create_app

__all__ = ["listen", "run_bridge", "serve_bridge"]

logger = logging.getLogger("acp_once.bridge")


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
        await serve_until_stopped(
            config, sock, token=token, on_server=on_server, handle_signals=handle_signals
        )


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
        _eventloop.run(
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
