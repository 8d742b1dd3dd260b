"""What `acp-once check` says when an agent fails: the missing method by name, what a timeout
waited for, non-JSON on stdout with its line, each failure once with what was sent, expected and
received, rules with their docs/ pages, and level wording that matches the check's level."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from acp_once.client import StdioLauncher
from acp_once.conformance import CHECKS, TargetUnavailable, run_suite
from acp_once.conformance.rules import RULE_DOCS, explain_refs, rule_location

ROOT = Path(__file__).resolve().parents[2]
ECHO = ROOT / "examples" / "echo_agent.py"

# A hand-written stdio agent (as in a language without acp-once, whose serve_stdio keeps stdout
# for frames) that writes `debug: ...` to stdout at the start or before answering session/new.
NOISY_AGENT = """
import json
import sys
import uuid

WHEN = sys.argv[1]
if WHEN == "at-start":
    print("Starting the noisy agent", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    if "id" not in request:
        continue
    method = request.get("method")
    if method == "initialize":
        result = {"protocolVersion": 2, "info": {"name": "noisy", "version": "1"},
                  "capabilities": {"session": {}}}
    elif method == "session/new":
        if WHEN == "on-session":
            print("debug: making a session", flush=True)
        result = {"sessionId": uuid.uuid4().hex}
    else:
        answer = {"jsonrpc": "2.0", "id": request["id"],
                  "error": {"code": -32601, "message": "not supported"}}
        print(json.dumps(answer), flush=True)
        continue
    print(json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": result}), flush=True)
"""


def _slug(heading: str) -> str:
    # the anchor GitHub gives a heading, computed as tests/test_docs_rules.py does
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_ref_of_every_check_points_at_its_heading_in_docs() -> None:
    refs = {ref for check in CHECKS for ref in check.refs}
    assert refs <= set(RULE_DOCS), sorted(refs - set(RULE_DOCS))
    for rule in refs:
        page, _, anchor = rule_location(rule).partition("#")
        text = (ROOT / page).read_text(encoding="utf-8")
        headings = re.findall(rf"^### ({rule} — .*)$", text, re.MULTILINE)
        assert [_slug(h) for h in headings] == [anchor], (rule, page)
    assert rule_location("R999") == "docs/rules.md"
    assert explain_refs(("R19",)) == f"R19 ({rule_location('R19')})"
    assert rule_location("R19").startswith("docs/protocol/keys.md#r19--")


def _check_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acp_once", "check", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"COLUMNS": "400", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.slow
def test_list_prints_every_check_and_only_runs_the_named_ones() -> None:
    listed = _check_cli("--list")
    assert listed.returncode == 0, listed.stderr
    for check in CHECKS:
        assert f"{check.id}  {check.level}  {check.title}" in listed.stdout
    assert f"R19 ({rule_location('R19')})" in listed.stdout

    unknown = _check_cli("--only", "no.such-check", "--", sys.executable, str(ECHO))
    assert unknown.returncode == 2
    assert "no check matches no.such-check" in unknown.stdout

    one = _check_cli(
        "--only", "init.version,delete.*", "--timeout", "20", "--", sys.executable, str(ECHO)
    )
    assert one.returncode == 0, one.stdout + one.stderr
    ran = re.findall(r"^[✓✗-] \w[\w ]* (\S+) \((?:MUST|SHOULD|MAY)\)$", one.stdout, re.MULTILINE)
    assert ran == ["init.version", "delete.idempotent"], one.stdout


@pytest.mark.slow
@pytest.mark.anyio
async def test_non_json_before_initialize_is_reported_at_once_with_its_line(
    tmp_path: Path,
) -> None:
    script = tmp_path / "noisy.py"
    script.write_text(NOISY_AGENT, encoding="utf-8")
    started = time.monotonic()
    with pytest.raises(TargetUnavailable) as raised:
        await run_suite(StdioLauncher([sys.executable, str(script), "at-start"]), timeout=25)
    # before: a bare "TimeoutError:" once the 25 s had passed
    assert time.monotonic() - started < 15
    assert str(raised.value) == "non-JSON on stdout: 'Starting the noisy agent'"


@pytest.mark.slow
@pytest.mark.anyio
async def test_non_json_during_a_check_fails_it_at_once_with_its_line(tmp_path: Path) -> None:
    script = tmp_path / "noisy.py"
    script.write_text(NOISY_AGENT, encoding="utf-8")
    report = await run_suite(
        StdioLauncher([sys.executable, str(script), "on-session"]),
        select=["session.new"],
        timeout=25,
    )
    result = report.by_id("session.new")
    assert result.message == "non-JSON on stdout: 'debug: making a session'"
    assert result.received == "debug: making a session"
    assert result.sent.startswith('session/new {"cwd":')
    assert result.duration < 15  # not the 25 s timeout
