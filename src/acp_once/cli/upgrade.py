"""`acp-once agent --runtime v1 -- CMD ARGS`: a v1 stdio agent served as v2 on our stdio."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import typer

from acp_once.agent.runtime import HeldPolicy
from acp_once.cli import _eventloop

__all__ = ["run_upgrade"]

logger = logging.getLogger("acp_once.upgrade")


def run_upgrade(
    command: Sequence[str], url: str, *, policy: HeldPolicy, compare_prompts: bool
) -> int:
    """Serve the v1 agent `command` as v2 on stdin/stdout over the store `url` until stdin
    closes; returns the exit code (1: the agent could not be started, said on stderr).

    Raises:
        typer.BadParameter: no command was given.
    """
    if not command:
        raise typer.BadParameter("give the v1 agent's command after --, e.g. -- python my_agent.py")
    from acp_once.agent.faults import CrashAfterInsert
    from acp_once.agent.serve import serve_stdio
    from acp_once.storage import open_store
    from acp_once.support.proctree import kill_tree
    from acp_once.upgrade import ChildError, UpgradedAgent
    from acp_once.upgrade.containment import group_file_for

    # a memory store lives and dies with this process: no later runtime shares it
    group_file = None if url.startswith("memory") else group_file_for(url)

    crash = CrashAfterInsert.from_env()

    async def run() -> None:
        async with (
            open_store(url) as store,
            UpgradedAgent(
                store,
                command,
                policy=policy,
                compare_prompts=compare_prompts,
                group_file=group_file,
            ) as upgraded,
        ):
            if crash is not None:
                # the fault injection of the demo and the tests (ACP_ONCE_CRASH): the whole
                # upgraded agent dies after a commit, its v1 agent with it, as on a host crash
                def kill_child() -> None:
                    child = upgraded.children.latest
                    if child is not None:
                        kill_tree(child.pid)

                async def after_insert(session_id: str, message_id: str) -> None:
                    crash.maybe_crash(message_id, before=kill_child)

                upgraded.after_insert = after_insert  # type: ignore[method-assign]
            await serve_stdio(upgraded)

    try:
        _eventloop.run(run)
    except ChildError as exc:
        logger.error("%s", exc)
        return 1
    return 0
