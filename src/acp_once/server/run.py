"""Ready-made servers: your agent (`serve_agent`, `acp-once serve MODULE:FACTORY`), the
reference agent (`acp-once serve`) and a bridged stdio agent (`acp-once bridge`), each on
uvicorn until SIGINT or SIGTERM; with a tokens file, its tenants' tokens are read again on
SIGHUP."""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

import anyio
import anyio.to_thread
import uvicorn

from acp_once.agent.factory import AgentFactory
from acp_once.agent.interface import Agent
from acp_once.bridge import Bridge
from acp_once.support.busypoll import DEFAULT_LIMIT_S
from acp_once.support.server_options import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_WRITE_TIMEOUT,
    ServerOptions,
)

from .app import AcpServer, create_app
from .listen import check_listen, listen, serve_app
from .tenants import TokensFileError, load_tokens

if TYPE_CHECKING:
    from acp_once.agent.runtime import SessionAgent
    from acp_once.cluster import PostgresCoordinator, ShardedCoordinator
    from acp_once.storage.base import SessionStore

__all__ = ["clustered", "reference_factory", "serve_agent", "serve_bridge"]

logger = logging.getLogger("acp_once.server")


_Agent = TypeVar("_Agent", bound="SessionAgent")


def clustered(
    agent: _Agent,
    store: SessionStore,
    *,
    node_id: str | None,
    lease_ttl: float,
    lease_grace: float | None = None,
) -> _Agent:
    """`agent` as a cluster node when `store` is PostgreSQL, or sharded over PostgreSQL
    databases (see `serve_agent`)."""
    from acp_once.storage.postgres import PostgresStore
    from acp_once.storage.sharded import ShardedStore

    coordinator: PostgresCoordinator | ShardedCoordinator
    if isinstance(store, PostgresStore):
        from acp_once.cluster import PostgresCoordinator

        coordinator = PostgresCoordinator(
            store, node_id=node_id, lease_ttl=lease_ttl, lease_grace=lease_grace
        )
    elif isinstance(store, ShardedStore) and all(
        isinstance(shard, PostgresStore) for shard in store.shards
    ):
        from acp_once.cluster import ShardedCoordinator

        coordinator = ShardedCoordinator(
            store, node_id=node_id, lease_ttl=lease_ttl, lease_grace=lease_grace
        )
    else:
        return agent
    agent.use_coordinator(coordinator)
    logger.warning(
        "cluster node %s (instance %s), lease TTL %.1f s",
        coordinator.node_id,
        coordinator.instance,
        lease_ttl,
    )
    return agent


def _shared(store: SessionStore) -> bool:
    """Whether several nodes may serve `store` (PostgreSQL, or sharded over PostgreSQL
    databases): each is then a cluster node."""
    from acp_once.storage.postgres import PostgresStore
    from acp_once.storage.sharded import ShardedStore

    if isinstance(store, ShardedStore):
        return all(isinstance(shard, PostgresStore) for shard in store.shards)
    return isinstance(store, PostgresStore)


def _connection_prefix(store: SessionStore, node_id: str | None) -> str:
    """What the `Acp-Connection-Id`s a node issues begin with: on a cluster store its node id
    (`node_id`, default the host name) and a dot, so a load balancer routes a Streamable HTTP
    connection's requests to the node holding it (`create_app`'s `connection_prefix`); else
    nothing. A node id that is not made of letters, digits, `_` and `-` (a host name with
    dots) cannot be matched that way: no prefix, and a warning says so."""
    if not _shared(store):
        return ""
    from acp_once.cluster.coordinator import default_node_id

    name = node_id or default_node_id()
    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        return f"{name}."
    logger.warning(
        "node id %r is not made of letters, digits, '_' and '-': the connection ids this node "
        "issues do not name it, so a load balancer cannot route by them (give --node-id)",
        name,
    )
    return ""


def reference_factory(
    *,
    side_effects: Path,
    policy: Literal["hold", "steer"] = "hold",
    resume_interrupted: bool = False,
) -> AgentFactory:
    """The reference agent as a factory for `serve_agent` (`side_effects`: the directory of
    its per-session logs; `policy`, `resume_interrupted`: as `ReferenceAgent` takes them)."""
    from acp_once.agent.reference import ReferenceAgent

    def reference(opened: SessionStore) -> ReferenceAgent:
        return ReferenceAgent(
            opened,
            side_effects=side_effects,
            policy=policy,
            resume_interrupted=resume_interrupted,
        )

    return reference


