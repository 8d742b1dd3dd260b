"""The `acp-once` command line."""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import logging
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import anyio
import typer

from acp_once.cli import _eventloop
from acp_once.cli.stdio_agent import configure_logging, data_dir, factory_db, make_store_dir
from acp_once.support.busypoll import DEFAULT_LIMIT_S
from acp_once.support.server_options import (
    DEFAULT_LIMITS,
    DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
    DEFAULT_TIMEOUTS,
)

if TYPE_CHECKING:
    from acp_once.agent.factory import AgentFactory


def _fold_help_cells() -> None:
    """Fold, never cut, what does not fit a help table's cell (an option's name, a long
    default): typer builds its tables with rich's default column overflow, an ellipsis, and at
    80 columns `--max-connections-per-address` would end in "…"."""
    from rich.table import Column, Table
    from typer import rich_utils

    class FoldingTable(Table):
        def add_row(self, *renderables: Any, **kwargs: Any) -> None:
            while len(self.columns) < len(renderables):
                self.columns.append(Column(_index=len(self.columns), overflow="fold"))
            for column in self.columns:
                column.overflow = "fold"
            super().add_row(*renderables, **kwargs)

    rich_utils.Table = FoldingTable  # type: ignore[attr-defined]


_fold_help_cells()

app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode="markdown",
    help="acp-once: ACP v2 where a prompt is inserted at most once.",
)

# What each extra installs, by import name: the base install runs `agent`, `prompt`, `demo`,
# `check` and `db` over stdio and SQLite; a command or URL that needs more says which extra.
_EXTRAS = {
    "server": ("starlette", "uvicorn", "websockets", "httpx", "h11"),
    "postgres": ("psycopg", "psycopg_pool"),
    "langgraph": ("langgraph", "langchain_core"),
}
_HINTS = {"postgres": " (and 'psycopg[binary]' for psycopg's bundled libpq)"}
_URL_SCHEMES = ("ws://", "wss://", "http://", "https://")
_BUSY_POLL_MAX_MS = 1000.0  # polling longer than a second for a batch only burns the core


def _missing_extra(extra: str, missing: list[str], what: str) -> typer.Exit:
    typer.echo(
        f"acp-once: {what} needs the {extra} extra (missing: {', '.join(missing)}): "
        f"install acp-once[{extra}], e.g. pip install 'acp-once[{extra}]'" + _HINTS.get(extra, ""),
        err=True,
    )
    return typer.Exit(2)


def _require(extra: str, what: str) -> None:
    """Exit 2 naming `extra` when one of its packages is not installed (nothing is imported:
    the check runs before the command starts anything)."""
    missing = [name for name in _EXTRAS[extra] if importlib.util.find_spec(name) is None]
    if missing:
        raise _missing_extra(extra, missing, what)


_TargetArgument = Annotated[
    str | None,
    typer.Argument(
        metavar="MODULE:FACTORY",
        show_default=False,
        help="your agent: MODULE:NAME or FILE.py:NAME, a SessionAgent subclass or a function "
        "taking the store (default: the reference agent)",
    ),
]


def _reference_only(ctx: typer.Context, *names: str) -> None:
    """Exit 2 when one of the reference agent's own options is given with MODULE:FACTORY."""
    for name in names:
        source = ctx.get_parameter_source(name)
        if source is not None and source.name != "DEFAULT":
            flag = "--" + name.replace("_", "-")
            raise typer.BadParameter(
                "an option of the reference agent, not of MODULE:FACTORY", param_hint=flag
            )


def _load(target: str, loader: Callable[[str], AgentFactory]) -> AgentFactory:
    """The factory `target` names, or exit 2 with the loader's one line."""
    from acp_once.agent.factory import FactoryError

    try:
        return loader(target)
    except FactoryError as exc:
        raise typer.BadParameter(str(exc), param_hint="MODULE:FACTORY") from None


def _show_version(value: bool) -> None:
    if value:
        from acp_once import __version__

        typer.echo(f"acp-once {__version__}")
        raise typer.Exit()


class LogLevel(enum.StrEnum):
    """The level of the records written to stderr (acp-once's and uvicorn's alike)."""

    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class Policy(enum.StrEnum):
    """What happens to a prompt sent while a turn runs."""

    hold = "hold"
    steer = "steer"


class PermissionAnswer(enum.StrEnum):
    """How `prompt` answers the agent's permission requests."""

    once = "once"
    always = "always"
    deny = "deny"


class Unaware(enum.StrEnum):
    """What the client does with an agent that may not honour keys (e.g. an ACP v1 agent)."""

    warn = "warn"
    refuse = "refuse"
    trust = "trust"


class Interrupted(enum.StrEnum):
    """What becomes of work a crash interrupted."""

    report = "report"
    # "continue" is a keyword: the member is named continue_
    continue_ = "continue"


class Runtime(enum.StrEnum):
    """Where the reference agent keeps its sessions."""

    reference = "reference"
    langgraph = "langgraph"
    v1 = "v1"


class Transport(enum.StrEnum):
    """How the demo's client reaches the agent."""

    stdio = "stdio"
    ws = "ws"
    http = "http"


# the level given before the command (`acp-once -v serve`), set by the app's callback
_GLOBAL_LEVEL: dict[str, int | None] = {}

_VerboseOption = Annotated[
    int,
    typer.Option(
        "--verbose",
        "-v",
        count=True,
        show_default=False,
        rich_help_panel="Logging",
        help="more log records: -v is --log-level info, -vv debug",
    ),
]
_LogLevelOption = Annotated[
    LogLevel | None,
    typer.Option(
        case_sensitive=False,
        rich_help_panel="Logging",
        help="the least severe records written to stderr (default: warning; the startup URL "
        "of serve and bridge is shown unless it is error)",
    ),
]


