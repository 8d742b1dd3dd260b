"""`acp-once check`: run the conformance suite against an agent and show the results.

`acp-once check -- CMD ARGS` launches `CMD ARGS` as a stdio agent for every check (the agent's
storage must persist across launches: same command, same store). `acp-once check
ws://HOST:PORT/acp [--token T]` opens fresh WebSocket connections to a running server instead
(a check that needs an agent restart is skipped there); `http://HOST:PORT/acp` does the same
over Streamable HTTP.

Each result is printed once, as its check ends: a failure with what was sent, what was expected,
what came back, and each rule it cites with the page of docs/ that explains it. A failed SHOULD
is a warning and a failed MAY is "not implemented"; only a failed MUST fails the run.
`--list` prints the checks; `--only ID` (repeatable, fnmatch patterns) runs some of them.
"""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Sequence
from pathlib import Path

import anyio
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table

from acp_once.cli.reasons import unreachable
from acp_once.client import HttpLauncher, Launcher, StdioLauncher, WebSocketLauncher
from acp_once.conformance import (
    CHECKS,
    Check,
    CheckResult,
    Level,
    Report,
    Status,
    TargetUnavailable,
    checks_for,
    run_suite,
    write_json,
    write_junit,
)
from acp_once.conformance.rules import explain_refs
from acp_once.conformance.suite import AgentSpeaksV1

__all__ = ["EXIT_V1", "list_checks", "run_check", "store_hint"]

_STYLE = {Status.PASSED: "green", Status.FAILED: "red", Status.SKIPPED: "yellow"}
_MARK = {Status.PASSED: "✓", Status.FAILED: "✗", Status.SKIPPED: "-"}
# a failed SHOULD or MAY does not fail the run: shown as a warning, not in red
_LEVEL_STYLE = {Level.MUST: "red", Level.SHOULD: "yellow", Level.MAY: "yellow"}


def list_checks(console: Console | None = None) -> int:
    """Print every check (id, level, title, rules with their docs/ pages); return 0."""
    out = console or Console()
    for check in CHECKS:
        line = f"{check.id}  {check.level}  {check.title}\n    rules: {explain_refs(check.refs)}"
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    return 0


def _patterns(only: Sequence[str] | None) -> list[str] | None:
    """`--only` values: repeatable, each may hold several ids separated by commas."""
    if not only:
        return None
    return [part.strip() for value in only for part in value.split(",") if part.strip()]


def _is_url(target: str) -> bool:
    return "://" in target


def run_check(
    *,
    target: str | None,
    command: list[str],
    token: str | None,
    json_report: Path | None,
    junit: Path | None,
    slow_prompt: str,
    timeout: float = 30.0,
    console: Console | None = None,
    select: Sequence[str] | None = None,
) -> int:
    """Run the conformance suite; return the exit status (1 when a MUST fails, 2 on misuse:
    no target, a bad URL, a target that did not start or initialize, an `--only` pattern that
    matches no check, a timeout that is not positive; `EXIT_V1` (3) when the agent speaks ACP
    v1, said in one line: the suite checks v2 agents).

    `select`: fnmatch patterns of the requirement ids to run (default: every check); a value
    may hold several, separated by commas. `timeout`: seconds any one answer may take.
    """
    out = console or Console()
    select = _patterns(select)
    if select is not None:
        unknown = [p for p in select if not checks_for([p])]
        if unknown:
            out.print(
                f"acp-once check: no check matches {', '.join(unknown)} "
                "(acp-once check --list prints the ids)",
                highlight=False,
                markup=False,
            )
            return 2
    if not timeout > 0:
        out.print(f"acp-once check: --timeout must be positive, not {timeout}", markup=False)
        return 2
    if target is not None and _is_url(target):
        if not target.startswith(("ws://", "wss://", "http://", "https://")):
            out.print(
                f"acp-once check: unsupported URL {target}: use ws://, wss://, http:// or "
                "https://, or -- CMD"
            )
            return 2
        if command:
            out.print("acp-once check: give either a URL or -- CMD, not both")
            return 2
        remote: WebSocketLauncher | HttpLauncher = (
            WebSocketLauncher(target, token)
            if target.startswith(("ws://", "wss://"))
            else HttpLauncher(target, token)
        )
        try:
            report = _run(remote, out, slow_prompt=slow_prompt, timeout=timeout, select=select)
        except AgentSpeaksV1:
            return _speaks_v1(out, None)
        except (TargetUnavailable, OSError) as exc:
            why = unreachable(exc, getattr(remote, "last_failure", None), url=target)
            out.print(
                f"acp-once check: could not reach {target}: {why}", markup=False, soft_wrap=True
            )
            return 2
        return _finish(out, report, json_report=json_report, junit=junit)
    if target is not None:
        command = [target, *command]
    if not command:
        out.print("acp-once check: give the agent command after --, e.g. acp-once check -- CMD")
        return 2
    if token is not None:
        out.print("[yellow]--token is ignored for a stdio target[/]")
    # the agent's stderr goes to a file: shown only when it cannot be started
    with tempfile.TemporaryFile() as stderr:
        # a short shutdown: every check starts and stops the agent again
        agent = StdioLauncher(command, stderr=stderr.fileno(), shutdown_timeout=3.0)
        try:
            report = _run(agent, out, slow_prompt=slow_prompt, timeout=timeout, select=select)
        except AgentSpeaksV1:
            return _speaks_v1(out, command)
        except (TargetUnavailable, OSError) as exc:
            stderr.seek(0)
            tail = stderr.read().decode("utf-8", "replace")[-2000:]
            out.print(f"acp-once check: the agent did not start or initialize: {exc}")
            if tail.strip():
                out.print(tail, markup=False, highlight=False)
            return 2
    status = _finish(out, report, json_report=json_report, junit=junit)
    hint = store_hint(report, command)
    if hint:
        out.print(hint, markup=False, highlight=False, soft_wrap=True)
    return status


