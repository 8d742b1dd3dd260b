"""`acp-once zed`: the `agent_servers` entry of Zed's settings.json for this installation.

Zed starts the agent itself, with its own PATH and working directory: a bare `acp-once` or
`python3` there may be another interpreter, or none (and PEP 668 systems forbid installing into
the system one). So the entry names this installation's console script (or, without one, this
interpreter with `-m acp_once`) by its absolute path, a store by an absolute path, an agent
file by its absolute path, and for a `MODULE:FACTORY` found under the current directory, that
directory as PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["agent_command", "zed_settings"]


def agent_command() -> tuple[str, list[str]]:
    """The absolute command that runs this installation's `acp-once`, and the arguments before
    the subcommand: its console script beside this interpreter, else the interpreter and
    `-m acp_once`. Symbolic links are kept (a virtual environment's python is one)."""
    python = Path(os.path.abspath(sys.executable))
    script = python.with_name("acp-once.exe" if os.name == "nt" else "acp-once")
    if script.is_file() and os.access(script, os.X_OK):
        return str(script), []
    return str(python), ["-m", "acp_once"]


def _absolute_store(store: str) -> str:
    if store.startswith("sqlite:") and store != "sqlite::memory:":
        return "sqlite:" + os.path.abspath(Path(store.removeprefix("sqlite:")).expanduser())
    return store


def _target(target: str, env: dict[str, str]) -> str:
    """`target` as Zed's working directory cannot change it: a file made absolute; a module
    found under the current directory gets that directory as PYTHONPATH."""
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        return f"{os.path.abspath(Path(where).expanduser())}:{name}"
    top = where.partition(".")[0]
    cwd = Path.cwd()
    sys.path.insert(0, str(cwd))
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        found = None
    finally:
        sys.path.remove(str(cwd))
    origin = found.origin if found is not None else None
    if origin is not None and Path(origin).resolve().is_relative_to(cwd.resolve()):
        env["PYTHONPATH"] = str(cwd)
    return target


def zed_settings(
    *,
    store: str,
    target: str | None = None,
    v1_command: Sequence[str] = (),
    name: str | None = None,
) -> str:
    """The JSON to merge into Zed's settings.json: `{"agent_servers": {NAME: {...}}}`, whose
    command runs `acp-once agent` of this installation on `store` (made absolute): the
    reference agent, your `target` (MODULE:FACTORY or FILE.py:FACTORY), or the ACP v1 agent
    `v1_command` served as v2 with keys (`--runtime v1`)."""
    command, args = agent_command()
    env: dict[str, str] = {}
    args = [*args, "agent"]
    if v1_command:
        args += ["--runtime", "v1", "--store", _absolute_store(store), "--", *v1_command]
        default_name = f"{Path(v1_command[0]).name} (v2, keys by acp-once)"
    elif target is not None:
        args += [_target(target, env), "--store", _absolute_store(store)]
        default_name = target.rpartition(":")[2]
    else:
        args += ["--store", _absolute_store(store)]
        default_name = "acp-once reference agent"
    entry: dict[str, object] = {"type": "custom", "command": command, "args": args}
    if env:
        entry["env"] = env
    return json.dumps({"agent_servers": {name or default_name: entry}}, indent=2)
