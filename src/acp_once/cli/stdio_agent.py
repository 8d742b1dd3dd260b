"""`acp-once agent` without the command-line framework: its common forms parsed by hand.

An editor starts `acp-once agent` and waits for its `initialize` answer; importing typer and
building its command (its option coercion goes through pydantic) was about a seventh of the
instructions of that start (`benchmarks/README.md`, bench_coldstart.py). `parse_agent_args`
reads the forms the command takes with the reference runtime and a memory or SQLite store
(`--store X` or `--store=X`, `--policy`, `--compare-prompts/--no-compare-prompts`,
`--side-effects`, `--interrupted`, `--runtime reference`, `-v`/`-vv`/`--verbose`,
`--log-level`), or your agent's (`MODULE:FACTORY` with `--store`, `-v`, `--log-level`), and
gives up (None) on anything else: help, an unknown option or value, a
repeated option, a store URL `check_store_url` refuses, a PostgreSQL store, another runtime.
Then `acp_once.cli.entry` hands the whole command line to the typer application, which parses
it (and reports its errors) as it always did. The two paths start the same agent through
`run_reference` (`tests/cli/test_cli_fast_agent.py` holds them equal option by option).

This module imports neither typer nor rich, nor the agent before it runs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from acp_once.agent.factory import AgentFactory

__all__ = [
    "LOG_FORMAT",
    "AgentArgs",
    "configure_logging",
    "data_dir",
    "factory_db",
    "load_agent_factory",
    "make_store_dir",
    "report_store_failure",
    "parse_agent_args",
    "run_factory",
    "run_reference",
    "try_fast_agent",
]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# the startup URL of `serve` and `bridge`: one INFO record, shown at the default level
ADDRESS_LOGGER = "acp_once.server.address"

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS["error"] = logging.ERROR
_CHOICES = {
    "--policy": ("hold", "steer"),
    "--interrupted": ("report", "continue"),
    "--runtime": ("reference",),
}
_VALUED = ("--store", "--side-effects", "--log-level", *_CHOICES)


@dataclass(frozen=True, slots=True)
class AgentArgs:
    """The options of `acp-once agent` as the fast path read them (the typer command's
    defaults where an option is absent)."""

    store: str | None = None
    policy: str = "hold"
    compare_prompts: bool = True
    side_effects: Path | None = None
    interrupted: str = "report"
    verbose: int = 0
    log_level: str | None = None
    target: str | None = None  # MODULE:FACTORY or FILE.py:FACTORY: your agent, not ours


def factory_db(target: str) -> str:
    """The default SQLite file of MODULE:FACTORY's sessions, in the data directory: one per
    factory (`my_pkg.agents.make_agent.sqlite3`), not the reference agent's."""
    where, _, name = target.rpartition(":")
    return f"{Path(where).stem if where.endswith('.py') else where}.{name}.sqlite3"


