"""`acp-once bridge -- CMD ARGS`: a stdio agent over WebSocket and Streamable HTTP, with uvicorn.

The same endpoint as `acp-once serve` (`/acp`, `/healthz`, bearer token, limits), with
`acp_once.bridge.Bridge` serving each connection from one child process
(`acp_once.server.run.serve_bridge`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from acp_once.bridge import BridgeError
from acp_once.cli import _eventloop
from acp_once.server.listen import listen
from acp_once.server.run import serve_bridge
from acp_once.server.tenants import TokensFileError

__all__ = ["run_bridge"]

logger = logging.getLogger("acp_once.bridge")


def run_bridge(
    command: Sequence[str],
    *,
    host: str,
    port: int,
    token: str | None,
    max_connections: int,
    max_message_bytes: int,
    allowed_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] = (),
    tokens_file: Path | None = None,
    forwarded_allow_ips: Sequence[str] = (),
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
                allowed_origins=allowed_origins,
                allowed_hosts=allowed_hosts,
                tokens_file=tokens_file,
                forwarded_allow_ips=forwarded_allow_ips,
            )
        )
    except (BridgeError, TokensFileError) as exc:
        logger.error("%s", exc)
        return 1
    finally:
        sock.close()
    return 0
