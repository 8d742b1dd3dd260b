"""The conformance suite against the reference agent (all pass) and broken agents (the right ids
fail), plus its reports and the `acp-once check` entry point."""

from __future__ import annotations

import io
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from rich.console import Console

from acp_once.cli.check import run_check
from acp_once.client import StdioLauncher
from acp_once.conformance import (
    CHECKS,
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
from tests.conformance.groups import GROUPS, PRIVACY, group_ids, select, ungrouped_or_twice

FIXTURE = Path(__file__).parent / "fixtures" / "broken_agent.py"
SLOW = "[work:1]"

REQUIREMENT_IDS = [
    "init.version",
    "session.new",
    "resume.state-before-response",
    "close.idempotent",
    "delete.idempotent",
    "cancel-request.exactly-once",
    "key.valid",
    "key.null-absent",
    "key.invalid.empty",
    "key.invalid.too-long",
    "key.invalid.number",
    "key.invalid.boolean",
    "key.invalid.object",
    "key.invalid.array",
    "key.case-sensitive",
    "trace.T1-same-connection",
    "trace.T2-new-connection",
    "trace.T3-agent-restart",
    "trace.T4-retry-while-held",
    "trace.T5-retry-after-error",
    "trace.T6-other-session",
    "trace.T7-inserted-during-work",
    "withdraw.all-waiters",
    "reuse.different-prompt",
    "batch.empty",
    "batch.mixed",
    "batch.notifications-only",
    "batch.invalid-entry",
    "privacy.no-key-in-frames",
]


def reference_command(tmp: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "acp_once",
        "agent",
        "--store",
        f"sqlite:{tmp / 'sessions.sqlite3'}",
        "--side-effects",
        str(tmp / "effects"),
    ]


# -- fast: the catalogue, the reports, the CLI's refusals ------------------------------------------


def test_requirement_ids_are_stable_unique_and_tied_to_rules() -> None:
    assert [c.id for c in CHECKS] == REQUIREMENT_IDS
    assert all(c.refs and c.title for c in CHECKS)
    assert next(c for c in CHECKS if c.id == "reuse.different-prompt").level is Level.MAY
    assert [c.id for c in checks_for(["key.invalid.*"])] == REQUIREMENT_IDS[8:14]


def test_the_groups_cover_every_check_once() -> None:
    assert ungrouped_or_twice() == []
    ran = {id for group in GROUPS for id in group_ids(group)}
    assert ran == set(REQUIREMENT_IDS)
    assert all(group_ids(group)[-1] == PRIVACY for group in GROUPS)


def _result(id: str, level: Level, status: Status) -> CheckResult:
    transcript = (
        [{"conn": 1, "dir": "sent", "t": 0.0, "frame": '{"id":0}'}]
        if status is Status.FAILED
        else []
    )
    return CheckResult(id, level, ("R1",), "title", status, "why", 0.5, transcript)


def test_exit_code_is_non_zero_only_when_a_must_fails() -> None:
    report = Report("t", [_result("a", Level.SHOULD, Status.FAILED)])
    assert report.exit_code == 0
    report.results.append(_result("b", Level.MAY, Status.FAILED))
    assert report.exit_code == 0
    report.results.append(_result("c", Level.MUST, Status.SKIPPED))
    assert report.exit_code == 0
    report.results.append(_result("d", Level.MUST, Status.FAILED))
    assert report.exit_code == 1
    assert report.summary() == {
        "total": 4,
        "passed": 0,
        "failed": 3,
        "skipped": 1,
        "failed_must": 1,
        "failed_should": 1,
        "failed_may": 1,
    }


def test_json_and_junit_reports(tmp_path: Path) -> None:
    report = Report(
        "stdio: agent",
        [
            _result("ok", Level.MUST, Status.PASSED),
            _result("bad", Level.MUST, Status.FAILED),
            _result("skip", Level.SHOULD, Status.SKIPPED),
        ],
        duration=1.5,
    )
    write_json(report, tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["exitCode"] == 1
    assert data["summary"]["failed_must"] == 1
    assert [r["status"] for r in data["results"]] == ["passed", "failed", "skipped"]
    assert data["results"][1]["transcript"][0]["dir"] == "sent"

    write_junit(report, tmp_path / "r.xml")
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("3", "1", "1")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    failure = cases["bad"].find("failure")
    assert failure is not None and failure.get("message") == "why"
    assert failure.text is not None and '-> {"id":0}' in failure.text
    assert cases["skip"].find("skipped") is not None
    assert cases["ok"].find("failure") is None


def _console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=120), buffer


def test_check_refuses_bad_url_targets_and_a_missing_command() -> None:
    console, out = _console()

    def check(target: str | None) -> int:
        return run_check(
            target=target,
            command=[],
            token=None,
            json_report=None,
            junit=None,
            slow_prompt=SLOW,
            console=console,
        )

    assert check("ftp://localhost:1/acp") == 2
    assert "unsupported URL" in out.getvalue()
    assert check("http://localhost:1/acp") == 2  # nothing listens there: not run, exit 2
    assert "could not reach http://localhost:1/acp: connection refused" in out.getvalue()
    assert check(None) == 2
    assert "give the agent command" in out.getvalue()


@pytest.mark.slow
@pytest.mark.anyio
async def test_an_agent_that_does_not_start_is_reported_not_run(tmp_path: Path) -> None:
    target = StdioLauncher([sys.executable, str(tmp_path / "missing.py")])
    with pytest.raises(TargetUnavailable):
        await run_suite(target, slow_prompt=SLOW, timeout=10)


# -- slow: real agents over stdio ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
def test_the_reference_agent_passes_every_check(tmp_path: Path, group: str) -> None:
    """Through `acp-once check` itself: exit code, JSON and JUnit reports; one group of checks
    per test (`tests/conformance/groups.py`), every check in one of them."""
    console, out = _console()
    code = run_check(
        target=None,
        command=reference_command(tmp_path),
        token=None,
        json_report=tmp_path / "report.json",
        junit=tmp_path / "report.xml",
        slow_prompt=SLOW,
        timeout=15,
        console=console,
        select=select(group),
    )
    expected = group_ids(group)
    data = json.loads((tmp_path / "report.json").read_text())
    not_passed = {r["id"]: r["message"] for r in data["results"] if r["status"] != "passed"}
    assert not_passed == {}, out.getvalue()
    assert code == 0
    assert [r["id"] for r in data["results"]] == expected
    assert [id for id in REQUIREMENT_IDS if id in expected] == expected
    if "reuse.different-prompt" in expected:
        reuse = next(r for r in data["results"] if r["id"] == "reuse.different-prompt")
        assert "-32602" in reuse["message"]  # the reference agent compares prompts
    privacy = next(r for r in data["results"] if r["id"] == PRIVACY)
    assert "scanned" in privacy["message"]
    suite = ET.parse(tmp_path / "report.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "0"
    assert suite.get("tests") == str(len(expected))
    assert "every MUST requirement holds" in out.getvalue()


BROKEN = {
    # mode: (checks to run, the ids that must fail: exactly these)
    "ignore-keys": (
        ["key.case-sensitive", "key.invalid.number", "trace.T1-*", "trace.T4-*"],
        {"trace.T1-same-connection", "trace.T4-retry-while-held"},
    ),
    "echo-key": (["key.valid", "privacy.*"], {"privacy.no-key-in-frames"}),
    "burn-key": (["trace.T1-*", "trace.T5-*"], {"trace.T5-retry-after-error"}),
    "empty-key": (["key.invalid.*"], {"key.invalid.empty"}),
    # an array answered with one -32600 (the TypeScript SDK 2.4.0): only the empty batch passes
    "single-batch-error": (
        ["batch.*"],
        {"batch.mixed", "batch.notifications-only", "batch.invalid-entry"},
    ),
}


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("mode", sorted(BROKEN))
async def test_broken_agents_fail_the_right_requirements(tmp_path: Path, mode: str) -> None:
    select, expected = BROKEN[mode]
    command = [sys.executable, str(FIXTURE), mode, "--store", f"sqlite:{tmp_path / 'db'}"]
    seen: list[str] = []
    report = await run_suite(
        StdioLauncher(command),
        slow_prompt=SLOW,
        select=select,
        timeout=10,
        on_result=lambda r: seen.append(r.id),
    )
    assert seen == [r.id for r in report.results]
    assert report.failed_ids() == expected, {r.id: r.message for r in report.results}
    assert report.exit_code == 1
    assert not [r for r in report.results if r.status is Status.SKIPPED]
    for requirement in expected:
        failed = report.by_id(requirement)
        directions = {frame["dir"] for frame in failed.transcript}
        assert directions == {"sent", "received"}, "a failed check keeps its wire transcript"
    for passed in (r for r in report.results if r.status is Status.PASSED):
        assert passed.transcript == []