async def serve_agent(
    factory: AgentFactory,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    store: str | Sequence[str] = "memory:",
    token: str | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    sock: socket.socket | None = None,
    on_server: Callable[[uvicorn.Server], None] | None = None,
    node_id: str | None = None,
    lease_ttl: float = 10.0,
    lease_grace: float | None = None,
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
    write_timeout: float = DEFAULT_WRITE_TIMEOUT,
    handle_signals: bool = True,
    allowed_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] = (),
    tokens_file: Path | None = None,
    migrate: bool = True,
    max_connections_per_address: int | None = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
    forwarded_allow_ips: Sequence[str] = (),
    sqlite_writer: bool = True,
    sqlite_busy_poll_s: float = DEFAULT_LIMIT_S,
) -> None:
    """Serve the agent `factory` makes at ws://HOST:PORT/acp and http://HOST:PORT/acp until
    SIGINT or SIGTERM (with `handle_signals`) or `server.should_exit`; then connections are
    closed, then the agent (a cluster node gives its leases up) and the store.

    `factory`: a `SessionAgent` subclass or a callable taking the opened store (or nothing)
    and returning an `Agent` (`acp_once.agent.factory`), e.g. `serve_agent(EchoAgent)`.
    `store`: the URL `open_store` takes (`memory:`, `sqlite:PATH`, `postgresql://...`), or a
    list of two or more `postgresql://` URLs: one store sharded over those databases.

    `tokens_file` (instead of `token`): the tenants' tokens (`acp_once.server.tenants`), read
    again on SIGHUP (with `handle_signals`): a removed token's new connections are refused,
    an added one is let in; a file that cannot be read or parsed then leaves the tokens as
    they were (logged as an error, without any token).

    `sock`: an already listening socket to serve on instead of binding `host`:`port` (clients
    may connect at once: they wait in its backlog). `on_server` receives the uvicorn server
    before it starts (tests stop it with `should_exit`).

    `max_connections_per_address`: established connections of one client address at most
    (None: no cap; see `acp_once.server.guard`). `forwarded_allow_ips`: the reverse proxies
    whose forwarding headers name the client (`acp_once.server.proxies`; none by default).

    `sqlite_writer`: a SQLite store writes user messages and retained updates in a process of
    its own (`acp_once.storage.sqlite.writer`), beside the event loop that serves the
    connections (`benchmarks/README.md`: more prompts/s with many busy connections); False
    writes them on the event loop. `sqlite_busy_poll_s`: how long the event loop then polls
    for the writer's answers after each batch instead of sleeping (`acp_once.support.busypoll`:
    lower latency for some CPU; 0: never).

    `migrate`: apply the store's pending schema migrations when it opens; with False a schema
    that is out of date raises `SchemaOutOfDate` (naming `acp-once db migrate`) before anything
    is served (`acp-once serve` passes False unless `--migrate`, or the store is new).

    On a PostgreSQL store a `SessionAgent` is a cluster node (`node_id`, default the host name;
    `lease_ttl` seconds before a dead node's sessions are taken over; `lease_grace` seconds a
    node keeps an idle session's lease, None: three times `lease_ttl`): any number of
    processes may serve the same store behind a load balancer (`acp_once.cluster`); the
    connection ids it issues begin with its node id and a dot (`connection_prefix`), which
    the balancer routes a Streamable HTTP connection's requests by.

    Raises:
        InsecureListen: `host` is not loopback and there is no token.
        OSError: `host`:`port` cannot be bound.
        FactoryError: `factory` made something that is not an `Agent`.
        SchemaOutOfDate: `migrate` is False and the store's schema is out of date.
        StorageError: the store cannot be opened.
        TokensFileError: `tokens_file` cannot be read or is not valid.
        ValueError: both `token` and `tokens_file`, or a negative `sqlite_busy_poll_s`.
    """
    from acp_once.agent.factory import build_agent, entered
    from acp_once.agent.runtime import SessionAgent
    from acp_once.storage import open_store

    if token is not None and tokens_file is not None:
        raise ValueError("give one token or a tokens file, not both")
    tokens = load_tokens(tokens_file) if tokens_file is not None else None
    # tenants' tokens protect the server as one token does ("": a token, none named here)
    check_listen(host, token if tokens is None else "")

    async with open_store(
        store,
        migrate=migrate,
        sqlite_writer=sqlite_writer,
        sqlite_busy_poll_s=sqlite_busy_poll_s,
    ) as opened:
        made = await build_agent(factory, opened)
        prefix = ""
        if isinstance(made, SessionAgent):
            made = clustered(
                made, opened, node_id=node_id, lease_ttl=lease_ttl, lease_grace=lease_grace
            )
            prefix = _connection_prefix(opened, node_id)
        async with entered(made) as agent:
            await _serve_entered(
                agent,
                connection_prefix=prefix,
                host=host,
                port=port,
                token=token,
                tokens=tokens,
                tokens_file=tokens_file,
                sock=sock,
                on_server=on_server,
                handle_signals=handle_signals,
                max_connections_per_address=max_connections_per_address,
                options={
                    "max_connections": max_connections,
                    "max_message_bytes": max_message_bytes,
                    "idle_timeout": idle_timeout,
                    "write_timeout": write_timeout,
                },
                allowed_origins=allowed_origins,
                allowed_hosts=allowed_hosts,
                forwarded_allow_ips=forwarded_allow_ips,
            )


