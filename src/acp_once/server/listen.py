"""Listening for ACP over the network: the loopback rule, the socket, and uvicorn run on it.

sock = listen("127.0.0.1", 8765)
await serve_app(create_app(agent, token=token), sock, token=token)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib.util
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator

import anyio
import uvicorn
from starlette.applications import Starlette

from .app import AcpServer
from .guard import (
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
    DEFAULT_MAX_HALF_OPEN,
    DEFAULT_MAX_HALF_OPEN_PER_ADDRESS,
    HalfOpenGuard,
    guarded_protocol,
    is_loopback,
)
from .http_protocol import direct_http_protocol

__all__ = [
    "VERIFIED_UVICORN",
    "WEBSOCKET_PATH_ENV",
    "InsecureListen",
    "check_listen",
    "is_loopback",
    "listen",
    "raise_open_files_limit",
    "serve_app",
    "tune_gc_for_serving",
    "uvicorn_config",
    "websocket_protocol",
]

logger = logging.getLogger("acp_once.server")
address_logger = logging.getLogger("acp_once.server.address")

_WS_HEADROOM = 1024 * 1024
"""uvicorn closes the socket (1009) above max_message_bytes + this; between the two a request
is answered -32600 and the connection lives on."""


_BACKLOG = 4096
"""Connections the kernel may hold waiting to be accepted (it caps this at its somaxconn): a
burst of thousands of clients connecting at once is queued, not refused or made to retry."""


SERVING_GC_THRESHOLDS = (50_000, 50, 100)
"""The cyclic garbage collector's thresholds while serving (CPython's default: 700, 10, 10)."""


def tune_gc_for_serving() -> None:
    """Set this process's cyclic garbage collector up for a server holding many connections
    (`acp-once serve` calls it; a process-wide choice, so `serve_app` does not):
    what exists at start (modules, classes, schemas) is frozen out of every collection, and
    collections are rarer (`SERVING_GC_THRESHOLDS`).

    Why: with thousands of connections all prompting, a prompt's objects live for the
    seconds it waits, so with the default thresholds they reach the oldest generation, and a
    full collection (over every connection's objects: 1.3 s at 10,000 connections) runs
    every few seconds; measured with `benchmarks/bench_load.py` at 10,000 connections, this
    took a third of the CPU per prompt. Reference counting frees nearly everything at once
    (the engine breaks the cycles it makes); the collector is for the rest."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit (every connection is a
    file descriptor: the usual soft limit of 1,024 would refuse the 1,021st client). Returns
    the soft limit before and after; unchanged where it cannot be raised (or on Windows)."""
    try:
        import resource
    except ImportError:  # Windows: no such limit to raise
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return (soft, soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # e.g. an infinite hard limit the kernel refuses as a soft one
        return (soft, soft)
    logger.debug("open files limit raised from %d to %d", soft, hard)
    return (soft, hard)


class InsecureListen(ValueError):
    """Listening beyond this machine without a token."""


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
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


VERIFIED_UVICORN = frozenset({"0.55"})
"""The uvicorn minor versions the direct WebSocket path (`acp_once.server.websocket_protocol`,
which subclasses uvicorn's `websockets-sansio` protocol and uses its internals) and the direct
SSE writers (`acp_once.server.http_protocol`, over its h11 protocol) were checked against. On
any other version `uvicorn_config` uses uvicorn's own WebSocket protocol, and h11 without
SSE writers."""
WEBSOCKET_PATH_ENV = "ACP_ONCE_WEBSOCKET_PATH"
"""`stock`: use uvicorn's own WebSocket protocol even on a verified uvicorn (unset or `auto`:
the direct path where verified)."""


def _stock_websocket() -> str:
    # websockets-sansio where this uvicorn has it (no deprecated websockets API), else its default
    sansio = "uvicorn.protocols.websockets.websockets_sansio_impl"
    return "websockets-sansio" if importlib.util.find_spec(sansio) is not None else "auto"


def _verified() -> bool:
    """Whether this uvicorn is one the direct paths were verified against (`VERIFIED_UVICORN`)."""
    return ".".join(uvicorn.__version__.split(".")[:2]) in VERIFIED_UVICORN


def websocket_protocol() -> tuple[type[asyncio.Protocol] | str, str]:
    """The WebSocket protocol for `uvicorn.Config(ws=...)` and a sentence saying which: the
    direct path (`DirectWebSocketProtocol`) on a uvicorn in `VERIFIED_UVICORN`, else (or with
    `ACP_ONCE_WEBSOCKET_PATH=stock`) uvicorn's own, where ACP messages go through ASGI events
    with the same behaviour, at a higher cost per message."""
    version = uvicorn.__version__
    minor = ".".join(version.split(".")[:2])
    forced = os.environ.get(WEBSOCKET_PATH_ENV, "").strip().lower()
    if forced == "stock":
        reason = f"{WEBSOCKET_PATH_ENV}=stock"
    elif minor not in VERIFIED_UVICORN:
        reason = f"the direct path is not verified on uvicorn {version}"
    else:
        try:
            from .websocket_protocol import DirectWebSocketProtocol
        except ImportError as exc:  # defensive: a verified version always has the module
            reason = f"the direct path cannot be loaded ({exc})"
        else:
            return DirectWebSocketProtocol, f"WebSocket: direct path (uvicorn {version})"
    stock = _stock_websocket()
    return stock, f"WebSocket: uvicorn's {stock} protocol ({reason})"


_ACCEPT_BATCH = 512
"""Connections accepted at most each time the listening socket is ready."""
_ACCEPT_RETRY_S = 0.5
"""The pause before accepting again when the process is out of file descriptors."""


class _Acceptor:
    """Accepts the connections of a listening socket, every one waiting each time it is ready
    (up to `_ACCEPT_BATCH`), and hands each to the event loop with a fresh protocol.

    Why not the loop's own server: uvloop's libuv accepts one connection per turn of the
    loop, so when the loop is busy (a turn of ~60 ms at 500 busy Streamable HTTP clients) new
    connections wait in the kernel's backlog for seconds (measured: ~30 accepted a second, a
    prompt's p99 of 3-4 s against 0.24 s with every waiting connection accepted at once)."""

    def __init__(
        self,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._sock = sock
        self._factory = protocol_factory
        self._loop = loop
        self._fd = sock.fileno()
        self._reading = False
        self._retry: asyncio.TimerHandle | None = None
        self._handing: set[asyncio.Task[object]] = set()

    def start(self) -> None:
        self._sock.setblocking(False)
        self._loop.add_reader(self._fd, self._accept)
        self._reading = True

    def stop(self) -> None:
        """Accept no more connections (those accepted already are served)."""
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client left before we took it
            except OSError as exc:
                # EMFILE, ENFILE, ENOBUFS, ENOMEM: the connection waits in the backlog;
                # stop polling for a moment, or the loop would spin on the ready socket
                logger.warning("accepting connections failed (%s); trying again shortly", exc)
                self.stop()
                self._retry = self._loop.call_later(_ACCEPT_RETRY_S, self.start)
                return
            # asyncio leaves Nagle on for sockets it did not create as TCP
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(False)
            task = self._loop.create_task(self._hand_over(conn))
            self._handing.add(task)
            task.add_done_callback(self._handing.discard)

    async def _hand_over(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except Exception as exc:  # the socket went bad between accept and its transport
            logger.debug("an accepted connection could not be served: %s", exc)
            conn.close()


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (it re-raises SIGTERM once it has stopped,
    which would end the process before the agent, its leases and its store are closed), and
    with connections accepted by an `_Acceptor` instead of the event loop's server."""

    _acceptor: _Acceptor | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is None or len(sockets) != 1 or self.config.ssl is not None:
            await super().startup(sockets=sockets)
            return
        await super().startup(sockets=[])  # the lifespan, and no server of the loop's own
        if self.should_exit:
            return
        config = self.config
        factory = functools.partial(
            config.http_protocol_class,  # type: ignore[call-arg]
            config=config,
            server_state=self.server_state,
            app_state=self.lifespan.state,
        )
        self._acceptor = _Acceptor(sockets[0], factory, asyncio.get_running_loop())
        self._acceptor.start()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._acceptor is not None:
            self._acceptor.stop()  # first, as uvicorn stops its servers first
        await super().shutdown(sockets=sockets)


async def _stop_on_signals(server: uvicorn.Server) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            if server.should_exit:
                server.force_exit = True  # a second signal: stop waiting for connections
            server.should_exit = True


class _ClientMistakes(logging.Filter):
    """uvicorn logs a text frame that is not UTF-8 as an ERROR with a traceback, though it is
    the client's mistake and the connection is closed with 1007 as it should be: a warning,
    without the traceback, so a hostile client cannot fill the log with ERRORs."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Invalid UTF-8 sequence received from client.":
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


_CLIENT_MISTAKES = _ClientMistakes()


def uvicorn_config(
    app: Starlette,
    *,
    host: str,
    port: int,
    max_message_bytes: int,
    log_level: str | None = None,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    max_half_open: int = DEFAULT_MAX_HALF_OPEN,
    max_half_open_per_address: int = DEFAULT_MAX_HALF_OPEN_PER_ADDRESS,
    max_connections_per_address: int | None = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
) -> uvicorn.Config:
    """uvicorn's configuration for an ACP app: its lifespan on, `websockets-sansio` with a
    direct channel for ACP messages (`acp_once.server.websocket_protocol`) on the uvicorn
    versions it was verified against, uvicorn's own WebSocket protocol otherwise
    (`websocket_protocol`), a
    WebSocket size limit just above `max_message_bytes` (the app answers -32600 below it), and
    h11 with a `HalfOpenGuard` (a request's headers due within `header_timeout` seconds, at
    most `max_half_open` connections waiting for them, `max_half_open_per_address` per client
    address; over a cap the oldest is closed), and at most `max_connections_per_address`
    established connections per client address (one more is answered 503; None: no cap),
    that address read from the forwarding headers of the app's trusted proxies
    (`AcpServer.proxies`). uvicorn's own proxy headers handling is off.

    Raises:
        ValueError: a non-positive timeout or cap.
    """
    acp: AcpServer | None = getattr(app.state, "acp", None)
    ws, _ = websocket_protocol()
    guard = HalfOpenGuard(
        header_timeout=header_timeout,
        max_half_open=max_half_open,
        max_half_open_per_address=max_half_open_per_address,
        max_connections_per_address=max_connections_per_address,
        proxies=acp.proxies if acp is not None else None,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        # with direct SSE writers where verified (`acp_once.server.http_protocol`)
        http=direct_http_protocol(guard) if _verified() else guarded_protocol(guard),
        # an idle kept-alive connection is also closed by the guard's header deadline
        timeout_keep_alive=5,
        # the app reads forwarded addresses itself, from trusted proxies only
        # (`create_app(forwarded_allow_ips=...)`): uvicorn would believe 127.0.0.1's
        proxy_headers=False,
        lifespan="on",  # the app owns its HTTP connections; the agent is owned by the caller
        # uvicorn's websockets-sansio protocol with a direct channel for ACP connections,
        # where verified; else uvicorn's own
        ws=ws,
        ws_max_size=max_message_bytes + _WS_HEADROOM,
        # uvicorn's records go to the root logger's handlers in the application's format, at
        # its level (None: uvicorn's loggers inherit it) rather than uvicorn's own INFO setup
        log_config=None,
        log_level=log_level,
        timeout_graceful_shutdown=10,
    )
    # after Config, which configures uvicorn's loggers; a filter object is added only once
    logging.getLogger("uvicorn.error").addFilter(_CLIENT_MISTAKES)
    return config


async def serve_app(
    app: Starlette,
    sock: socket.socket,
    *,
    on_server: Callable[[uvicorn.Server], None] | None = None,
    handle_signals: bool = True,
    max_connections_per_address: int | None = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
) -> None:
    """Serve `app` (made by `create_app`) with uvicorn (`uvicorn_config`, with
    `max_connections_per_address`) on the listening `sock`, with the open files limit raised
    (`raise_open_files_limit`), until SIGINT or SIGTERM (with `handle_signals`; a second one
    stops waiting for open connections) or `server.should_exit`. The URL is announced first,
    one INFO line on the `acp_once.server.address` logger (tests and the demo read it; the CLI
    shows it at its default level) that also says which WebSocket path serves
    (`websocket_protocol`). `on_server` receives the uvicorn server before it
    starts."""
    acp: AcpServer = app.state.acp
    host, port = sock.getsockname()[:2]
    raise_open_files_limit()
    config = uvicorn_config(
        app,
        host=host,
        port=port,
        max_message_bytes=acp.max_message_bytes,
        max_connections_per_address=max_connections_per_address,
    )
    server = _Server(config)
    if on_server is not None:
        on_server(server)
    shown = f"[{host}]" if ":" in host else host
    address_logger.info(
        "ACP over WebSocket at ws://%s:%d/acp (%s; %s)",
        shown,
        port,
        "bearer token required" if acp.token_required else "no token: loopback only",
        websocket_protocol()[1],  # which WebSocket path serves, said once
    )
    async with anyio.create_task_group() as tg:
        # signal handlers can only be set from the main thread (as in uvicorn's own)
        if handle_signals and threading.current_thread() is threading.main_thread():
            tg.start_soon(_stop_on_signals, server)
        await server.serve(sockets=[sock])
        tg.cancel_scope.cancel()
