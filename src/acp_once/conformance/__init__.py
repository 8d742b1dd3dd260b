"""The conformance suite: does an ACP v2 agent keep the idempotency-key promise?

    from acp_once.client import StdioLauncher

    report = await run_suite(StdioLauncher(["my-agent", "--stdio"]), slow_prompt="[work:2]")
    report.exit_code          # non-zero when a MUST failed
    write_json(report, path); write_junit(report, path)

Every check has a stable requirement id tied to rules in docs/rules.md (`CHECKS` lists them), a
level (MUST/SHOULD/MAY), and runs on fresh connections opened by a client launcher
(`acp_once.client`; `Target.of(launcher)` says what the suite can do with it). Inserted
messages are observed on the wire only, so any agent can be checked.
"""

from acp_once.conformance.checks import CHECKS, Check
from acp_once.conformance.harness import CheckContext, Link, Probe, Target
from acp_once.conformance.model import CheckResult, Level, Report, Status, write_json, write_junit
from acp_once.conformance.suite import TargetUnavailable, checks_for, run_suite

__all__ = [
    "CHECKS",
    "Check",
    "CheckContext",
    "CheckResult",
    "Level",
    "Link",
    "Probe",
    "Report",
    "Status",
    "Target",
    "TargetUnavailable",
    "checks_for",
    "run_suite",
    "write_json",
    "write_junit",
]