def data_dir() -> Path:
    """The user's data directory for acp-once, as the platform has it (platformdirs):
    $XDG_DATA_HOME/acp-once or ~/.local/share/acp-once on Linux, ~/Library/Application
    Support/acp-once on macOS, %LOCALAPPDATA%\\acp-once on Windows."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("acp-once", appauthor=False))


def make_store_dir(url: str) -> None:
    """Create the directory of a `sqlite:PATH` store's file, private (0700), `~` expanded as
    the store expands it; nothing for other stores.

    Raises:
        StorageError: the directory cannot be created (the message names it and the OS error).
    """
    if url.startswith("sqlite:") and url != "sqlite::memory:":
        db_dir = Path(url.removeprefix("sqlite:")).expanduser().parent
        try:
            db_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            from acp_once.storage import StorageError

            reason = exc.strerror or str(exc)
            raise StorageError(f"{db_dir}: cannot create the store's directory: {reason}") from exc


def _verbose_asked(argv: Sequence[str]) -> bool:
    """Whether ARGV asks for -v or a level of info or below (the check runs where the failure
    may come before logging is configured)."""
    for arg, following in zip(argv, [*argv[1:], ""], strict=True):
        if arg in ("-v", "-vv", "-vvv", "--verbose"):
            return True
        level = arg.removeprefix("--log-level=") if arg.startswith("--log-level=") else None
        if arg == "--log-level":
            level = following
        if level is not None and level.lower() in ("debug", "info"):
            return True
    return False


def report_store_failure(exc: BaseException, command: str) -> int:
    """Say on stderr in one line why the store could not be opened (its message names the
    path and the cause), after its traceback only when -v or a lower level was asked for;
    returns the exit status, 1."""
    if _verbose_asked(sys.argv[1:]) or logging.getLogger().isEnabledFor(logging.INFO):
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.write(f"acp-once {command}: {exc}\n")
    sys.stderr.flush()
    return 1


def chosen_level(verbose: int, log_level: str | None) -> int | None:
    """The level `--log-level` (a name, any case) or `-v` (info) / `-vv` (debug) asks for;
    None when neither is given."""
    if log_level is not None:
        return _LEVELS[log_level.lower()]
    if verbose:
        return logging.DEBUG if verbose > 1 else logging.INFO
    return None


def configure_logging(level: int | None) -> None:
    """One format on stderr for every record, at `level` (None: warning). The startup URL's
    INFO record is shown unless the level is error or above."""
    if level is None:
        level = logging.WARNING
    logging.basicConfig(level=level, stream=sys.stderr, format=LOG_FORMAT, force=True)
    logging.getLogger(ADDRESS_LOGGER).setLevel(
        min(level, logging.INFO) if level <= logging.WARNING else level
    )


def parse_agent_args(argv: Sequence[str]) -> AgentArgs | None:
    """The options after `agent` read by hand, or None when they are not one of the forms
    this path takes (the typer application then parses them, errors included).

    Args:
        argv: the arguments after `agent`.

    Returns:
        The options, or None.
    """
    values: dict[str, str] = {}
    flags: dict[str, bool] = {}
    verbose = 0
    target: str | None = None
    args = list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("-") and ":" in arg and target is None:
            target = arg
            continue
        if arg in ("-v", "-vv", "-vvv", "--verbose"):
            verbose += 1 if arg == "--verbose" else len(arg) - 1
            continue
        if arg in ("--compare-prompts", "--no-compare-prompts"):
            if "compare" in flags:
                return None
            flags["compare"] = arg == "--compare-prompts"
            continue
        name, eq, value = arg.partition("=")
        if name not in _VALUED or name in values:
            return None
        if not eq:
            if not args:
                return None
            value = args.pop(0)
        if not value or value.startswith("-"):
            return None
        if name in _CHOICES and value not in _CHOICES[name]:
            return None
        if name == "--log-level" and value.lower() not in _LEVELS:
            return None
        values[name] = value
    side_effects = values.get("--side-effects")
    if target is not None and (flags or set(values) - {"--store", "--log-level"}):
        return None  # an option of the reference agent: typer says so
    return AgentArgs(
        target=target,
        store=values.get("--store"),
        policy=values.get("--policy", "hold"),
        compare_prompts=flags.get("compare", True),
        side_effects=Path(side_effects) if side_effects is not None else None,
        interrupted=values.get("--interrupted", "report"),
        verbose=verbose,
        log_level=values.get("--log-level"),
    )


@contextlib.contextmanager
def _imports_frozen() -> Iterator[None]:
    """The cyclic garbage collector paused for the block; after it, every object then alive is
    moved out of the collector's reach (`gc.freeze`) and the collector runs again, whatever
    happens.

    Importing the agent creates ~350 model classes with their fields, hundreds of thousands of
    long-lived objects: collected as they come, they set off passes that free nothing, and
    the first pass after a pause would scan them all. Frozen, no pass scans them again, here or
    in later turns: 9% fewer instructions to the `initialize` answer (callgrind). Reference
    counting frees as usual; a reference cycle made before the freeze is never freed.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def run_reference(
    url: str,
    *,
    side_effects: Path,
    policy: str,
    compare_prompts: bool,
    resume_interrupted: bool,
) -> None:
    """Serve the reference agent on this process's stdin and stdout until stdin closes, on
    the store `url` (checked, its directory made), on the commands' event loop.

    Raises:
        StorageError: the store cannot be opened.
    """
    with _imports_frozen():
        from acp_once.agent.reference import ReferenceAgent
        from acp_once.agent.serve import serve_stdio
        from acp_once.cli import _eventloop
        from acp_once.storage import open_store

    async def run() -> None:
        async with (
            open_store(url) as opened,
            ReferenceAgent(
                opened,
                side_effects=side_effects,
                policy="steer" if policy == "steer" else "hold",
                compare_prompts=compare_prompts,
                resume_interrupted=resume_interrupted,
            ) as reference,
        ):
            await serve_stdio(reference)

    _eventloop.run(run)


def load_agent_factory(spec: str) -> AgentFactory:
    """The factory `spec` names (`acp_once.agent.factory.load_factory`), imported with its
    module's import-time output sent to stderr: stdout is the ACP stream.

    Raises:
        FactoryError: `spec` cannot be loaded (one line naming it and the cause).
    """
    from acp_once.agent.factory import load_factory

    with contextlib.redirect_stdout(sys.stderr):
        return load_factory(spec)


def run_factory(factory: AgentFactory, url: str) -> None:
    """Serve the agent `factory` makes on the store `url` (checked, its directory made) on this
    process's stdin and stdout until stdin closes, on the commands' event loop.

    Raises:
        FactoryError: the factory made something that is not an `Agent`.
        StorageError: the store cannot be opened.
    """
    with _imports_frozen():
        from acp_once.agent.factory import open_agent
        from acp_once.agent.serve import serve_stdio
        from acp_once.cli import _eventloop
        from acp_once.storage import open_store

    async def run() -> None:
        async with open_store(url) as opened, open_agent(factory, opened) as agent:
            await serve_stdio(agent)

    _eventloop.run(run)


def try_fast_agent(argv: Sequence[str]) -> bool:
    """Run `acp-once agent ARGV` here when `parse_agent_args` takes ARGV and its store is
    memory or SQLite; False (nothing done) otherwise, for the typer application to handle.

    Raises:
        KeyboardInterrupt, StorageError: from the running agent.
    """
    from acp_once.storage import check_store_url

    args = parse_agent_args(argv)
    if args is None:
        return False
    default = "sessions.sqlite3" if args.target is None else factory_db(args.target)
    try:
        url = check_store_url(args.store or f"sqlite:{data_dir() / default}")
    except ValueError:
        return False
    if not url.startswith(("memory:", "sqlite:")):
        return False
    make_store_dir(url)
    configure_logging(chosen_level(args.verbose, args.log_level))
    if args.target is not None:
        from acp_once.agent.factory import FactoryError

        try:
            run_factory(load_agent_factory(args.target), url)
        except FactoryError as exc:  # one line, as the typer path says it
            sys.stderr.write(f"acp-once agent: {exc}\n")
            raise SystemExit(2) from None
        return True
    side_effects = args.side_effects or data_dir() / "side-effects"
    run_reference(
        url,
        side_effects=side_effects,
        policy=args.policy,
        compare_prompts=args.compare_prompts,
        resume_interrupted=args.interrupted == "continue",
    )
    return True