def _chosen_level(verbose: int, log_level: LogLevel | None) -> int | None:
    if log_level is not None:
        return int(logging.getLevelName(log_level.value.upper()))
    if verbose:
        return logging.DEBUG if verbose > 1 else logging.INFO
    return None


def _configure_logging(verbose: int = 0, log_level: LogLevel | None = None) -> None:
    """One format on stderr for every record, at the level chosen on the command (else the one
    given before it: `acp-once -v serve`, else warning). The startup URL's INFO record is shown
    unless the level is error or above."""
    level = _chosen_level(verbose, log_level)
    configure_logging(_GLOBAL_LEVEL.get("level") if level is None else level)


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
    verbose: _VerboseOption = 0,
    log_level: _LogLevelOption = None,
) -> None:
    _GLOBAL_LEVEL["level"] = _chosen_level(verbose, log_level)


def _data_dir() -> Path:
    """The user's data directory for acp-once, as the platform has it (platformdirs):
    $XDG_DATA_HOME/acp-once or ~/.local/share/acp-once on Linux, ~/Library/Application
    Support/acp-once on macOS, %LOCALAPPDATA%\\acp-once on Windows."""
    return data_dir()


def _store_url(store: str | None, default_db: str, *, langgraph: bool = False) -> str:
    """The `--store` value checked before anything starts (a bad one is a usage error, not a
    traceback), its SQLite file's directory created; None means SQLite in the data directory."""
    from acp_once.storage import check_store_url

    try:
        url = check_store_url(store or f"sqlite:{_data_dir() / default_db}")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--store") from None
    if url.startswith(("postgresql:", "postgres:")):
        _require("postgres", "a PostgreSQL --store")
    if langgraph and not url.startswith(("memory:", "sqlite:")):
        raise typer.BadParameter(
            "the langgraph runtime keeps its threads in memory: or sqlite:PATH",
            param_hint="--store",
        )
    make_store_dir(url)
    return url


