"""ACP over the network, the server side: the ASGI app and running it.

- `app`: `AcpServer` and `create_app`, the Starlette app serving one agent (or a handler such
  as `acp_once.bridge.Bridge.serve`) at `/acp` over WebSocket and Streamable HTTP; mountable in
  any Starlette or FastAPI app.
- `options`: its limits and timeouts as values (`ServerLimits`, `ServerTimeouts`).
- `listen`: the loopback rule (`check_listen`), the listening socket, and uvicorn run on it.
- `run`: the reference agent (`serve_reference`) and a bridged stdio agent (`serve_bridge`)
  served until SIGINT or SIGTERM.

The names below are imported when first used: `acp_once.server.options` (no third-party
package) is then importable without the `server` extra, e.g. by the CLI for its defaults.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import AcpServer, ConnectionHandler, create_app
    from .listen import InsecureListen, check_listen, is_loopback, listen, serve_app
    from .options import (
        DEFAULT_IDLE_TIMEOUT,
        DEFAULT_MAX_CONNECTIONS,
        DEFAULT_MAX_MESSAGE_BYTES,
        DEFAULT_WRITE_TIMEOUT,
        ServerLimits,
        ServerTimeouts,
    )

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_WRITE_TIMEOUT",
    "AcpServer",
    "ConnectionHandler",
    "InsecureListen",
    "ServerLimits",
    "ServerTimeouts",
    "check_listen",
    "create_app",
    "is_loopback",
    "listen",
    "serve_app",
]

_HOME = {
    "DEFAULT_IDLE_TIMEOUT": "options",
    "DEFAULT_MAX_CONNECTIONS": "options",
    "DEFAULT_MAX_MESSAGE_BYTES": "options",
    "DEFAULT_WRITE_TIMEOUT": "options",
    "ServerLimits": "options",
    "ServerTimeouts": "options",
    "AcpServer": "app",
    "ConnectionHandler": "app",
    "create_app": "app",
    "InsecureListen": "listen",
    "check_listen": "listen",
    "is_loopback": "listen",
    "listen": "listen",
    "serve_app": "listen",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
