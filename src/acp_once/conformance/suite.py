"""`run_suite`: every check against one target, each on fresh connections."""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Iterable

import anyio

from acp_once.client import Launcher
from acp_once.conformance.checks import CHECKS, Check
from acp_once.conformance.harness import (
    CheckContext,
    CheckFailed,
    CheckSkipped,
    SuiteState,
    Target,
)
from acp_once.conformance.model import CheckResult, Report, Status
from acp_once.protocol.errors import AcpError
from acp_once.protocol.v1_to_v2 import answer_version
from acp_once.rpc.errors import ConnectionClosed, TransportError

__all__ = [
    "AgentSpeaksV1",
    "TargetUnavailable",
    "checks_for",
    "preflight",
    "run_check",
    "run_suite",
]

ResultCallback = Callable[[CheckResult], None]


class TargetUnavailable(Exception):
    """The target could not even be connected to and initialized; no check was run."""


class AgentSpeaksV1(Exception):
    """The target answered `initialize` as an ACP v1 agent; no check was run (the checks are
    about v2's idempotency keys, which v1 does not have)."""


async def preflight(target: Launcher | Target, timeout: float = 30.0) -> None:
    """Connect once and initialize.

    Raises:
        TargetUnavailable: the agent could not be started, or did not answer `initialize`.
        AgentSpeaksV1: the agent answered `initialize` as an ACP v1 agent.
    """
    ctx = CheckContext(Target.of(target), SuiteState(), slow_prompt="", timeout=timeout)
    answer: object = None
    try:
        # the start as well as the answer: a command that never opens its pipes
        with anyio.fail_after(timeout):
            async with ctx.connect() as probe:
                answer = probe.initialize_result
    except Exception as raised:  # reported as one clear error
        exc = _leaf(raised)
        failure = ctx.non_json_failure()
        if failure is not None:
            raise TargetUnavailable(str(failure)) from exc
        match exc:
            case CheckFailed():
                message = str(exc)
            case TimeoutError():
                message = f"no answer to initialize within {timeout:g} s"
            case _:
                message = f"{type(exc).__name__}: {exc}"
        raise TargetUnavailable(message) from exc
    if answer_version(answer) == 1:
        raise AgentSpeaksV1("the agent answered initialize with ACP v1")


def checks_for(select: Iterable[str] | None = None) -> list[Check]:
    """The checks whose id matches one of the `select` patterns (fnmatch), all when None."""
    if select is None:
        return list(CHECKS)
    patterns = list(select)
    return [c for c in CHECKS if any(fnmatch.fnmatchcase(c.id, p) for p in patterns)]


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def run_check(
    check: Check,
    target: Launcher | Target,
    suite: SuiteState,
    *,
    slow_prompt: str,
    timeout: float,
) -> CheckResult:
    """Run one check; any outcome becomes a `CheckResult` (only cancellation propagates)."""
    ctx = CheckContext(Target.of(target), suite, slow_prompt=slow_prompt, timeout=timeout)
    started = time.monotonic()
    status, message = Status.PASSED, ""
    failure: CheckFailed | None = None
    try:
        # a check may wait for several slow turns and restarts; bound the whole of it too
        with anyio.fail_after(timeout * 4):
            message = await check.run(ctx) or ""
    except Exception as raised:  # every failure is reported
        exc = _leaf(raised)
        # non-JSON from the agent ends the connection; whatever that caused, it is the cause
        failure = ctx.non_json_failure()
        if failure is None:
            failure = _as_failure(exc, ctx, time.monotonic() - started)
        if isinstance(exc, CheckSkipped) and failure is None:
            status, message = Status.SKIPPED, str(exc)
        else:
            assert failure is not None
            status, message = Status.FAILED, str(failure)
    if ctx.notes:
        message = "; ".join([message, *ctx.notes]) if message else "; ".join(ctx.notes)
    result = CheckResult(
        id=check.id,
        level=check.level,
        refs=check.refs,
        title=check.title,
        status=status,
        message=message,
        duration=time.monotonic() - started,
        transcript=ctx.transcript if status is Status.FAILED else [],
    )
    if failure is not None and status is Status.FAILED:
        last = ctx.last
        result.sent = failure.sent or (last.sent if last else "nothing")
        result.expected = failure.expected or check.title
        result.received = failure.received or (
            last.received or "nothing yet" if last else "nothing"
        )
    return result


def _as_failure(exc: BaseException, ctx: CheckContext, elapsed: float) -> CheckFailed | None:
    """What a check's exception means as a failure (None for a skip)."""
    last = ctx.last
    sent = last.sent if last else ""
    match exc:
        case CheckFailed():
            return exc
        case CheckSkipped():
            return None
        case AcpError():
            return CheckFailed(
                f"unexpected error answer {exc.code}: {exc.message}",
                sent=sent,
                expected="a result",
                received=f"error {exc.code}: {exc.message}",
            )
        case TimeoutError():
            # the bound of the whole check (answers have their own, reported by the probe)
            return CheckFailed(
                f"the check did not finish within {elapsed:.1f} s "
                f"(4 x --timeout {ctx.timeout:g} s)",
                sent=sent,
                expected=f"the check's answers within {ctx.timeout * 4:g} s in all",
                received=(last.received if last else "") or f"nothing after {elapsed:.1f} s",
            )
        case ConnectionClosed() | TransportError():
            return CheckFailed(
                f"the connection was lost: {exc}",
                sent=sent,
                received=f"the connection ended after {elapsed:.1f} s",
            )
        case _:
            return CheckFailed(f"{type(exc).__name__}: {exc}", sent=sent)


async def run_suite(
    target: Launcher | Target,
    *,
    slow_prompt: str = "[work:2]",
    on_result: ResultCallback | None = None,
    on_start: Callable[[Check], None] | None = None,
    select: Iterable[str] | None = None,
    timeout: float = 30.0,
) -> Report:
    """Run the conformance checks against `target` and return the report.

    Args:
        target: what to connect to (a client launcher, e.g. `StdioLauncher([...])`, or a
            `Target` that says more about it); every check opens fresh connections.
        slow_prompt: prompt text that keeps the agent busy for a while (held-prompt traces);
            it should last at least a second, and at most a few.
        on_result: called with each result as soon as its check finishes.
        on_start: called with each check before it runs (for progress displays).
        select: fnmatch patterns of requirement ids to run (default: all).
        timeout: seconds any single answer may take; a whole check gets four times that.

    Raises:
        TargetUnavailable: the target did not start or answer `initialize` (nothing was run).
        AgentSpeaksV1: the target speaks ACP v1 (nothing was run).
    """
    target = Target.of(target)
    await preflight(target, timeout)
    report = Report(target=target.description)
    suite = SuiteState()
    started = time.monotonic()
    for check in checks_for(select):
        if on_start is not None:
            on_start(check)
        result = await run_check(check, target, suite, slow_prompt=slow_prompt, timeout=timeout)
        report.results.append(result)
        if on_result is not None:
            on_result(result)
    report.duration = time.monotonic() - started
    return report
