"""Retry classes of every ACP v2 method, as data (v2 Idempotency Keys RFD, "Method audit").

A sender that never saw the response to a request cannot tell whether the receiver acted on it.
The RFD gives every method a retry class that says what sending it again does, and so whether a
sender may do that on its own. `RETRY_TABLE` records the class of every method the vendored
schemas define; `tests/protocol/test_retry_classes.py` fails when the schema gains a method the
table does not classify, so every future method has to state its class.

This module is pure data and decisions: it does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "RETRY_TABLE",
    "Direction",
    "MessageKind",
    "MethodRetry",
    "RetryClass",
    "lookup",
    "may_resend",
    "render_markdown_table",
    "retry_class",
]


class RetryClass(StrEnum):
    """What sending a message again does (the RFD's four classes, plus two special cases)."""

    IDEMPOTENT = "idempotent"
    """Sending it again has no effect beyond the first; the response reports current state."""
    KEYED = "keyed"
    """Each request acts again; only a retry with the same `idempotencyKey` is safe."""
    DUPLICATING = "duplicating"
    """Each request creates something new; an extra one is left unused and does little harm."""
    NOT_RETRIED = "not_retried"
    """Never sent again: recover through `session/resume` or a new connection instead."""
    AS_CARRIED = "as_carried"
    """A wrapper (`proxy/initialize`, `proxy/successor`): the carried message's class applies."""
    OUT_OF_SCOPE = "out_of_scope"
    """`mcp/message`: what a repeat does is for MCP to define, and MCP defines nothing yet."""


class MessageKind(StrEnum):
    """Whether a method is used as a request (answered) or a notification (never answered)."""

    REQUEST = "request"
    NOTIFICATION = "notification"


class Direction(StrEnum):
    """Which way a message travels."""

    CLIENT_TO_AGENT = "client_to_agent"
    """Sent by the Client, handled by the Agent (schema `x-side: agent`)."""
    AGENT_TO_CLIENT = "agent_to_client"
    """Sent by the Agent, handled by the Client (schema `x-side: client`)."""
    PROXY = "proxy"
    """Between a conductor and a proxy (schema `x-side: proxy`)."""
    BOTH = "both"
    """Sent by either side, such as `$/cancel_request` (schema `x-side: protocol`)."""


@dataclass(frozen=True, slots=True)
class MethodRetry:
    """The retry class of one method used as one kind of message in one direction."""

    method: str
    kind: MessageKind
    direction: Direction
    stable: bool
    """True when `schema.json` defines it; False when only `schema.unstable.json` does."""
    retry_class: RetryClass
    reason: str
    """What sending it again does, in one sentence (the RFD audit's "Sending it again")."""


_C2A = Direction.CLIENT_TO_AGENT
_A2C = Direction.AGENT_TO_CLIENT
_REQ = MessageKind.REQUEST
_NOTE = MessageKind.NOTIFICATION
_STABLE = True  # in schema.json
_UNSTABLE = False  # only in schema.unstable.json


RETRY_TABLE: tuple[MethodRetry, ...] = (
    # Client to Agent requests.
    MethodRetry(
        "session/prompt",
        _REQ,
        _C2A,
        _STABLE,
        RetryClass.KEYED,
        "A repeat without a key inserts a second user message and may run the work twice.",
    ),
    MethodRetry(
        "session/new",
        _REQ,
        _C2A,
        _STABLE,
        RetryClass.DUPLICATING,
        "A repeat creates another session; the one whose ID was lost is simply never used.",
    ),
    MethodRetry(
        "session/fork",
        _REQ,
        _C2A,
        _UNSTABLE,
        RetryClass.DUPLICATING,
        "A repeat makes another copy of the source session, which session/list can find and "
        "session/delete can remove.",
    ),
    MethodRetry(
        "session/resume",
        _REQ,
        _C2A,
        _STABLE,
        RetryClass.IDEMPOTENT,
        "A repeat synchronizes the session again with the same MCP servers and roots.",
    ),
    MethodRetry(
        "session/close",
        _REQ,
        _C2A,
        _STABLE,
        RetryClass.IDEMPOTENT,
        "Closing is already defined as idempotent, so a repeat succeeds.",
    ),
    MethodRetry(
        "session/delete",
        _REQ,
        _C2A,
        _STABLE,
        RetryClass.IDEMPOTENT,
        "Deleting a session that is already gone succeeds.",
    ),
    MethodRetry(
        "session/list",
        _REQ,
        _C2A,
        _STABLE,
        RetryClass.IDEMPOTENT,
        "Read-only.",
    ),
    MethodRetry(
        "session/set_config_option",
        _REQ,
        _C2A,
        _STABLE,
        RetryClass.IDEMPOTENT,
        "Sets the same value again and returns all options; retry before changing that option "
        "again.",
    ),
    MethodRetry(
        "tool_call/cancel",
        _REQ,
        _C2A,
        _STABLE,
        RetryClass.IDEMPOTENT,
        "No second effect; once the tool call is final a repeat gets -32602 and "
        "tool_call_update tells what happened.",
    ),
    MethodRetry(
        "terminal/cancel",
        _REQ,
        _C2A,
        _STABLE,
        RetryClass.IDEMPOTENT,
        "No second effect; once the terminal has exited a repeat gets -32602 and "
        "terminal_update tells what happened.",
    ),
    MethodRetry(
        "auth/login",
        _REQ,
        _C2A,
        _STABLE,
        RetryClass.IDEMPOTENT,
        "Ends in the same authenticated state, though the user may see a second login flow.",
    ),
    MethodRetry(
        "auth/logout",
        _REQ,
        _C2A,
        _STABLE,
        RetryClass.IDEMPOTENT,
        "Ends an authenticated state that is already over.",
    ),
    MethodRetry(
        "initialize",
        _REQ,
        _C2A,
        _STABLE,
        RetryClass.NOT_RETRIED,
        "Only allowed before the first other request (the latest one wins), -32600 after that; "
        "recover with a new connection.",
    ),
    MethodRetry(
        "session/archive",
        _REQ,
        _C2A,
        _UNSTABLE,
        RetryClass.IDEMPOTENT,
        "Archiving is defined as idempotent, so a repeat succeeds.",
    ),
    MethodRetry(
        "session/unarchive",
        _REQ,
        _C2A,
        _UNSTABLE,
        RetryClass.IDEMPOTENT,
        "Unarchiving is defined as idempotent, so a repeat succeeds.",
    ),
    MethodRetry(
        "session/set_title",
        _REQ,
        _C2A,
        _UNSTABLE,
        RetryClass.IDEMPOTENT,
        "Sets the same title again.",
    ),
    MethodRetry(
        "providers/set",
        _REQ,
        _C2A,
        _UNSTABLE,
        RetryClass.IDEMPOTENT,
        "Sets the same provider configuration again.",
    ),
    MethodRetry(
        "providers/disable",
        _REQ,
        _C2A,
        _UNSTABLE,
        RetryClass.IDEMPOTENT,
        "Disables a provider that is already disabled.",
    ),
    MethodRetry(
        "session/status",
        _REQ,
        _C2A,
        _UNSTABLE,
        RetryClass.IDEMPOTENT,
        "Read-only.",
    ),
    MethodRetry(
        "providers/list",
        _REQ,
        _C2A,
        _UNSTABLE,
        RetryClass.IDEMPOTENT,
        "Read-only.",
    ),
    MethodRetry(
        "auth/status",
        _REQ,
        _C2A,
        _UNSTABLE,
        RetryClass.IDEMPOTENT,
        "Read-only.",
    ),
    # Client to Agent notifications.
    MethodRetry(
        "session/cancel",
        _NOTE,
        _C2A,
        _STABLE,
        RetryClass.NOT_RETRIED,
        "A late copy arriving after new work started would cancel that work.",
    ),
    MethodRetry(
        "mcp/message",
        _NOTE,
        _C2A,
        _UNSTABLE,
        RetryClass.OUT_OF_SCOPE,
        "Depends on the MCP message it carries, and MCP defines no retry rules.",
    ),
    # Agent to Client requests.
    MethodRetry(
        "session/request_permission",
        _REQ,
        _A2C,
        _STABLE,
        RetryClass.IDEMPOTENT,
        "The Client asks the user again; the Agent still decides what the answer allows.",
    ),
    MethodRetry(
        "elicitation/create",
        _REQ,
        _A2C,
        _STABLE,
        RetryClass.IDEMPOTENT,
        "The Client asks the user again; a URL-mode elicitationId links the completion.",
    ),
    MethodRetry(
        "mcp/message",
        _REQ,
        _A2C,
        _UNSTABLE,
        RetryClass.OUT_OF_SCOPE,
        "Depends on the MCP message it carries, and MCP defines no retry rules.",
    ),
    # Agent to Client notifications.
    MethodRetry(
        "session/update",
        _NOTE,
        _A2C,
        _STABLE,
        RetryClass.NOT_RETRIED,
        "Chunks append, so a resent chunk duplicates content; a Client that missed updates "
        "resumes the session.",
    ),
    MethodRetry(
        "elicitation/complete",
        _NOTE,
        _A2C,
        _STABLE,
        RetryClass.NOT_RETRIED,
        "Reports the same state again; notifications are not resent.",
    ),
    MethodRetry(
        "auth/status_update",
        _NOTE,
        _A2C,
        _UNSTABLE,
        RetryClass.NOT_RETRIED,
        "Reports the same state again; notifications are not resent.",
    ),
    # Either side.
    MethodRetry(
        "$/cancel_request",
        _NOTE,
        Direction.BOTH,
        _STABLE,
        RetryClass.NOT_RETRIED,
        "The receiver ignores a request ID that is unknown or already answered.",
    ),
    # Conductor and proxy.
    MethodRetry(
        "proxy/initialize",
        _REQ,
        Direction.PROXY,
        _UNSTABLE,
        RetryClass.AS_CARRIED,
        "Carries the initialize exchange to the proxy, so the carried message's class applies.",
    ),
    MethodRetry(
        "proxy/successor",
        _REQ,
        Direction.PROXY,
        _UNSTABLE,
        RetryClass.AS_CARRIED,
        "Wraps another request, whose class applies and whose idempotencyKey passes unchanged.",
    ),
    MethodRetry(
        "proxy/successor",
        _NOTE,
        Direction.PROXY,
        _UNSTABLE,
        RetryClass.AS_CARRIED,
        "Wraps another notification, whose class applies.",
    ),
)
"""Every (method, kind, direction) the vendored v2 schemas define, with its retry class.

The RFD audit also names `session/options` (unstable, read-only), which the vendored schema does
not define; it is absent here and so treated as unknown until the schema adds it.
"""


def _find(
    table: tuple[MethodRetry, ...],
    method: str,
    kind: MessageKind,
    direction: Direction | None,
) -> MethodRetry | None:
    matches = [
        entry
        for entry in table
        if entry.method == method
        and entry.kind == kind
        and (
            direction is None
            or entry.direction == direction
            # A message either side sends is also sent in each single direction.
            or (
                entry.direction == Direction.BOTH
                and direction in (Direction.CLIENT_TO_AGENT, Direction.AGENT_TO_CLIENT)
            )
        )
    ]
    if len(matches) > 1:
        raise ValueError(f"{kind} {method!r} is defined in several directions; pass direction")
    return matches[0] if matches else None


def lookup(
    method: str,
    kind: MessageKind = MessageKind.REQUEST,
    direction: Direction | None = None,
) -> MethodRetry | None:
    """Return the table entry for `method` used as `kind`, or None when the table has none.

    With `direction` None any direction matches. An entry for `Direction.BOTH` also matches a
    query for `CLIENT_TO_AGENT` or `AGENT_TO_CLIENT`.

    Raises:
        ValueError: `direction` is None and several directions define the method as `kind`
            (no method does today; the tests keep it that way or make callers choose).
    """
    return _find(RETRY_TABLE, method, kind, direction)


def retry_class(
    method: str,
    kind: MessageKind = MessageKind.REQUEST,
    direction: Direction | None = None,
) -> RetryClass:
    """Return the retry class of `method`; an unknown method is `RetryClass.NOT_RETRIED`.

    Unknown methods include custom `_`-prefixed extension methods and methods of a newer schema.
    A sender cannot know what a repeat of such a method does, so the only safe answer is not to
    send it again.

    Raises:
        ValueError: as `lookup`, when `direction` is None and the method is ambiguous.
    """
    entry = lookup(method, kind, direction)
    return RetryClass.NOT_RETRIED if entry is None else entry.retry_class


def may_resend(method: str, *, has_key: bool, allow_duplicating: bool = False) -> bool:
    """Decide whether a Client may send a request again after losing its outcome.

    `method` is a Client to Agent request whose response never arrived. Idempotent requests may
    be resent; a keyed request only when it carries an `idempotencyKey` (`has_key`), since
    without one a resend is a new operation; a duplicating request only when the caller accepts
    a possible unused extra (`allow_duplicating`). Everything else is never resent: not-retried
    and wrapper methods, `mcp/message`, methods only defined as notifications or in another
    direction (notifications have no response to lose), and unknown methods. Raises no
    errors: the table holds at most one entry per method and kind, which a test checks.
    """
    entry = _find(RETRY_TABLE, method, MessageKind.REQUEST, Direction.CLIENT_TO_AGENT)
    if entry is None:
        return False
    match entry.retry_class:
        case RetryClass.IDEMPOTENT:
            return True
        case RetryClass.KEYED:
            return has_key
        case RetryClass.DUPLICATING:
            return allow_duplicating
        case _:
            return False


_DIRECTION_LABELS: dict[Direction, str] = {
    Direction.CLIENT_TO_AGENT: "Client to Agent",
    Direction.AGENT_TO_CLIENT: "Agent to Client",
    Direction.PROXY: "Conductor and proxy",
    Direction.BOTH: "Either side",
}

_CLASS_LABELS: dict[RetryClass, str] = {
    RetryClass.IDEMPOTENT: "Idempotent",
    RetryClass.KEYED: "Keyed",
    RetryClass.DUPLICATING: "Duplicating",
    RetryClass.NOT_RETRIED: "Not retried",
    RetryClass.AS_CARRIED: "As the carried message",
    RetryClass.OUT_OF_SCOPE: "Out of scope (MCP)",
}

# Directions sort in declaration order (Client to Agent first), not alphabetically.
_DIRECTION_ORDER = {direction: index for index, direction in enumerate(Direction)}
_KIND_ORDER = {kind: index for index, kind in enumerate(MessageKind)}


def _cell(text: str) -> str:
    # A `|` inside a cell would end the cell early.
    return text.replace("|", "\\|")


def render_markdown_table() -> str:
    """Return `RETRY_TABLE` as a Markdown table, ending in a newline.

    Columns: method, kind, direction, stable/unstable, class, why. Rows are sorted by direction
    (in `Direction` declaration order), then method, then kind (requests first).
    """
    rows = sorted(
        RETRY_TABLE,
        key=lambda e: (_DIRECTION_ORDER[e.direction], e.method, _KIND_ORDER[e.kind]),
    )
    lines = [
        "| Method | Kind | Direction | Schema | Class | Why |",
        "| - | - | - | - | - | - |",
    ]
    lines.extend(
        "| "
        + " | ".join(
            (
                f"`{_cell(e.method)}`",
                e.kind.value,
                _DIRECTION_LABELS[e.direction],
                "stable" if e.stable else "unstable",
                _CLASS_LABELS[e.retry_class],
                _cell(e.reason),
            )
        )
        + " |"
        for e in rows
    )
    return "\n".join(lines) + "\n"