@app.command()
def demo(
    submissions: Annotated[int, typer.Option(help="prompts per run")] = 200,
    seed: Annotated[int, typer.Option(help="makes a run repeatable")] = 1,
    transport: Annotated[
        Transport,
        typer.Option(help="stdio, or ws or http: a supervised `acp-once serve` process"),
    ] = Transport.stdio,
    agent_cmd: Annotated[
        str | None,
        typer.Option(
            help="an ACP v1 stdio agent's command line (one string, split as a shell would):"
            " run behind the upgrade runtime instead of the reference agent (stdio only)"
        ),
    ] = None,
    prompt: Annotated[
        str,
        typer.Option(help="with --agent-cmd: each prompt's text, {i} the submission's number"),
    ] = "submission #{i}",
    effects: Annotated[
        bool,
        typer.Option(
            "--effects/--no-effects",
            help="with --agent-cmd: count the lines N of effects.log in the sessions' directory"
            " as submission N's side effects (the prompt makes the agent write them)",
        ),
    ] = False,
    verbose: _VerboseOption = 0,
    log_level: _LogLevelOption = None,
) -> None:
    """Show what idempotency keys buy: the same faulty run with keys and without.

    The reference agent runs over stdio on SQLite in a temporary directory while a fault
    injector kills it at random moments, cuts answers (the agent dies after committing a
    message, before answering) and restarts the client. Then every submission is counted in
    the agent's store. With --transport ws the agent is `acp-once serve` in a subprocess that a
    supervisor restarts, the client connects over WebSocket, and connections are also dropped
    with the server running. With --agent-cmd CMD any ACP v1 agent runs behind `acp-once agent
    --runtime v1` instead (docs/guide/upgrade.md has Codex as the worked example).
    """
    _configure_logging(verbose, log_level)
    from acp_once.cli.demo_view import V1Agent, show_demo

    if agent_cmd is not None:
        if transport is not Transport.stdio:
            raise typer.BadParameter("--agent-cmd runs over stdio only", param_hint="--transport")
        if "{i}" not in prompt:
            raise typer.BadParameter("needs {i}, the submission's number", param_hint="--prompt")
        command = shlex.split(agent_cmd)
        if not command:
            raise typer.BadParameter("give the v1 agent's command", param_hint="--agent-cmd")
        v1 = V1Agent(command, prompt, effects)
        raise typer.Exit(show_demo(submissions=submissions, seed=seed, v1=v1))
    if transport is Transport.stdio:
        raise typer.Exit(show_demo(submissions=submissions, seed=seed))
    _require("server", f"demo --transport {transport.value}")
    if transport is Transport.ws:
        raise typer.Exit(show_demo(submissions=submissions, seed=seed, transport="ws"))
    raise typer.Exit(show_demo(submissions=submissions, seed=seed, transport="http"))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def agent(
    ctx: typer.Context,
    target: _TargetArgument = None,
    store: Annotated[
        str | None,
        typer.Option(
            help="memory, sqlite:PATH or postgresql://... (default: SQLite in the user's "
            "data directory)"
        ),
    ] = None,
    policy: Annotated[
        Policy, typer.Option(help="hold: prompts sent during a turn wait; steer: inserted at once")
    ] = Policy.hold,
    compare_prompts: Annotated[
        bool,
        typer.Option(
            "--compare-prompts/--no-compare-prompts",
            help="refuse a recorded idempotencyKey sent with a different prompt (-32602)",
        ),
    ] = True,
    side_effects: Annotated[
        Path | None, typer.Option(help="directory of the per-session side-effect logs")
    ] = None,
    interrupted: Annotated[
        Interrupted,
        typer.Option(
            help="work a crash interrupted: report (idle, stopReason error) or continue (rerun)"
        ),
    ] = Interrupted.report,
    runtime: Annotated[
        Runtime,
        typer.Option(
            help="reference: our own store; langgraph: sessions in a LangGraph checkpointer "
            "(memory: or sqlite:PATH; needs the langgraph extra); v1: the v1 agent given "
            "after -- served as v2 with keys"
        ),
    ] = Runtime.reference,
    verbose: _VerboseOption = 0,
    log_level: _LogLevelOption = None,
) -> None:
    r"""Run the reference ACP v2 agent on stdin/stdout.

    Its scripted turn echoes the prompt as an agent message. In the prompt text, \[work:SECONDS]
    keeps the turn running that long (a prompt sent meanwhile is held, or steered in); \[tool]
    runs a tool call that appends one line to the session's side-effect log; a text starting
    with / is a locally handled command (echoed live, not retained). Interrupted work after a
    restart is reported idle with stopReason error, or run again with --interrupted continue.
    ACP_ONCE_CRASH=after-insert makes it exit right after committing
    a user message (for fault-injection tests). With --runtime langgraph the same turn runs
    over a LangGraph thread per session, answered by a fake chat model that echoes.

    With --runtime v1 -- CMD ARGS, the turns are run by the ACP v1 stdio agent CMD (a child
    process): it is served as v2 with idempotency keys kept in the store (see
    docs/guide/upgrade.md).

    With MODULE:FACTORY (or FILE.py:FACTORY), your agent runs instead: a SessionAgent
    subclass, or a function taking the opened store and returning an Agent.
    """
    if runtime is Runtime.v1:
        command = [target, *ctx.args] if target is not None else list(ctx.args)
        from acp_once.cli.upgrade import run_upgrade

        if interrupted is Interrupted.continue_:
            raise typer.BadParameter(
                "the v1 runtime never runs interrupted work again", param_hint="--interrupted"
            )
        url = _store_url(store, "sessions.sqlite3")
        _configure_logging(verbose, log_level)
        raise typer.Exit(
            run_upgrade(
                command,
                url,
                policy="steer" if policy is Policy.steer else "hold",
                compare_prompts=compare_prompts,
            )
        )
    if ctx.args:
        raise typer.BadParameter(
            f"unexpected arguments: {' '.join(ctx.args)} (-- CMD needs --runtime v1)"
        )
    if target is not None:
        _reference_only(ctx, "side_effects", "policy", "interrupted", "compare_prompts", "runtime")
        from acp_once.cli.stdio_agent import load_agent_factory, run_factory

        factory = _load(target, load_agent_factory)
        url = _store_url(store, factory_db(target))
        _configure_logging(verbose, log_level)
        from acp_once.agent.factory import FactoryError

        try:
            run_factory(factory, url)
        except FactoryError as exc:
            typer.echo(f"acp-once agent: {exc}", err=True)
            raise typer.Exit(2) from None
        return
    default_db = "langgraph.sqlite3" if runtime is Runtime.langgraph else "sessions.sqlite3"
    url = _store_url(store, default_db, langgraph=runtime is Runtime.langgraph)
    effects = side_effects or _data_dir() / "side-effects"
    _configure_logging(verbose, log_level)

    if runtime is Runtime.langgraph:
        from acp_once.agent.serve import serve_stdio

        try:
            from acp_once.adapters.langgraph import LangGraphAgent, LangGraphStore
        except ImportError as exc:
            typer.echo(f"acp-once agent: {exc}", err=True)
            raise typer.Exit(2) from None

        async def run_langgraph() -> None:
            async with (
                LangGraphStore.open(url) as threads,
                LangGraphAgent(
                    threads,
                    side_effects=effects,
                    policy="steer" if policy is Policy.steer else "hold",
                    compare_prompts=compare_prompts,
                    resume_interrupted=interrupted is Interrupted.continue_,
                ) as adapter,
            ):
                await serve_stdio(adapter)

        _eventloop.run(run_langgraph)
        return

    # the same start as `acp-once agent` without typer (acp_once.cli.entry's fast path)
    from acp_once.cli.stdio_agent import run_reference

    run_reference(
        url,
        side_effects=effects,
        policy=policy.value,
        compare_prompts=compare_prompts,
        resume_interrupted=interrupted is Interrupted.continue_,
    )