async def _serve_entered(
    agent: Agent,
    *,
    connection_prefix: str,
    host: str,
    port: int,
    token: str | None,
    tokens: Mapping[str, str] | None,
    tokens_file: Path | None,
    sock: socket.socket | None,
    on_server: Callable[[uvicorn.Server], None] | None,
    handle_signals: bool,
    max_connections_per_address: int | None,
    options: ServerOptions,
    allowed_origins: Sequence[str],
    allowed_hosts: Sequence[str],
    forwarded_allow_ips: Sequence[str],
) -> None:
    app = create_app(
        agent,
        token=token,
        tokens=tokens,
        allowed_origins=allowed_origins,
        allowed_hosts=allowed_hosts,
        forwarded_allow_ips=forwarded_allow_ips,
        connection_prefix=connection_prefix,
        **options,
    )
    with contextlib.ExitStack() as owned:
        if sock is None:
            sock = owned.enter_context(listen(host, port))
        async with anyio.create_task_group() as tg:
            # signal handlers can only be set from the main thread
            main = threading.current_thread() is threading.main_thread()
            if tokens_file is not None and handle_signals and main:
                tg.start_soon(_reload_on_sighup, app.state.acp, tokens_file)
            await serve_app(
                app,
                sock,
                on_server=on_server,
                handle_signals=handle_signals,
                max_connections_per_address=max_connections_per_address,
            )
            tg.cancel_scope.cancel()


async def _reload_on_sighup(server: AcpServer, path: Path) -> None:
    """Read the tenants' tokens from `path` again on every SIGHUP, until cancelled."""
    with anyio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            try:
                tokens = await anyio.to_thread.run_sync(load_tokens, path)
            except TokensFileError as exc:  # its message names the line, never a token
                logger.error("tokens not reloaded, the previous ones stay: %s", exc)
                continue
            closed = server.set_tokens(tokens)
            # at the default level (warning): an operator sees the reload took effect
            logger.warning(
                "tokens reloaded from %s: %d tenants, %d connection(s) of removed tokens closed",
                path,
                len(tokens),
                closed,
            )


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
    tokens_file: Path | None = None,
    forwarded_allow_ips: Sequence[str] = (),
) -> None:
    """Start the agent `command`, then serve it at ws://HOST:PORT/acp (and http://) on `sock`
    until SIGINT or SIGTERM (or `server.should_exit`); then the connections are closed and the
    agent is stopped (stdin closed, then SIGTERM, then SIGKILL).

    `tokens_file` (instead of `token`): the tenants' tokens, read again on SIGHUP, as for
    `serve_agent`; the bridge keeps the tenants' sessions apart (`acp_once.bridge`).
    `forwarded_allow_ips`: as for `serve_agent`.

    Raises:
        InsecureListen: `sock` is not on a loopback address and there is no token.
        BridgeError: the agent could not be started or initialized.
        TokensFileError: `tokens_file` cannot be read or is not valid.
        ValueError: both `token` and `tokens_file`.
    """
    if token is not None and tokens_file is not None:
        raise ValueError("give one token or a tokens file, not both")
    tokens = load_tokens(tokens_file) if tokens_file is not None else None
    check_listen(sock.getsockname()[0], token if tokens is None else "")
    async with bridge(command) as running:
        app = create_app(
            None,
            token=token,
            tokens=tokens,
            max_connections=max_connections,
            max_message_bytes=max_message_bytes,
            handler=running.serve,
            allowed_origins=allowed_origins,
            allowed_hosts=allowed_hosts,
            forwarded_allow_ips=forwarded_allow_ips,
        )
        async with anyio.create_task_group() as tg:
            main = threading.current_thread() is threading.main_thread()
            if tokens_file is not None and handle_signals and main:
                tg.start_soon(_reload_on_sighup, app.state.acp, tokens_file)
            await serve_app(app, sock, on_server=on_server, handle_signals=handle_signals)
            tg.cancel_scope.cancel()
