"""`acp-once check`: placeholder until the conformance suite lands."""

from __future__ import annotations

from pathlib import Path

__all__ = ["run_check"]


def run_check(
    *,
    target: str | None,
    command: list[str],
    token: str | None,
    json_report: Path | None,
    junit: Path | None,
    slow_prompt: str,
) -> int:
    """Run the conformance suite; return the exit status (non-zero when a MUST fails)."""
    print("acp-once check: the conformance suite is being built")
    return 2