@app.command()
def serve(
    ctx: typer.Context,
    target: _TargetArgument = None,
    host: Annotated[
        str, typer.Option(help="address to listen on (beyond loopback only with a token)")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8765,
    store: Annotated[
        list[str] | None,
        typer.Option(
            help="memory, sqlite:PATH or postgresql://... (default: SQLite in the user's "
            "data directory); repeated, postgresql://... URLs: sessions sharded over those "
            "databases, in that order"
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="ACP_ONCE_TOKEN",
            show_envvar=True,
            help="bearer token clients must send (prefer the environment variable: "
            "a command-line argument is visible to other users)",
        ),
    ] = None,
    tokens: Annotated[
        Path | None,
        typer.Option(
            help="a file of tenants, one name:token a line (# comments); each tenant sees only "
            "its own sessions; read again on SIGHUP. Instead of --token",
        ),
    ] = None,
    policy: Annotated[
        Policy, typer.Option(help="hold: prompts sent during a turn wait; steer: inserted at once")
    ] = Policy.hold,
    interrupted: Annotated[
        Interrupted,
        typer.Option(
            help="work a crash interrupted: report (idle, stopReason error) or continue (rerun)"
        ),
    ] = Interrupted.report,
    side_effects: Annotated[
        Path | None, typer.Option(help="directory of the per-session side-effect logs")
    ] = None,
    max_connections: Annotated[
        int, typer.Option(help="open WebSocket (and HTTP stream) connections at most")
    ] = DEFAULT_LIMITS.max_connections,
    max_connections_per_address: Annotated[
        int,
        typer.Option(help="established connections of one client address at most (0: no cap)"),
    ] = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
    max_message_bytes: Annotated[
        int, typer.Option(help="largest message read (a larger request is answered -32600)")
    ] = DEFAULT_LIMITS.max_message_bytes,
    migrate: Annotated[
        bool,
        typer.Option(
            "--migrate",
            help="apply the store's pending schema migrations on start (without it, serve "
            "refuses a schema that is out of date: `acp-once db migrate` applies them)",
        ),
    ] = False,
    no_sqlite_writer: Annotated[
        bool,
        typer.Option(
            "--no-sqlite-writer",
            help="write a SQLite store's messages on the event loop, not in a writer process "
            "of the store's own beside it (which serves more prompts/s to many busy "
            "connections)",
        ),
    ] = False,
    sqlite_busy_poll_ms: Annotated[
        float,
        typer.Option(
            metavar="<float>",
            help="how long the event loop polls for a SQLite writer's answers after each "
            "batch instead of sleeping: lower latency for some CPU (0: never; at most 1000)",
        ),
    ] = DEFAULT_LIMIT_S * 1000,
    fd: Annotated[
        int | None,
        typer.Option(
            help="serve on this inherited listening socket instead of binding HOST:PORT "
            "(a supervisor's, kept open across restarts)"
        ),
    ] = None,
    node_id: Annotated[
        str | None,
        typer.Option(help="this node's name in a cluster (PostgreSQL store; default: host name)"),
    ] = None,
    lease_ttl: Annotated[
        float,
        typer.Option(help="seconds before a dead node's sessions are taken over (PostgreSQL)"),
    ] = 10.0,
    lease_grace: Annotated[
        float | None,
        typer.Option(
            help="seconds a node keeps an idle session's lease, so that its next prompt there "
            "costs no lease statement (PostgreSQL; default: 3 x --lease-ttl; 0: release at once)"
        ),
    ] = None,
    idle_timeout: Annotated[
        float,
        typer.Option(
            help="close a connection after this many seconds without a message (0: never)"
        ),
    ] = DEFAULT_TIMEOUTS.idle or 0.0,
    write_timeout: Annotated[
        float,
        typer.Option(help="drop a client that reads nothing for this many seconds"),
    ] = DEFAULT_TIMEOUTS.write,
    allow_origin: Annotated[
        list[str] | None,
        typer.Option(
            help="a browser origin allowed beside the loopback ones of this port, e.g. "
            "https://editor.example (repeatable; *: any)"
        ),
    ] = None,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            help="a Host name answered beside loopback names and the bound address "
            "(repeatable; *: any, e.g. behind a proxy that checks it)"
        ),
    ] = None,
    forwarded_allow_ips: Annotated[
        list[str] | None,
        typer.Option(
            help="reverse proxies (IP addresses or networks, comma-separated or repeated; *: "
            "any peer) whose X-Forwarded-For or Forwarded headers name the client for the "
            "per-address caps and the logs (default: none, the headers are ignored)"
        ),
    ] = None,
    verbose: _VerboseOption = 0,
    log_level: _LogLevelOption = None,
) -> None:
    """Serve the reference agent over WebSocket and Streamable HTTP at ws://HOST:PORT/acp and
    http://HOST:PORT/acp (and GET /healthz).

    Many clients share the agent and its store; a session outlives its connection and is
    resumed on a new one. With --tokens FILE several tenants share it, each seeing only its
    own sessions (kill -HUP reloads the file). Without a token it listens on loopback
    addresses only. On a
    PostgreSQL store several nodes may serve the same sessions (--node-id, --lease-ttl,
    --lease-grace);
    GET /ops/status shows them.

    With MODULE:FACTORY (or FILE.py:FACTORY), your agent is served instead: a SessionAgent
    subclass, or a function taking the opened store and returning an Agent.
    """
    _require("server", "serve")
    from acp_once.agent.factory import FactoryError

    factory = None
    if target is not None:
        _reference_only(ctx, "side_effects", "policy", "interrupted")
        from acp_once.agent.factory import load_factory

        factory = _load(target, load_factory)
    from acp_once.server.listen import InsecureListen, check_listen, listen, tune_gc_for_serving
    from acp_once.server.run import reference_factory, serve_agent
    from acp_once.server.tenants import TokensFileError, load_tokens
    from acp_once.storage import SchemaOutOfDate

    token = token or None
    if tokens is not None:
        if token is not None:
            raise typer.BadParameter(
                "give one token (--token or ACP_ONCE_TOKEN) or a tokens file, not both",
                param_hint="--tokens",
            )
        try:
            load_tokens(tokens)  # read again when serving; refused here in one clear line
        except TokensFileError as exc:
            raise typer.BadParameter(str(exc), param_hint="--tokens") from None
    sock = None
    if fd is not None:  # its address is the one that counts
        import socket

        sock = socket.socket(fileno=fd)
        host, port = sock.getsockname()[:2]
    try:
        check_listen(host, token if tokens is None else "")  # "": tenants' tokens protect it
    except InsecureListen as exc:
        raise typer.BadParameter(str(exc), param_hint="--host") from None
    url = _store_urls(store, "sessions.sqlite3" if target is None else factory_db(target))
    if lease_ttl <= 0:
        raise typer.BadParameter("must be positive", param_hint="--lease-ttl")
    if not 0 <= sqlite_busy_poll_ms <= _BUSY_POLL_MAX_MS:  # also NaN, which `min` lets by
        raise typer.BadParameter(
            f"must be from 0 to {_BUSY_POLL_MAX_MS:g}", param_hint="--sqlite-busy-poll-ms"
        )
    if lease_grace is not None and lease_grace < 0:
        raise typer.BadParameter("0 or positive", param_hint="--lease-grace")
    if idle_timeout < 0:
        raise typer.BadParameter("0 (never) or positive", param_hint="--idle-timeout")
    if write_timeout <= 0:
        raise typer.BadParameter("must be positive", param_hint="--write-timeout")
    proxies = _proxies(forwarded_allow_ips)
    if max_connections_per_address < 0:
        raise typer.BadParameter(
            "0 (no cap) or positive", param_hint="--max-connections-per-address"
        )
    _configure_logging(verbose, log_level)
    if sock is None:
        try:
            sock = listen(host, port)
        except OSError as exc:
            logging.getLogger("acp_once.server").error(
                "cannot listen on %s:%d: %s", host, port, exc.strerror or exc
            )
            raise typer.Exit(1) from None
    apply = migrate or _new_store(url)
    if factory is None:
        factory = reference_factory(
            side_effects=side_effects or _data_dir() / "side-effects",
            policy="steer" if policy is Policy.steer else "hold",
            resume_interrupted=interrupted is Interrupted.continue_,
        )
    tune_gc_for_serving()
    try:
        _eventloop.run(
            lambda: serve_agent(
                factory,
                host=host,
                port=port,
                store=url,
                token=token,
                max_connections=max_connections,
                max_connections_per_address=max_connections_per_address or None,
                max_message_bytes=max_message_bytes,
                sock=sock,
                node_id=node_id,
                lease_ttl=lease_ttl,
                lease_grace=lease_grace,
                idle_timeout=idle_timeout or None,
                write_timeout=write_timeout,
                allowed_origins=allow_origin or (),
                allowed_hosts=allow_host or (),
                tokens_file=tokens,
                migrate=apply,
                forwarded_allow_ips=proxies,
                sqlite_writer=not no_sqlite_writer,
                sqlite_busy_poll_s=sqlite_busy_poll_ms / 1000,
            )
        )
    except FactoryError as exc:
        logging.getLogger("acp_once.server").error("%s", exc)
        raise typer.Exit(2) from None
    except SchemaOutOfDate as exc:
        # a PostgreSQL URL may hold a password: it is described, and not repeated
        where = _describe_store(url)
        logging.getLogger("acp_once.server").error(
            "%s: schema version %d of %d (%d migration(s) pending); apply them with "
            "`acp-once db migrate --store %s`, or start serve with --migrate",
            where,
            exc.found,
            exc.required,
            exc.required - exc.found,
            "postgresql://... (the same URL)" if _is_postgres(url) else url,
        )
        raise typer.Exit(1) from None


