"""The demo's screen: a progress bar per run, then the table."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio
from rich.console import Console
from rich.measure import Measurement
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

__all__ = ["V1Agent", "fitting_table", "results_by_figure", "results_table", "show_demo"]


_TITLE = "acp-once demo: the same faults, with and without idempotency keys"
# (header, the figure of a run, whether it counts a broken promise)
_FIGURES: tuple[tuple[str, Callable[[DemoResult], str], bool], ...] = (
    ("submitted", lambda r: str(r.submissions), False),
    ("inserted once", lambda r: str(r.inserted_once), False),
    ("2+ times", lambda r: str(r.inserted_twice_or_more), True),
    ("lost", lambda r: str(r.lost), True),
    (
        "dup. side effects",
        lambda r: str(r.duplicate_side_effects) if r.side_effects_counted else "-",
        True,
    ),
    (
        "missing side effects",
        lambda r: str(r.missing_side_effects) if r.side_effects_counted else "-",
        False,
    ),
    ("interrupted turns", lambda r: str(r.interrupted_turns), False),
    ("agent kills", lambda r: str(r.agent_kills), False),
    ("cut answers", lambda r: str(r.cut_answers), False),
    ("client restarts", lambda r: str(r.client_restarts), False),
    ("time", lambda r: f"{r.seconds:.1f} s", False),
)


def _run_name(r: DemoResult) -> str:
    return "with keys" if r.keys else "no keys"


def _shown(r: DemoResult, figure: Callable[[DemoResult], str], broken: bool) -> str:
    if not broken:
        return figure(r)
    return f"[{'bold red' if not r.keys else 'bold green'}]{figure(r)}[/]"


def results_table(results: list[DemoResult]) -> Table:
    """The demo's result table (one row per run)."""
    table = Table(title=_TITLE)
    table.add_column("run", justify="left")
    for name, _, _ in _FIGURES:
        table.add_column(name, justify="right")
    for r in results:
        table.add_row(_run_name(r), *(_shown(r, f, broken) for _, f, broken in _FIGURES))
    return table


def results_by_figure(results: list[DemoResult]) -> Table:
    """The same table turned: one row per figure, one column per run (fits 80 columns)."""
    table = Table(title=_TITLE)
    table.add_column("")
    for r in results:
        table.add_column(_run_name(r), justify="right")
    for name, figure, broken in _FIGURES:
        table.add_row(name, *(_shown(r, figure, broken) for r in results))
    return table


def fitting_table(results: list[DemoResult], console: Console) -> Table:
    """`results_table` when it fits the console's width, else `results_by_figure`."""
    table = results_table(results)
    # measured without the console's limit (a table measures at most the width it is given);
    # squeezed, rich cuts headers ("submit…"), so the whole width or the turned table
    wanted = Measurement.get(console, console.options.update_width(10_000), table).maximum
    if wanted <= console.width:
        return table
    return results_by_figure(results)


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
    # a pipe gets 120 columns, unless COLUMNS says otherwise (as a terminal's width does)
    probe = Console()
    console = Console(width=None if probe.is_terminal or "COLUMNS" in os.environ else 120)
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
    console.print(fitting_table(results, console))
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
