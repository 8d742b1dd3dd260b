"""`acp-once check` against the two example agents of the docs.

The README's agent (examples/quickstart_agent.py, a `SessionAgent`) passes every check, MUST,
SHOULD and MAY. The bare `Agent` face of the agent guide (examples/echo_agent.py) fails what
docs/guide/agent.md says it fails, and check says so usefully: each failure once, missing
methods by name, what a wait waited for, SHOULD and MAY failures in their own words, rules with
their docs/ pages.

The suite is run a few checks per test (short tests that workers share), and the guide's
summary line is held to the expected outcome of every check."""

from __future__ import annotations

import io
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console

from acp_once.cli.check import run_check
from acp_once.conformance import CHECKS, Level
from acp_once.conformance.rules import rule_location

ROOT = Path(__file__).resolve().parents[2]
ECHO = [sys.executable, str(ROOT / "examples" / "echo_agent.py")]
QUICKSTART = [sys.executable, str(ROOT / "examples" / "quickstart_agent.py")]
AGENT_GUIDE = ROOT / "docs" / "guide" / "agent.md"
IDS = [c.id for c in CHECKS]
CHUNKS = [IDS[i : i + 4] for i in range(0, len(IDS), 4)]

# every check's verdict against the echo agent: what the guide's summary line counts
PASSED = {"init.version"} | {c.id for c in CHECKS if c.id.startswith("batch.")}  # the engine
SKIPPED = {"delete.idempotent", "trace.T5-retry-after-error"}
NOT_IMPLEMENTED = {"reuse.different-prompt"}  # a MAY
WARNING = {"close.idempotent"}  # a SHOULD


def expected_verdict(id: str) -> str:
    for verdict, ids in (
        ("passed", PASSED),
        ("skipped", SKIPPED),
        ("not implemented", NOT_IMPLEMENTED),
        ("warning", WARNING),
    ):
        if id in ids:
            return verdict
    return "failed"


def test_the_agent_guide_states_what_check_reports_for_the_echo_agent() -> None:
    verdicts = [expected_verdict(c.id) for c in CHECKS]
    line = (
        f"{verdicts.count('passed')} passed, {verdicts.count('failed')} MUST failed, "
        f"{verdicts.count('warning')} SHOULD not met (warning), "
        f"{verdicts.count('not implemented')} MAY not implemented, "
        f"{verdicts.count('skipped')} skipped"
    )
    guide = AGENT_GUIDE.read_text(encoding="utf-8")
    block = re.search(r"<!-- echo-check:start -->\n```\n(.*)\n```\n<!-- echo-check:end -->", guide)
    assert block is not None, "the agent guide's echo-check block is gone"
    assert block.group(1) == line
    assert "acp-once check -- python examples/echo_agent.py" in guide
    assert "<!-- file: examples/echo_agent.py -->" in guide  # the agent the line is about
    # the levels the wording relies on
    levels = {c.id: c.level for c in CHECKS}
    assert all(levels[id] is Level.MAY for id in NOT_IMPLEMENTED)
    assert all(levels[id] is Level.SHOULD for id in WARNING)


@pytest.mark.slow
@pytest.mark.parametrize("ids", CHUNKS, ids=[chunk[0] for chunk in CHUNKS])
def test_check_reports_the_echo_agent_as_the_guide_says(tmp_path: Path, ids: list[str]) -> None:
    buffer = io.StringIO()
    code = run_check(
        target=None,
        command=ECHO,
        token=None,
        json_report=tmp_path / "report.json",
        junit=None,
        slow_prompt="[work:1]",
        # each answer's bound, agent start-up included (the echo agent answers in
        # milliseconds; a loaded machine can take seconds to start it); session.new waits this
        # long for the user_message update the echo agent never sends
        timeout=10,
        console=Console(file=buffer, width=100),
        select=ids,
    )
    out = buffer.getvalue()
    results = json.loads((tmp_path / "report.json").read_text())["results"]
    assert code == (1 if "failed" in {expected_verdict(id) for id in ids} else 0)
    assert {r["id"]: r["verdict"] for r in results} == {id: expected_verdict(id) for id in ids}
    # each result once (every failure was printed live and again in the summary)
    messages = Counter(r["message"] for r in results if r["message"])
    for r in results:
        assert len(re.findall(rf"^\S+ {r['verdict']} {re.escape(r['id'])} ", out, re.M)) == 1
        if r["message"]:
            assert out.count(r["message"]) == messages[r["message"]], (r["id"], out)
        if r["status"] != "failed":
            continue
        assert r["sent"] and r["expected"] and r["received"], r
        # the wording of a failure matches its check's level: no MUST in a MAY or SHOULD
        if r["level"] != "MUST":
            assert "MUST" not in r["message"], r
        for ref in r["refs"]:
            assert f"{ref} ({rule_location(ref)})" in out
    by_id = {r["id"]: r for r in results}
    if "init.version" in by_id:
        # a missing session/list was reported as an init.version failure
        assert by_id["init.version"]["status"] == "passed"
    if "cancel-request.exactly-once" in by_id:
        missing = "the agent does not implement session/list (-32601)"
        assert by_id["cancel-request.exactly-once"]["message"] == missing
    if "close.idempotent" in by_id:
        assert by_id["close.idempotent"]["received"].startswith("error -32601")
        assert "✗ warning close.idempotent (SHOULD)" in out
    if "session.new" in by_id:
        # "no answer in time ()" said nothing of what it waited for
        waited = by_id["session.new"]
        assert re.fullmatch(
            r"waited \d+\.\d s for a user_message update with messageId \w+ "
            r"\(the prompt's message, inserted\); it did not come",
            waited["message"],
        ), waited
        assert waited["sent"].startswith('session/prompt {"sessionId":')
        assert waited["received"] == "session/update kinds: no session/update at all"
    if "reuse.different-prompt" in by_id:
        assert "✗ not implemented reuse.different-prompt (MAY)" in out
    if "resume.state-before-response" in by_id:
        resume = by_id["resume.state-before-response"]
        assert resume["message"] == "the agent does not implement session/resume (-32601)"
        assert resume["sent"].startswith('session/resume {"sessionId":')


@pytest.mark.slow
@pytest.mark.parametrize("ids", CHUNKS, ids=[chunk[0] for chunk in CHUNKS])
def test_the_readme_agent_passes_every_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ids: list[str]
) -> None:
    # the agent keeps its sessions in ./sessions.db: here, a temporary directory
    monkeypatch.chdir(tmp_path)
    buffer = io.StringIO()
    code = run_check(
        target=None,
        command=QUICKSTART,
        token=None,
        json_report=tmp_path / "report.json",
        junit=None,
        # check's own default: the agent's half-second turns hold what is sent meanwhile
        slow_prompt="[work:2]",
        timeout=10,
        console=Console(file=buffer, width=100),
        select=ids,
    )
    results = json.loads((tmp_path / "report.json").read_text())["results"]
    assert {r["id"]: r["verdict"] for r in results} == dict.fromkeys(ids, "passed"), (
        buffer.getvalue()
    )
    assert code == 0
    assert (tmp_path / "sessions.db").exists()


def test_the_readme_says_its_agent_passes_check() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "acp-once check -- python examples/quickstart_agent.py` passes every check" in readme