def _proxies(values: list[str] | None) -> list[str]:
    """`--forwarded-allow-ips` as a list of entries, checked (exit 2 naming a bad one)."""
    from acp_once.server.proxies import TrustedProxies

    entries = [e.strip() for value in values or () for e in value.split(",") if e.strip()]
    try:
        TrustedProxies(entries)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--forwarded-allow-ips") from None
    return entries


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def bridge(
    ctx: typer.Context,
    host: Annotated[
        str, typer.Option(help="address to listen on (beyond loopback only with a token)")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: a free one; the URL is printed)")] = 8765,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="ACP_ONCE_TOKEN",
            show_envvar=True,
            help="bearer token clients must send (prefer the environment variable: "
            "a command-line argument is visible to other users)",
        ),
    ] = None,
    tokens: Annotated[
        Path | None,
        typer.Option(
            help="tenants' tokens (name:token lines, read again on SIGHUP), instead of "
            "--token: each tenant sees only the sessions it created through this bridge"
        ),
    ] = None,
    max_connections: Annotated[int, typer.Option(help="open connections at most")] = 1000,
    max_message_bytes: Annotated[
        int, typer.Option(help="largest message read (a larger request is answered -32600)")
    ] = 16 * 1024 * 1024,
    allow_origin: Annotated[
        list[str] | None,
        typer.Option(
            help="a browser origin allowed beside the loopback ones of this port, e.g. "
            "https://editor.example (repeatable; *: any)"
        ),
    ] = None,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            help="a Host name answered beside loopback names and the bound address "
            "(repeatable; *: any, e.g. behind a proxy that checks it)"
        ),
    ] = None,
    forwarded_allow_ips: Annotated[
        list[str] | None,
        typer.Option(
            help="reverse proxies (IP addresses or networks, comma-separated or repeated; *: "
            "any peer) whose X-Forwarded-For or Forwarded headers name the client for the "
            "per-address caps and the logs (default: none, the headers are ignored)"
        ),
    ] = None,
    verbose: _VerboseOption = 0,
    log_level: _LogLevelOption = None,
) -> None:
    """Expose a stdio ACP agent over WebSocket and Streamable HTTP: `acp-once bridge -- CMD ARGS`.

    One agent process serves every connection at ws://HOST:PORT/acp (and http://, GET /healthz);
    idempotency keys reach it unchanged and $/cancel_request is translated per hop. If the agent
    dies it is started again, and the connections that depended on it are closed: clients
    reconnect, resume and resend. Without a token it listens on loopback addresses only.
    """
    _require("server", "bridge")
    from acp_once.cli.bridge import run_bridge
    from acp_once.server.listen import InsecureListen, check_listen
    from acp_once.server.tenants import TokensFileError, load_tokens

    command = list(ctx.args)
    if not command:
        raise typer.BadParameter("give the agent's command after --, e.g. -- acp-once agent")
    token = token or None
    if tokens is not None:
        if token is not None:
            raise typer.BadParameter(
                "give one token (--token or ACP_ONCE_TOKEN) or a tokens file, not both",
                param_hint="--tokens",
            )
        try:
            load_tokens(tokens)  # read again when serving; refused here in one clear line
        except TokensFileError as exc:
            raise typer.BadParameter(str(exc), param_hint="--tokens") from None
    try:
        check_listen(host, token if tokens is None else "")  # "": tenants' tokens protect it
    except InsecureListen as exc:
        raise typer.BadParameter(str(exc), param_hint="--host") from None
    proxies = _proxies(forwarded_allow_ips)
    _configure_logging(verbose, log_level)
    raise typer.Exit(
        run_bridge(
            command,
            host=host,
            port=port,
            token=token,
            max_connections=max_connections,
            max_message_bytes=max_message_bytes,
            allowed_origins=allow_origin or (),
            allowed_hosts=allow_host or (),
            tokens_file=tokens,
            forwarded_allow_ips=proxies,
        )
    )


