"""Retry classes (`acp_once.protocol.retry`) against the vendored schemas and the RFD audit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from acp_once.protocol import retry
from acp_once.protocol.retry import (
    RETRY_TABLE,
    Direction,
    MessageKind,
    MethodRetry,
    RetryClass,
    lookup,
    may_resend,
    render_markdown_table,
    retry_class,
)

ROOT = Path(__file__).resolve().parents[2]
STABLE_SCHEMA = ROOT / "schema" / "schema.json"
UNSTABLE_SCHEMA = ROOT / "schema" / "schema.unstable.json"
RENDER_SCRIPT = ROOT / "scripts" / "render_retry_table.py"

# The schema's `x-side` names the side that handles the message, not the one that sends it.
SIDE_TO_DIRECTION = {
    "agent": Direction.CLIENT_TO_AGENT,
    "client": Direction.AGENT_TO_CLIENT,
    "protocol": Direction.BOTH,
    "proxy": Direction.PROXY,
}

Triple = tuple[str, MessageKind, Direction]


def _defs(path: Path) -> dict[str, Any]:
    schema = json.loads(path.read_text(encoding="utf-8"))
    defs: dict[str, Any] = schema["$defs"]
    return defs


def schema_methods(path: Path) -> dict[Triple, str]:
    """Every (method, kind, direction) a schema defines, mapped to one definition naming it."""
    found: dict[Triple, str] = {}
    for name, definition in _defs(path).items():
        if "x-method" not in definition:
            continue
        if name.endswith("Response"):
            continue
        if name.endswith("Request"):
            kind = MessageKind.REQUEST
        elif name.endswith("Notification"):
            kind = MessageKind.NOTIFICATION
        else:
            pytest.fail(f"{path.name}: {name} has x-method but is no Request/Notification/Response")
        side = definition.get("x-side")
        if side not in SIDE_TO_DIRECTION:
            pytest.fail(f"{path.name}: {name} has unknown x-side {side!r}: classify the new side")
        found[(definition["x-method"], kind, SIDE_TO_DIRECTION[side])] = name
    return found


STABLE = schema_methods(STABLE_SCHEMA)
ALL = {**STABLE, **schema_methods(UNSTABLE_SCHEMA)}


def _triple(entry: MethodRetry) -> Triple:
    return (entry.method, entry.kind, entry.direction)


# (a) The table covers the schemas exactly.


def test_schemas_define_methods_at_all() -> None:
    # Guards the enumeration itself: a schema layout change must not make the check vacuous.
    assert ("session/prompt", MessageKind.REQUEST, Direction.CLIENT_TO_AGENT) in STABLE
    assert len(ALL) > len(STABLE) > 10


def test_every_schema_method_has_a_retry_class() -> None:
    table = {_triple(entry) for entry in RETRY_TABLE}
    missing = sorted(
        f"{method} ({kind}, {direction}, from {ALL[(method, kind, direction)]})"
        for method, kind, direction in ALL.keys() - table
    )
    assert not missing, "RETRY_TABLE lacks a retry class for: " + "; ".join(missing)


def test_table_has_no_method_the_schemas_do_not_define() -> None:
    extra = sorted(
        f"{e.method} ({e.kind}, {e.direction})" for e in RETRY_TABLE if _triple(e) not in ALL
    )
    assert not extra, "RETRY_TABLE classifies methods no vendored schema defines: " + "; ".join(
        extra
    )


def test_table_entries_are_unique() -> None:
    triples = [_triple(entry) for entry in RETRY_TABLE]
    assert len(triples) == len(set(triples))


def test_no_method_kind_is_defined_in_two_directions() -> None:
    # `lookup(..., direction=None)` relies on this; a schema change that breaks it must
    # make callers choose a direction.
    pairs = [(entry.method, entry.kind) for entry in RETRY_TABLE]
    assert len(pairs) == len(set(pairs))


def test_x_side_agrees_with_the_schema_message_unions() -> None:
    # Cross-checks SIDE_TO_DIRECTION: the `ClientRequest` union lists what the Client sends,
    # so its members must be the definitions marked `x-side: agent`, and so on.
    defs = _defs(UNSTABLE_SCHEMA)
    unions = {
        ("ClientRequest", MessageKind.REQUEST, Direction.CLIENT_TO_AGENT),
        ("ClientNotification", MessageKind.NOTIFICATION, Direction.CLIENT_TO_AGENT),
        ("AgentRequest", MessageKind.REQUEST, Direction.AGENT_TO_CLIENT),
        ("AgentNotification", MessageKind.NOTIFICATION, Direction.AGENT_TO_CLIENT),
        ("ProxyRequest", MessageKind.REQUEST, Direction.PROXY),
        ("ProxyNotification", MessageKind.NOTIFICATION, Direction.PROXY),
    }
    for union, kind, direction in unions:
        text = json.dumps(defs[union])
        members = {
            name
            for name, definition in defs.items()
            if "x-method" in definition and f'"#/$defs/{name}"' in text
        }
        expected = {name for (_, k, d), name in ALL.items() if k == kind and d == direction}
        assert members == expected, union


# (b) Stable flags.


@pytest.mark.parametrize("entry", RETRY_TABLE, ids=lambda e: f"{e.method}-{e.kind}")
def test_stable_flag_matches_schema_json(entry: MethodRetry) -> None:
    assert entry.stable == (_triple(entry) in STABLE)


# (c) The RFD audit's classes.


@pytest.mark.parametrize(
    ("method", "kind", "direction", "expected"),
    [
        ("session/prompt", MessageKind.REQUEST, Direction.CLIENT_TO_AGENT, RetryClass.KEYED),
        ("session/new", MessageKind.REQUEST, Direction.CLIENT_TO_AGENT, RetryClass.DUPLICATING),
        ("session/fork", MessageKind.REQUEST, Direction.CLIENT_TO_AGENT, RetryClass.DUPLICATING),
        ("session/resume", MessageKind.REQUEST, Direction.CLIENT_TO_AGENT, RetryClass.IDEMPOTENT),
        ("session/close", MessageKind.REQUEST, Direction.CLIENT_TO_AGENT, RetryClass.IDEMPOTENT),
        ("session/delete", MessageKind.REQUEST, Direction.CLIENT_TO_AGENT, RetryClass.IDEMPOTENT),
        ("session/list", MessageKind.REQUEST, Direction.CLIENT_TO_AGENT, RetryClass.IDEMPOTENT),
        ("tool_call/cancel", MessageKind.REQUEST, Direction.CLIENT_TO_AGENT, RetryClass.IDEMPOTENT),
        ("auth/status", MessageKind.REQUEST, Direction.CLIENT_TO_AGENT, RetryClass.IDEMPOTENT),
        ("initialize", MessageKind.REQUEST, Direction.CLIENT_TO_AGENT, RetryClass.NOT_RETRIED),
        (
            "session/request_permission",
            MessageKind.REQUEST,
            Direction.AGENT_TO_CLIENT,
            RetryClass.IDEMPOTENT,
        ),
        (
            "elicitation/create",
            MessageKind.REQUEST,
            Direction.AGENT_TO_CLIENT,
            RetryClass.IDEMPOTENT,
        ),
        ("mcp/message", MessageKind.REQUEST, Direction.AGENT_TO_CLIENT, RetryClass.OUT_OF_SCOPE),
        (
            "mcp/message",
            MessageKind.NOTIFICATION,
            Direction.CLIENT_TO_AGENT,
            RetryClass.OUT_OF_SCOPE,
        ),
        (
            "session/cancel",
            MessageKind.NOTIFICATION,
            Direction.CLIENT_TO_AGENT,
            RetryClass.NOT_RETRIED,
        ),
        ("$/cancel_request", MessageKind.NOTIFICATION, Direction.BOTH, RetryClass.NOT_RETRIED),
        (
            "session/update",
            MessageKind.NOTIFICATION,
            Direction.AGENT_TO_CLIENT,
            RetryClass.NOT_RETRIED,
        ),
        (
            "elicitation/complete",
            MessageKind.NOTIFICATION,
            Direction.AGENT_TO_CLIENT,
            RetryClass.NOT_RETRIED,
        ),
        (
            "auth/status_update",
            MessageKind.NOTIFICATION,
            Direction.AGENT_TO_CLIENT,
            RetryClass.NOT_RETRIED,
        ),
        ("proxy/initialize", MessageKind.REQUEST, Direction.PROXY, RetryClass.AS_CARRIED),
        ("proxy/successor", MessageKind.REQUEST, Direction.PROXY, RetryClass.AS_CARRIED),
        ("proxy/successor", MessageKind.NOTIFICATION, Direction.PROXY, RetryClass.AS_CARRIED),
    ],
)
def test_rfd_audit_classes(
    method: str, kind: MessageKind, direction: Direction, expected: RetryClass
) -> None:
    entry = lookup(method, kind, direction)
    assert entry is not None
    assert entry.retry_class is expected
    assert retry_class(method, kind, direction) is expected
    assert retry_class(method, kind) is expected


def test_only_prompt_is_keyed_and_only_new_and_fork_duplicate() -> None:
    by_class = {
        cls: {e.method for e in RETRY_TABLE if e.retry_class is cls}
        for cls in (RetryClass.KEYED, RetryClass.DUPLICATING)
    }
    assert by_class[RetryClass.KEYED] == {"session/prompt"}
    assert by_class[RetryClass.DUPLICATING] == {"session/new", "session/fork"}


def test_every_reason_is_one_short_sentence() -> None:
    for entry in RETRY_TABLE:
        assert entry.reason.endswith("."), entry.method
        assert 0 < len(entry.reason) <= 160, entry.method
        assert "\n" not in entry.reason, entry.method


def test_lookup_distinguishes_kind_and_direction() -> None:
    # `mcp/message` is an Agent to Client request and a Client to Agent notification only.
    assert lookup("mcp/message", MessageKind.REQUEST, Direction.CLIENT_TO_AGENT) is None
    assert lookup("mcp/message", MessageKind.NOTIFICATION, Direction.AGENT_TO_CLIENT) is None
    request = lookup("mcp/message")
    assert request is not None
    assert request.direction is Direction.AGENT_TO_CLIENT
    assert lookup("session/cancel") is None
    assert lookup("session/prompt", MessageKind.NOTIFICATION) is None
    assert lookup("session/prompt", MessageKind.REQUEST, Direction.AGENT_TO_CLIENT) is None


@pytest.mark.parametrize("direction", [Direction.CLIENT_TO_AGENT, Direction.AGENT_TO_CLIENT])
def test_both_direction_entries_match_either_single_direction(direction: Direction) -> None:
    entry = lookup("$/cancel_request", MessageKind.NOTIFICATION, direction)
    assert entry is not None
    assert entry.direction is Direction.BOTH
    assert lookup("$/cancel_request", MessageKind.NOTIFICATION, Direction.PROXY) is None


def test_lookup_refuses_to_guess_between_directions() -> None:
    def entry(direction: Direction) -> MethodRetry:
        return MethodRetry("x/y", MessageKind.REQUEST, direction, True, RetryClass.IDEMPOTENT, ".")

    table = (entry(Direction.CLIENT_TO_AGENT), entry(Direction.AGENT_TO_CLIENT))
    with pytest.raises(ValueError, match="x/y"):
        retry._find(table, "x/y", MessageKind.REQUEST, None)
    assert retry._find(table, "x/y", MessageKind.REQUEST, Direction.AGENT_TO_CLIENT) is table[1]


# (d) Automatic resend decisions.

CLIENT_REQUESTS = [
    e
    for e in RETRY_TABLE
    if e.kind is MessageKind.REQUEST and e.direction is Direction.CLIENT_TO_AGENT
]


@pytest.mark.parametrize("entry", CLIENT_REQUESTS, ids=lambda e: e.method)
@pytest.mark.parametrize("has_key", [False, True])
@pytest.mark.parametrize("allow_duplicating", [False, True])
def test_may_resend_client_requests(
    entry: MethodRetry, has_key: bool, allow_duplicating: bool
) -> None:
    expected = {
        RetryClass.IDEMPOTENT: True,
        RetryClass.KEYED: has_key,
        RetryClass.DUPLICATING: allow_duplicating,
    }.get(entry.retry_class, False)
    decision = may_resend(entry.method, has_key=has_key, allow_duplicating=allow_duplicating)
    assert decision is expected


def test_may_resend_spot_checks() -> None:
    assert may_resend("session/prompt", has_key=True)
    assert not may_resend("session/prompt", has_key=False)
    assert not may_resend("session/new", has_key=True)
    assert may_resend("session/new", has_key=False, allow_duplicating=True)
    assert may_resend("session/list", has_key=False)
    assert not may_resend("initialize", has_key=True, allow_duplicating=True)


@pytest.mark.parametrize(
    "entry",
    [e for e in RETRY_TABLE if e not in CLIENT_REQUESTS],
    ids=lambda e: f"{e.method}-{e.kind}-{e.direction}",
)
def test_may_resend_never_resends_what_the_client_does_not_request(entry: MethodRetry) -> None:
    # Notifications have no response to lose; Agent to Client and proxy requests are not the
    # Client's to resend. `session/request_permission` is idempotent yet still refused here.
    assert not may_resend(entry.method, has_key=True, allow_duplicating=True)


# (e) Unknown methods.


@pytest.mark.parametrize(
    "method", ["_acme/frobnicate", "_custom", "session/options", "session/unknown", ""]
)
@pytest.mark.parametrize("kind", list(MessageKind))
def test_unknown_methods_are_not_retried(method: str, kind: MessageKind) -> None:
    assert lookup(method, kind) is None
    assert retry_class(method, kind) is RetryClass.NOT_RETRIED
    for direction in Direction:
        assert retry_class(method, kind, direction) is RetryClass.NOT_RETRIED
    assert not may_resend(method, has_key=True, allow_duplicating=True)


# (f) Rendering and the README script.


def test_render_has_one_row_per_entry_in_order() -> None:
    lines = render_markdown_table().splitlines()
    assert lines[0] == "| Method | Kind | Direction | Schema | Class | Why |"
    rows = lines[2:]
    assert len(rows) == len(RETRY_TABLE)
    cells = [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]
    assert all(len(row) == 6 for row in cells)
    assert cells[0][0] == "`auth/login`"
    assert cells[-1][0] == "`$/cancel_request`"
    prompt = next(row for row in cells if row[0] == "`session/prompt`")
    assert prompt[1:5] == ["request", "Client to Agent", "stable", "Keyed"]
    fork = next(row for row in cells if row[0] == "`session/fork`")
    assert fork[3:5] == ["unstable", "Duplicating"]
    directions = [row[2] for row in cells]
    order = ["Client to Agent", "Agent to Client", "Conductor and proxy", "Either side"]
    assert directions == sorted(directions, key=order.index)
    client_methods = [row[0] for row in cells if row[2] == "Client to Agent"]
    assert client_methods == sorted(client_methods)


def _run_script(readme: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RENDER_SCRIPT), "--readme", str(readme), *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )


def test_render_script_round_trip(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    before = "# acp-once\n\nIntro.\n\n<!-- retry-table:start -->\n"
    after = "<!-- retry-table:end -->\n\nMore text.\n"
    readme.write_text(before + "| stale | table |\n" + after, encoding="utf-8")

    stale = _run_script(readme, "--check")
    assert stale.returncode == 1, stale
    assert "out of date" in stale.stderr
    assert "| stale | table |" in readme.read_text(encoding="utf-8"), "--check must not write"

    written = _run_script(readme)
    assert written.returncode == 0, written
    expected = before + "\n" + render_markdown_table() + "\n" + after
    assert readme.read_text(encoding="utf-8") == expected

    fresh = _run_script(readme, "--check")
    assert fresh.returncode == 0, fresh
    again = _run_script(readme)
    assert again.returncode == 0, again
    assert readme.read_text(encoding="utf-8") == expected


@pytest.mark.parametrize(
    "text",
    [
        "# acp-once\n",
        "<!-- retry-table:start -->\nno end\n",
        "no start\n<!-- retry-table:end -->\n",
        "<!-- retry-table:end -->\n<!-- retry-table:start -->\n",
        "<!-- retry-table:start -->\n<!-- retry-table:start -->\n<!-- retry-table:end -->\n",
    ],
)
@pytest.mark.parametrize("check", [False, True])
def test_render_script_needs_the_markers(tmp_path: Path, text: str, check: bool) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(text, encoding="utf-8")
    result = _run_script(readme, *(["--check"] if check else []))
    assert result.returncode == 2, result
    assert "retry-table" in result.stderr
    assert readme.read_text(encoding="utf-8") == text
