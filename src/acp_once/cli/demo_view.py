"""The demo's screen: a progress bar per run, then the table."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from acp_once.demo import DemoResult, Transport, run_demo

__all__ = ["V1Agent", "results_table", "show_demo"]


def results_table(results: list[DemoResult]) -> Table:
    """The demo's result table (one row per run)."""
    table = Table(title="acp-once demo: the same faults, with and without idempotency keys")
    for name in (
        "run",
        "submitted",
        "inserted once",
        "2+ times",
        "lost",
        "dup. side effects",
        "missing side effects",
        "interrupted turns",
        "agent kills",
        "cut answers",
        "client restarts",
        "time",
    ):
        table.add_column(name, justify="left" if name == "run" else "right")
    for r in results:
        bad = "bold red" if not r.keys else "bold green"
        table.add_row(
            "with keys" if r.keys else "no keys",
            str(r.submissions),
            str(r.inserted_once),
            f"[{bad}]{r.inserted_twice_or_more}[/]",
            f"[{bad}]{r.lost}[/]",
            f"[{bad}]{r.duplicate_side_effects}[/]" if r.side_effects_counted else "-",
            str(r.missing_side_effects) if r.side_effects_counted else "-",
            str(r.interrupted_turns),
            str(r.agent_kills),
            str(r.cut_answers),
            str(r.client_restarts),
            f"{r.seconds:.1f} s",
        )
    return table


async def _one_run(
    keys: bool,
    submissions: int,
    seed: int,
    advance: Callable[[int], None],
    transport: Transport,
    v1: V1Agent | None,
) -> DemoResult:
    if v1 is None:
        return await run_demo(
            keys=keys, submissions=submissions, seed=seed, on_progress=advance, transport=transport
        )
    return await run_demo(
        keys=keys,
        submissions=submissions,
        seed=seed,
        on_progress=advance,
        agent_cmd=v1.command,
        prompt=v1.prompt,
        effects=v1.effects,
    )


@dataclass(frozen=True)
class V1Agent:
    """A v1 agent for the demo, behind the upgrade runtime (see `run_demo`'s `agent_cmd`)."""

    command: list[str]
    prompt: str
    effects: bool


@contextlib.contextmanager
def _expected_faults_unlogged() -> Iterator[None]:
    """The demo's faults are deliberate and counted in its table: the client's warning for
    each connection it loses would only scroll the progress bars. Errors still show."""
    client = logging.getLogger("acp_once.client")
    level = client.level
    client.setLevel(logging.ERROR)
    try:
        yield
    finally:
        client.setLevel(level)


def show_demo(
    *, submissions: int, seed: int, transport: Transport = "stdio", v1: V1Agent | None = None
) -> int:
    """Run both demos with a progress bar, print the table; 0 when keys kept the promise
    (with a v1 agent `v1`, behind the upgrade runtime over stdio)."""
    console = Console(width=None if Console().is_terminal else 120)
    results: list[DemoResult] = []
    with (
        _expected_faults_unlogged(),
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress,
    ):
        for keys in (True, False):
            task = progress.add_task("with keys   " if keys else "without keys", total=submissions)

            def advance(count: int, task: TaskID = task) -> None:
                progress.advance(task, count)

            results.append(anyio.run(_one_run, keys, submissions, seed, advance, transport, v1))
    console.print(results_table(results))
    if transport == "ws":
        drops = ", ".join(
            f"{r.dropped_connections} ({'with' if r.keys else 'no'} keys)" for r in results
        )
        console.print(
            "Over WebSocket to a supervised `acp-once serve` process: agent kills and cut "
            f"answers end the server process; connections dropped with the server running: "
            f"{drops}."
        )
    if transport == "http":
        console.print(
            "Over Streamable HTTP to a supervised `acp-once serve` process: agent kills and cut "
            "answers end the server process."
        )
    if v1 is not None:
        console.print(
            f"The v1 agent `{' '.join(v1.command)}` behind `acp-once agent --runtime v1`: agent "
            "kills and cut answers end the runtime and the agent together; a turn they "
            "interrupt is reported with stopReason error and not run again."
        )
    keyed = results[0]
    ok = keyed.inserted_twice_or_more == 0 and keyed.lost == 0 and keyed.duplicate_side_effects == 0
    console.print(
        "[bold green]With keys every submission was inserted exactly once.[/]"
        if ok
        else "[bold red]With keys something was duplicated or lost: that is a bug.[/]"
    )
    return 0 if ok else 1