def store_hint(report: Report, command: Sequence[str]) -> str | None:
    """One line blaming the store when checks of a stdio agent failed with "Session not
    found" (-32002): every check starts the agent again, so sessions made by an earlier
    launch are gone when they live in memory. None when no failure looks like that."""
    lost = [
        r.id
        for r in report.results
        if r.status is Status.FAILED and "-32002" in f"{r.received} {r.message}"
    ]
    if not lost:
        return None
    in_memory = any("memory" in arg for arg in command)
    cause = (
        "the agent keeps its sessions in memory (--store memory:)"
        if in_memory
        else "is the agent's store in memory?"
    )
    return (
        f"hint: {len(lost)} check(s) failed with Session not found (-32002) after the agent "
        f"was started again: {cause}; check starts it once per check, so its sessions must "
        "outlive the process: give it a durable store, e.g. --store sqlite:/tmp/agent.db"
    )


EXIT_V1 = 3
"""`acp-once check`'s exit status for an agent that speaks ACP v1."""


def _speaks_v1(out: Console, command: list[str] | None) -> int:
    """One line: the agent speaks v1, and how to check it anyway."""
    behind = "acp-once agent --runtime v1 --store STORE -- " + (
        shlex.join(command) if command else "CMD"
    )
    out.print(
        "acp-once check: this agent speaks ACP v1; the conformance suite checks v2 agents; "
        f"run it behind `{behind}` to get keys",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return EXIT_V1


def _finish(out: Console, report: Report, *, json_report: Path | None, junit: Path | None) -> int:
    _print_summary(out, report)
    if json_report is not None:
        write_json(report, json_report)
        out.print(f"JSON report: {json_report}")
    if junit is not None:
        write_junit(report, junit)
        out.print(f"JUnit report: {junit}")
    return report.exit_code


def _run(
    agent: Launcher,
    out: Console,
    *,
    slow_prompt: str,
    timeout: float,
    select: Sequence[str] | None,
) -> Report:
    checks = checks_for(select)

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=out,
        transient=True,
    ) as progress:
        task = progress.add_task("starting", total=len(checks))

        def started(check: Check) -> None:
            progress.update(task, description=check.id)

        def finished(result: CheckResult) -> None:
            _print_result(progress.console, result)
            progress.advance(task)

        return anyio.run(
            lambda: run_suite(
                agent,
                slow_prompt=slow_prompt,
                on_result=finished,
                on_start=started,
                select=select,
                timeout=timeout,
            )
        )


def _print_summary(out: Console, report: Report) -> None:
    out.print(f"target: {report.target}", highlight=False)
    table = Table(title="acp-once check", title_justify="left")
    table.add_column("level")
    for status in Status:
        table.add_column(str(status), justify="right")
    for level in Level:
        row = [r for r in report.results if r.level is level]
        counts = [sum(1 for r in row if r.status is status) for status in Status]
        table.add_row(
            str(level),
            *(
                f"[{_STYLE[status]}]{n}[/]" if n else "0"
                for status, n in zip(Status, counts, strict=True)
            ),
        )
    out.print(table)
    # the failures were printed once, as their checks ended; here only the counts
    summary = report.summary()
    verdict = (
        "[red]FAILED: a MUST requirement is broken[/]"
        if report.exit_code
        else "[green]every MUST requirement holds[/]"
    )
    out.print(
        f"{summary['passed']} passed, {summary['failed_must']} MUST failed, "
        f"{summary['failed_should']} SHOULD not met (warning), "
        f"{summary['failed_may']} MAY not implemented, {summary['skipped']} skipped "
        f"in {report.duration:.1f} s: {verdict}",
        highlight=False,
        soft_wrap=True,  # one line: scripts and tests look for the verdict in it
    )


def _print_result(out: Console, result: CheckResult) -> None:
    """One result, once: a line, and for a failure what was sent, expected and received."""
    style = _STYLE[result.status]
    if result.status is Status.FAILED:
        style = _LEVEL_STYLE[result.level]
    out.print(
        f"[{style}]{_MARK[result.status]} {result.verdict}[/] {result.id} [dim]({result.level})[/]",
        highlight=False,
    )
    if result.status is Status.PASSED and not result.message:
        return
    lines = [result.message] if result.message else []
    if result.status is Status.FAILED:
        lines += [
            f"sent:     {result.sent}",
            f"expected: {result.expected}",
            f"received: {result.received}",
            f"rules:    {explain_refs(result.refs)}",
        ]
    for line in lines:
        out.print(f"    {line}", highlight=False, markup=False, soft_wrap=True)
