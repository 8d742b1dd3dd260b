"""Your agent named by an import path, as `acp-once serve` and `acp-once agent` take it.

`MODULE:NAME` (`my_pkg.agents:make_agent`, imported with the current directory first on
`sys.path`, as uvicorn takes `module:app`) or `FILE.py:NAME` (`./echo.py:EchoAgent`, loaded from
that file, its directory first on `sys.path`). NAME is an agent factory:

- a `SessionAgent` subclass, or any callable taking one positional argument: called with the
  opened `SessionStore` (`EchoAgent(store)`);
- a callable taking no argument: called as it is (an `Agent` with storage of its own).

It returns an `Agent` (or an awaitable of one). An agent that is an async context manager (a
`SessionAgent` is) is entered before it serves and left after.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from acp_once.agent.interface import Agent

if TYPE_CHECKING:
    from acp_once.storage.base import SessionStore

__all__ = [
    "AgentFactory",
    "FactoryError",
    "build_agent",
    "entered",
    "load_factory",
    "open_agent",
]

AgentFactory: TypeAlias = Callable[..., "Agent | Awaitable[Agent]"]
"""A callable making the agent: from the opened store (one positional argument) or from
nothing."""


class FactoryError(ValueError):
    """An agent factory that cannot be loaded or does not make an agent; the message is one
    line naming the import path and the cause."""


def load_factory(spec: str) -> AgentFactory:
    """The callable `spec` (`MODULE:NAME` or `FILE.py:NAME`, NAME dotted) names.

    The module is imported here, with its import-time output, if any, in whatever `sys.stdout`
    is (the stdio agent points it at stderr first).

    Raises:
        FactoryError: no `:`, a module or file that cannot be imported, a missing name, or a
            name that is not callable. An exception raised by the module's own code while it
            is imported is not caught (its traceback is the useful part).
    """
    where, colon, name = spec.rpartition(":")
    if not colon or not where or not name:
        raise FactoryError(f"{spec!r}: expected MODULE:NAME or FILE.py:NAME")
    if where.endswith(".py"):
        module = _load_file(spec, Path(where))
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name is not None and where.startswith(exc.name):
                raise FactoryError(f"{spec!r}: no module named {exc.name!r}") from None
            raise
    target: object = module
    for part in name.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise FactoryError(f"{spec!r}: {where} has no attribute {name!r}") from None
    if not callable(target):
        raise FactoryError(f"{spec!r}: {name} is not a class or function")
    return cast("AgentFactory", target)


def _load_file(spec: str, path: Path) -> Any:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise FactoryError(f"{spec!r}: no file {path}")
    module_name = path.stem
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise FactoryError(f"{spec!r}: {path} cannot be imported")
    module = importlib.util.module_from_spec(loader_spec)
    # its siblings importable, and itself under its name (dataclasses and pickling look it up)
    sys.path.insert(0, str(path.parent))
    sys.modules[module_name] = module
    loader_spec.loader.exec_module(module)
    return module


def _takes_store(factory: AgentFactory) -> bool:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: give it the store
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(
        p.kind is inspect.Parameter.VAR_POSITIONAL
        or (p.kind in positional and p.default is inspect.Parameter.empty)
        for p in signature.parameters.values()
    )


async def build_agent(factory: AgentFactory, store: SessionStore) -> Agent:
    """The agent `factory` makes: called with `store` when it takes a positional argument,
    else with none; awaited when it returns an awaitable.

    Raises:
        FactoryError: what it made is not an `Agent`.
    """
    made: object = factory(store) if _takes_store(factory) else factory()
    if inspect.isawaitable(made):
        made = await made
    if not isinstance(made, Agent):
        name = getattr(factory, "__qualname__", repr(factory))
        raise FactoryError(
            f"{name} made a {type(made).__name__}, not an acp_once.agent.Agent "
            "(subclass SessionAgent or Agent)"
        )
    return made


@contextlib.asynccontextmanager
async def entered(agent: Agent) -> AsyncIterator[Agent]:
    """`agent` for the block, entered and left when it is an async context manager (a
    `SessionAgent` is), as it is otherwise."""
    if hasattr(agent, "__aenter__") and hasattr(agent, "__aexit__"):
        async with cast("contextlib.AbstractAsyncContextManager[object]", agent):
            yield agent
    else:
        yield agent


@contextlib.asynccontextmanager
async def open_agent(factory: AgentFactory, store: SessionStore) -> AsyncIterator[Agent]:
    """The agent `factory` makes (`build_agent`), `entered` for the block.

    Raises:
        FactoryError: what the factory made is not an `Agent`.
    """
    async with entered(await build_agent(factory, store)) as agent:
        yield agent
