"""The conformance checks in groups, for tests that run the whole suite against one agent.

Run whole, the suite takes ~45 s against the reference agent and ~150 s against the LangGraph
adapter on 2 cores, more under load: one test per group keeps every test short and lets the
workers share them. Every check is in exactly one group (a test checks it), except
`privacy.no-key-in-frames`, which runs at the end of every group and scans the frames of that
group's checks for that group's keys.
"""

from __future__ import annotations

from acp_once.conformance import CHECKS, checks_for

PRIVACY = "privacy.no-key-in-frames"

# balanced on the LangGraph adapter's times (each group ~20-25 s of checks there, plus ~18 s for
# its start and the privacy check)
GROUPS: dict[str, list[str]] = {
    "lifecycle": ["init.*", "session.*", "close.*", "delete.*", "cancel-request.*"],
    "batches": ["batch.*"],
    "resume-withdraw-reuse": ["resume.*", "withdraw.*", "reuse.*"],
    "keys": ["key.valid", "key.null-absent", "key.case-sensitive", "trace.T1-*"],
    "invalid-keys": ["key.invalid.*"],
    "traces-2-3": ["trace.T2-*", "trace.T3-*"],
    "traces-4-7": ["trace.T4-*", "trace.T5-*", "trace.T6-*", "trace.T7-*"],
}


def select(group: str) -> list[str]:
    """The `select` patterns of one group: its checks, then the privacy check."""
    return [*GROUPS[group], PRIVACY]


def group_ids(group: str) -> list[str]:
    """The requirement ids a run of `select(group)` reports, in the suite's order."""
    return [c.id for c in checks_for(select(group))]


def ungrouped_or_twice() -> list[str]:
    """Ids (other than the privacy check) in no group or in more than one: should be none."""
    counts = {c.id: 0 for c in CHECKS if c.id != PRIVACY}
    for patterns in GROUPS.values():
        for check in checks_for(patterns):
            counts[check.id] = counts.get(check.id, 0) + 1
    return sorted(id for id, n in counts.items() if n != 1)