@app.command()
def prompt(
    text: Annotated[str, typer.Argument(help="the prompt text")],
    agent: Annotated[
        str,
        typer.Option(
            help='the agent: a command (e.g. "acp-once agent --store sqlite:s.db"), or the URL '
            "of a served agent (ws://, wss://, http://, https://)"
        ),
    ],
    token: Annotated[
        str | None,
        typer.Option(envvar="ACP_ONCE_TOKEN", help="bearer token for a served agent"),
    ] = None,
    session: Annotated[str | None, typer.Option(help="resume this session id")] = None,
    key: Annotated[
        str | None,
        typer.Option(
            envvar="ACP_ONCE_KEY",
            help="name the submission (with --session): a rerun with the same key is the same "
            "submission, inserted once, and prints its outcome",
        ),
    ] = None,
    allow: Annotated[
        PermissionAnswer | None,
        typer.Option(
            help="answer the agent's permission requests (default: ask on a terminal, else deny)"
        ),
    ] = None,
    cwd: Annotated[str, typer.Option(help="the session's working directory")] = ".",
    outbox: Annotated[
        Path | None,
        typer.Option(help="SQLite outbox: a killed and rerun command finishes its submission"),
    ] = None,
    wait: Annotated[
        float, typer.Option(help="seconds to wait for the turn to end (0: don't)")
    ] = 60.0,
    on_unaware: Annotated[
        Unaware,
        typer.Option(
            help="an agent that may not honour keys (an ACP v1 agent has none): warn once, "
            "refuse it, or trust it (a lost answer is then resent and may run twice)"
        ),
    ] = Unaware.warn,
    verbose: _VerboseOption = 0,
    log_level: _LogLevelOption = None,
) -> None:
    """Send one prompt to an agent and print what it streams back.

    With --outbox, the submission (and its idempotency key) is written to the outbox before it
    is sent. If the command is killed and run again with the same outbox and text, it finishes
    that submission instead of starting a new one: the agent inserts it once. With --session
    and --key (or ACP_ONCE_KEY), a rerun of the same command is the same submission, outbox or
    not: inserted once, and its outcome printed.

    Exit status: 0 the turn ended; 1 refused or unreachable; 2 a usage error; 3 the prompt was
    inserted but its turn did not finish (interrupted by an agent restart, or failed); 4 no end
    of the turn within --wait.
    """
    _configure_logging(verbose, log_level)
    if key is not None and session is None:
        raise typer.BadParameter(
            "a key names a submission within a session: give --session too", param_hint="--key"
        )
    if agent.startswith(_URL_SCHEMES):
        _require("server", "a served agent (prompt --agent URL)")
    from acp_once.cli.prompt import run_prompt

    raise typer.Exit(
        _eventloop.run(
            lambda: run_prompt(
                agent=agent,
                token=token,
                text=text,
                session_id=session,
                cwd=str(Path(cwd).resolve()),
                outbox=f"sqlite:{outbox}" if outbox else "memory:",
                wait=wait,
                on_unaware=on_unaware.value,
                key=key,
                allow=allow.value if allow is not None else None,
            )
        )
    )


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def check(
    ctx: typer.Context,
    target: Annotated[
        str | None, typer.Argument(help="ws:// or http:// URL (or -- CMD ARGS)")
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="ACP_ONCE_TOKEN", show_envvar=True, help="bearer token for a URL target"
        ),
    ] = None,
    json_report: Annotated[Path | None, typer.Option("--json", help="write a JSON report")] = None,
    junit: Annotated[Path | None, typer.Option(help="write a JUnit XML report")] = None,
    slow_prompt: Annotated[
        str, typer.Option(help="a prompt that keeps the agent busy (for held-prompt traces)")
    ] = "[work:2]",
    timeout: Annotated[
        float,
        typer.Option(help="seconds any one answer may take (raise it for slow, LLM-backed agents)"),
    ] = 30.0,
    only: Annotated[
        list[str] | None,
        typer.Option(
            "--only",
            metavar="ID",
            help="run only this check (repeatable or comma-separated; * patterns; see --list)",
        ),
    ] = None,
    list_: Annotated[
        bool, typer.Option("--list", help="print the checks (id, level, title, rules) and exit")
    ] = False,
    verbose: _VerboseOption = 0,
    log_level: _LogLevelOption = None,
) -> None:
    """Check whether an ACP v2 agent honours idempotency keys: `acp-once check -- CMD ARGS`,
    or `acp-once check ws://HOST:PORT/acp [--token T]` for a running server."""
    _configure_logging(verbose, log_level)
    from acp_once.cli.check import list_checks, run_check

    if list_:
        raise typer.Exit(list_checks())
    if target is not None and target.startswith(_URL_SCHEMES):
        _require("server", "check URL")
    else:
        source = ctx.get_parameter_source("token")
        if source is not None and source.name == "ENVIRONMENT":
            token = None  # ACP_ONCE_TOKEN is for served agents: not worth a warning here
    command = list(ctx.args)
    raise typer.Exit(
        run_check(
            target=target,
            command=command,
            token=token,
            json_report=json_report,
            junit=junit,
            slow_prompt=slow_prompt,
            timeout=timeout,
            select=only,
        )
    )


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def zed(
    ctx: typer.Context,
    target: _TargetArgument = None,
    store: Annotated[
        str | None,
        typer.Option(
            help="memory, sqlite:PATH (made absolute) or postgresql://... (default: SQLite in "
            "the user's data directory)"
        ),
    ] = None,
    runtime: Annotated[
        Runtime,
        typer.Option(help="v1: the ACP v1 agent given after -- served as v2 with keys"),
    ] = Runtime.reference,
    name: Annotated[str | None, typer.Option(help="the agent's name in Zed's agent panel")] = None,
) -> None:
    """Print the `agent_servers` entry of Zed's settings.json that runs an agent with this
    installation: `acp-once zed`, `acp-once zed my_module:make_agent`, or `acp-once zed
    --runtime v1 -- CMD ARGS`.

    The command is this installation's acp-once by its absolute path (Zed's PATH may find
    another one, or none); paths are made absolute, as Zed starts the agent elsewhere.
    """
    from acp_once.cli.zed import zed_settings

    if runtime is Runtime.langgraph:
        raise typer.BadParameter("zed prints the reference, MODULE:FACTORY or v1 entries")
    command = [target, *ctx.args] if runtime is Runtime.v1 and target else list(ctx.args)
    if runtime is Runtime.v1:
        if not command:
            raise typer.BadParameter("give the v1 agent's command after --, e.g. -- CMD ARGS")
        target = None
    elif command:
        raise typer.BadParameter(
            f"unexpected arguments: {' '.join(command)} (-- CMD needs --runtime v1)"
        )
    if target is not None:
        _load(target, _check_target)
    db = "sessions.sqlite3" if target is None else factory_db(target)
    default = f"sqlite:{_data_dir() / db}"
    typer.echo(zed_settings(store=store or default, target=target, v1_command=command, name=name))
    if store is not None and store.startswith("memory"):
        typer.echo(
            "acp-once zed: a memory: store forgets every session when Zed stops the agent",
            err=True,
        )


