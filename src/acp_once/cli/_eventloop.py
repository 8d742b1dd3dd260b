"""The event loop the long-running commands run on: uvloop where it is installed.

uvloop (libuv under asyncio's API) runs the agent's echo turn in about 16% fewer instructions
than the default asyncio loop, and a bare asyncio echo agent on less than half the CPU
(`benchmarks/README.md`; the echo benchmark's `--loop` option measures both). It is optional,
the `fast` extra (it exists for every platform but Windows), so the base install stays light;
where it is missing, or `ACP_ONCE_LOOP=asyncio` asks for the standard loop, the commands run
on plain asyncio with the same behaviour. Only this module knows uvloop's name, and imports it
only through anyio when it is installed.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar, TypeVarTuple

import anyio

__all__ = ["loop_name", "run"]

_T = TypeVar("_T")
_Args = TypeVarTuple("_Args")


def loop_name() -> str:
    """`"uvloop"` when the commands will run on uvloop, else `"asyncio"`."""
    if os.environ.get("ACP_ONCE_LOOP", "").strip().lower() == "asyncio":
        return "asyncio"
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def run(fn: Callable[[*_Args], Awaitable[_T]], *args: *_Args) -> _T:
    """`anyio.run(fn, *args)` on uvloop when `loop_name()` says so, else on asyncio.

    Raises whatever `fn` raises.
    """
    return anyio.run(fn, *args, backend_options={"use_uvloop": loop_name() == "uvloop"})
