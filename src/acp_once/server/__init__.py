"""ACP over the network, the server side: the ASGI app and running it.

- `app`: `AcpServer` and `create_app`, the Starlette app serving one agent (or a handler such
  as `acp_once.bridge.Bridge.serve`) at `/acp` over WebSocket and Streamable HTTP; mountable in
  any Starlette or FastAPI app; its limits and timeouts as values (`ServerLimits`,
  `ServerTimeouts`).
- `listen`: the loopback rule (`check_listen`), the listening socket, and uvicorn run on it.
- `run`: your agent (`serve_agent(EchoAgent, port=8765, store="sqlite:s.db")`), the
  reference agent (`serve_agent(reference_factory(...))`) and a bridged stdio agent
  (`serve_bridge`) served until SIGINT or SIGTERM.
"""

from acp_once.support.server_options import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_WRITE_TIMEOUT,
    ServerLimits,
    ServerTimeouts,
)

from .app import AcpServer, ConnectionHandler, create_app
from .listen import InsecureListen, check_listen, is_loopback, listen, serve_app
from .run import serve_agent

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
    "serve_agent",
    "serve_app",
]