def _check_target(target: str) -> AgentFactory:
    """`target` loaded as `acp-once agent` would load it (its output to stderr), so a typo is
    reported now rather than when Zed starts the agent."""
    from acp_once.cli.stdio_agent import load_agent_factory

    with contextlib.redirect_stdout(sys.stderr):
        return load_agent_factory(target)


@app.command()
def status(
    url: Annotated[str, typer.Argument(help="a node's base URL, e.g. http://127.0.0.1:8765")],
    token: Annotated[
        str | None,
        typer.Option(envvar="ACP_ONCE_TOKEN", show_envvar=True, help="the nodes' bearer token"),
    ] = None,
    verbose: _VerboseOption = 0,
    log_level: _LogLevelOption = None,
) -> None:
    """Show every node sharing the node's store: sessions owned, prompts held, dedup hits.

    Reads GET URL/ops/status (token-protected like /acp). Exits 1 when it cannot be read.
    """
    _configure_logging(verbose, log_level)
    _require("server", "status")
    from acp_once.cli.cluster_status import show_status

    raise typer.Exit(show_status(url, token=token or None))


db_app = typer.Typer(no_args_is_help=True, help="Schema migrations of a store.")
app.add_typer(db_app, name="db")


def _store_urls(store: list[str] | None, default_db: str) -> str | list[str]:
    """`--store` given once (or not) as `_store_url`; repeated, the shards of one PostgreSQL
    store, checked (a usage error names what is wrong)."""
    if not store or len(store) == 1:
        return _store_url(store[0] if store else None, default_db)
    from acp_once.storage import check_store_urls

    try:
        urls = check_store_urls(store)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--store") from None
    _require("postgres", "a PostgreSQL --store")
    from acp_once.storage.postgres import parse_postgres_url

    for url in urls:
        try:
            parse_postgres_url(url)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--store") from None
    return urls


def _describe_store(url: str | list[str]) -> str:
    if isinstance(url, list):
        return ", ".join(_describe_store(one) for one in url)
    if _is_postgres(url):
        from acp_once.storage.postgres import describe_postgres, parse_postgres_url

        return describe_postgres(*parse_postgres_url(url))
    return str(_sqlite_path(url))


def _new_store(url: str | list[str]) -> bool:
    """Whether the store `url` has no schema yet (a missing SQLite file or PostgreSQL schema,
    or the memory store; every shard of a sharded one): creating it is not a migration, so
    serve does it without --migrate."""
    if isinstance(url, list):
        return all(_new_store(one) for one in url)
    if _is_postgres(url):
        return _postgres_db(url, migrate=False)[1] == 0
    if not url.startswith("sqlite:") or url == "sqlite::memory:":
        return True
    from acp_once.storage import StorageError
    from acp_once.storage.sqlite import database_status

    try:
        current, _ = anyio.run(database_status, _sqlite_path(url))
    except StorageError:
        return False  # opening it says what is wrong
    return current == 0


