"""The conformance suite: does an ACP v2 agent keep the idempotency-key promise?

    report = await run_suite(StdioTarget(["my-agent", "--stdio"]), slow_prompt="[work:2]")
    report.exit_code          # non-zero when a MUST failed
    write_json(report, path); write_junit(report, path)

Every check has a stable requirement id tied to the digest's rules (`CHECKS` lists them), a
level (MUST/SHOULD/MAY), and runs on fresh connections to the target; inserted messages are
observed on the wire only, so any agent can be checked.
"""

from acp_once.conformance.checks import CHECKS, Check
from acp_once.conformance.harness import (
    AgentTarget,
    CheckContext,
    HttpTarget,
    Link,
    Probe,
    StdioTarget,
    WebSocketTarget,
)
from acp_once.conformance.model import CheckResult, Level, Report, Status, write_json, write_junit
from acp_once.conformance.suite import TargetUnavailable, checks_for, run_suite

__all__ = [
    "CHECKS",
    "AgentTarget",
    "Check",
    "CheckContext",
    "CheckResult",
    "HttpTarget",
    "Level",
    "Link",
    "Probe",
    "Report",
    "Status",
    "StdioTarget",
    "TargetUnavailable",
    "WebSocketTarget",
    "checks_for",
    "run_suite",
    "write_json",
    "write_junit",
]
