"""Results of the conformance suite, the report, and its JSON and JUnit XML forms."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from acp_once.conformance.rules import explain_refs

__all__ = ["CheckResult", "Level", "Report", "Status", "write_json", "write_junit"]


class Level(StrEnum):
    """How strongly the spec asks for the behaviour (only a failed MUST fails the run)."""

    MUST = "MUST"
    SHOULD = "SHOULD"
    MAY = "MAY"


class Status(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(slots=True)
class CheckResult:
    """The outcome of one requirement.

    Attributes:
        id: stable requirement id (e.g. `trace.T1-same-connection`).
        level: MUST, SHOULD or MAY.
        refs: the rules the check is tied to (ids defined in docs/rules.md).
        title: one line saying what is checked.
        status: passed, failed or skipped.
        message: why it failed or was skipped, or what was observed (for MAY results).
        duration: seconds.
        transcript: every frame both ways during the check, kept for failed checks only:
            `{"conn": n, "dir": "sent"|"received", "t": seconds, "frame": text}`.
        sent: for a failed check, the request it sent last (method and params).
        expected: for a failed check, what it expected.
        received: for a failed check, what came back (or that nothing did, after how long).
    """

    id: str
    level: Level
    refs: tuple[str, ...]
    title: str
    status: Status
    message: str = ""
    duration: float = 0.0
    transcript: list[dict[str, Any]] = field(default_factory=list)
    sent: str = ""
    expected: str = ""
    received: str = ""

    @property
    def verdict(self) -> str:
        """The status in the words of the check's level: a failed MUST is `failed`, a failed
        SHOULD a `warning`, a failed MAY `not implemented` (optional)."""
        if self.status is not Status.FAILED:
            return str(self.status)
        return {Level.MUST: "failed", Level.SHOULD: "warning"}.get(self.level, "not implemented")

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "level": str(self.level),
            "refs": list(self.refs),
            "title": self.title,
            "status": str(self.status),
            "verdict": self.verdict,
            "message": self.message,
            "sent": self.sent,
            "expected": self.expected,
            "received": self.received,
            "duration": round(self.duration, 3),
            "transcript": self.transcript,
        }


@dataclass(slots=True)
class Report:
    """Every result of one run against one target."""

    target: str
    results: list[CheckResult] = field(default_factory=list)
    duration: float = 0.0

    def summary(self) -> dict[str, int]:
        """Counts: total, passed, failed, skipped, and failed per level (`failed_must`, ...)."""
        counts = Counter(str(r.status) for r in self.results)
        out = {"total": len(self.results)}
        for status in Status:
            out[str(status)] = counts.get(str(status), 0)
        for level in Level:
            out[f"failed_{level.lower()}"] = sum(
                1 for r in self.results if r.status is Status.FAILED and r.level is level
            )
        return out

    @property
    def exit_code(self) -> int:
        """1 when a MUST failed, else 0."""
        return 1 if self.summary()["failed_must"] else 0

    def by_id(self, requirement_id: str) -> CheckResult:
        for result in self.results:
            if result.id == requirement_id:
                return result
        raise KeyError(requirement_id)

    def failed_ids(self) -> set[str]:
        return {r.id for r in self.results if r.status is Status.FAILED}

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "duration": round(self.duration, 3),
            "summary": self.summary(),
            "exitCode": self.exit_code,
            "results": [r.to_dict() for r in self.results],
        }


def write_json(report: Report, path: Path) -> None:
    """Write the report as JSON (UTF-8)."""
    path.write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n", "utf-8")


def _transcript_text(result: CheckResult) -> str:
    return "\n".join(
        f"[c{f['conn']} {f['t']:8.3f}s] {'->' if f['dir'] == 'sent' else '<-'} {f['frame']}"
        for f in result.transcript
    )


def write_junit(report: Report, path: Path) -> None:
    """Write the report as JUnit XML: one testcase per requirement (classname = level)."""
    summary = report.summary()
    suite = ET.Element(
        "testsuite",
        {
            "name": "acp-once conformance",
            "tests": str(summary["total"]),
            "failures": str(summary["failed"]),
            "errors": "0",
            "skipped": str(summary["skipped"]),
            "time": f"{report.duration:.3f}",
        },
    )
    ET.SubElement(
        ET.SubElement(suite, "properties"), "property", name="target", value=report.target
    )
    for result in report.results:
        case = ET.SubElement(
            suite,
            "testcase",
            {
                "classname": f"acp.{result.level}",
                "name": result.id,
                "time": f"{result.duration:.3f}",
            },
        )
        if result.status is Status.FAILED:
            failure = ET.SubElement(
                case, "failure", message=result.message, type=f"{result.level} {result.verdict}"
            )
            failure.text = (
                f"{result.title}\nsent: {result.sent}\nexpected: {result.expected}\n"
                f"received: {result.received}\nrefs: {explain_refs(result.refs)}\n\n"
                f"{_transcript_text(result)}"
            )
        elif result.status is Status.SKIPPED:
            ET.SubElement(case, "skipped", message=result.message)
        elif result.message:
            ET.SubElement(case, "system-out").text = result.message
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