def _sqlite_path(store: str) -> Path:
    if not store.startswith("sqlite:") or store == "sqlite::memory:":
        raise typer.BadParameter("db commands take a sqlite:PATH or postgresql://... store")
    return Path(store.removeprefix("sqlite:")).expanduser()


def _is_postgres(store: str | list[str]) -> bool:
    if isinstance(store, list):
        return True  # several URLs are PostgreSQL shards (`_store_urls`)
    return store.startswith(("postgresql://", "postgres://"))


def _postgres_db(store: str, *, migrate: bool) -> tuple[str, int, int]:
    """Run `db migrate` or `db status` on a PostgreSQL store URL (`?schema=NAME` allowed)."""
    _require("postgres", "a PostgreSQL --store")
    from acp_once.storage import StorageError
    from acp_once.storage.postgres import (
        describe_postgres,
        migrate_postgres,
        parse_postgres_url,
        postgres_status,
    )

    try:
        dsn, schema = parse_postgres_url(store)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        first, second = anyio.run(migrate_postgres if migrate else postgres_status, dsn, schema)
    except StorageError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return describe_postgres(dsn, schema), first, second


_STORE_HELP = (
    "sqlite:PATH or postgresql://USER@HOST/DB[?schema=NAME]; repeated: the shards of one store,"
    " in order"
)


def _shards_db(store: list[str], *, migrate: bool) -> list[tuple[str, int, int]]:
    """`db migrate` or `db status` of a sharded store: (where, version, version) per shard."""
    urls = _store_urls(store, "sessions.sqlite3")
    assert isinstance(urls, list)
    from acp_once.storage import StorageError
    from acp_once.storage.postgres.shards import migrate_shards, shards_status

    try:
        report = anyio.run(migrate_shards if migrate else shards_status, urls)
    except StorageError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return [(shard.where, shard.before, shard.after) for shard in report]


@db_app.command("migrate")
def db_migrate(
    store: Annotated[
        list[str] | None,
        typer.Option(help=f"{_STORE_HELP} (default: SQLite in the user's data directory)"),
    ] = None,
    verbose: _VerboseOption = 0,
    log_level: _LogLevelOption = None,
) -> None:
    """Bring the store's schema up to date (creates the file or schema if missing); with
    --store repeated, every shard's, and the shard set is recorded in each."""
    _configure_logging(verbose, log_level)
    store = store or [f"sqlite:{_data_dir() / 'sessions.sqlite3'}"]
    if len(store) > 1:
        for where, before, after in _shards_db(store, migrate=True):
            typer.echo(f"{where}: schema version {before} -> {after}")
        return
    [url] = store
    if _is_postgres(url):
        where, before, after = _postgres_db(url, migrate=True)
        typer.echo(f"{where}: schema version {before} -> {after}")
        return
    from acp_once.storage.sqlite import migrate_database

    path = _sqlite_path(url)  # migrate_database creates the file and its directory, private
    before, after = anyio.run(migrate_database, path)
    typer.echo(f"{path}: schema version {before} -> {after}")


@db_app.command("status")
def db_status(
    store: Annotated[
        list[str] | None,
        typer.Option(help=f"{_STORE_HELP} (default: SQLite in the user's data directory)"),
    ] = None,
    verbose: _VerboseOption = 0,
    log_level: _LogLevelOption = None,
) -> None:
    """Show the store's schema version (every shard's, with --store repeated); exits 1 when
    migrations are pending."""
    _configure_logging(verbose, log_level)
    store = store or [f"sqlite:{_data_dir() / 'sessions.sqlite3'}"]
    if len(store) > 1:
        pending = False
        for where, current, latest in _shards_db(store, migrate=False):
            state = "up to date" if current == latest else f"{latest - current} pending"
            typer.echo(f"{where}: schema version {current} of {latest} ({state})")
            pending = pending or current != latest
        if pending:
            raise typer.Exit(1)
        return
    [url] = store
    if _is_postgres(url):
        where, current, latest = _postgres_db(url, migrate=False)
    else:
        from acp_once.storage.sqlite import database_status

        path = _sqlite_path(url)
        current, latest = anyio.run(database_status, path)
        where = str(path)
    state = "up to date" if current == latest else f"{latest - current} migration(s) pending"
    typer.echo(f"{where}: schema version {current} of {latest} ({state})")
    if current != latest:
        raise typer.Exit(1)


def main() -> None:
    """Run the `acp-once` command line. A module of an extra that is still missing when a
    command imports it (past the checks above) ends the command with exit status 2 and the
    extra's name, not a traceback; a store or an outbox that cannot be opened, with status 1
    and one line naming its path and the cause (the traceback too at -v)."""
    from acp_once.storage import StorageError

    try:
        app()
    except StorageError as exc:
        from acp_once.cli.stdio_agent import report_store_failure

        command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
        raise SystemExit(report_store_failure(exc, command)) from None
    except ModuleNotFoundError as exc:
        root = (exc.name or "").partition(".")[0]
        extra = next((e for e, names in _EXTRAS.items() if root in names), None)
        if extra is None:
            raise
        raise SystemExit(_missing_extra(extra, [root], "this command").exit_code) from None
    except Exception as exc:
        from acp_once.client.outbox import OutboxError

        if not isinstance(exc, OutboxError):  # `prompt --outbox PATH` that cannot be opened
            raise
        from acp_once.cli.stdio_agent import report_store_failure

        command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
        raise SystemExit(report_store_failure(exc, command)) from None
