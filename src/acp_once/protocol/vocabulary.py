"""The known values of ACP's open string sets, as types a type checker holds you to.

The schema leaves these fields open (`kind: "read" | ... | str`) so that the protocol can
grow, and reserves names that start with `_` for implementations' own extensions. Typed as
plain `str`, a misspelling (`kind="raed"`, `return "end_trun"`) goes out on the wire. Here each
set is a `Literal` of its known values, joined with `Extension`, a `str` that starts with `_`,
made by `extension()`:

    async def run_turn(self, turn: Turn, ctx: TurnContext) -> StopReason:
        tool = await ctx.start_tool_call("Read", kind="read")     # "raed": mypy error
        ...
        return "end_turn"                                       # "end_trun": mypy error
        return extension("_rate_limited")                       # your own reason

`check_open_value` is the same rule at run time (strict mode applies it to every update).
"""

from __future__ import annotations

from typing import Final, Literal, NewType, get_args

__all__ = [
    "KNOWN_VALUES",
    "Extension",
    "NoticeSeverity",
    "PlanEntryPriority",
    "PlanEntryStatus",
    "StopReason",
    "ToolCallStatus",
    "ToolKind",
    "check_open_value",
    "extension",
]

Extension = NewType("Extension", str)
"""A value of an open set that is not one of its known values: it starts with `_`."""

StopReason = Literal["end_turn", "max_tokens", "max_turn_requests", "refusal", "cancelled", "error"]
"""Why a turn ended (an idle `state_update`'s `stopReason`), or an `Extension`."""

ToolKind = Literal[
    "read", "edit", "delete", "move", "search", "execute", "think", "fetch", "switch_mode", "other"
]
"""What a tool call does (its `kind`), or an `Extension`."""

ToolCallStatus = Literal["pending", "in_progress", "paused", "completed", "failed", "cancelled"]
"""Where a tool call is (its `status`), or an `Extension`."""

PlanEntryStatus = Literal["pending", "in_progress", "completed", "cancelled"]
"""Where a plan entry is (its `status`), or an `Extension`."""

PlanEntryPriority = Literal["high", "medium", "low"]
"""How much a plan entry matters (its `priority`), or an `Extension`."""

NoticeSeverity = Literal["info", "warning", "error"]
"""How a notice is shown (its `severity`), or an `Extension`."""

KNOWN_VALUES: Final[dict[str, frozenset[str]]] = {
    "stopReason": frozenset(get_args(StopReason)),
    "kind": frozenset(get_args(ToolKind)),
    "status": frozenset(get_args(ToolCallStatus)),
    "planStatus": frozenset(get_args(PlanEntryStatus)),
    "priority": frozenset(get_args(PlanEntryPriority)),
    "severity": frozenset(get_args(NoticeSeverity)),
}
"""Per open set (named by its wire field; plan entries' status as `planStatus`), its known
values."""


def extension(value: str) -> Extension:
    """`value` as an extension of an open set (`"_my_reason"`).

    Raises:
        ValueError: `value` does not start with `_` (a known value needs no wrapping; anything
            else is a misspelling or a name the protocol may take later).
    """
    if not value.startswith("_") or len(value) < 2:
        raise ValueError(f"an extension value starts with '_' and names something: {value!r}")
    return Extension(value)


def check_open_value(field: str, value: object) -> None:
    """Accept `value` for the open set `field` (a key of `KNOWN_VALUES`) when it is one of the
    known values or an extension (`_` then a name).

    Raises:
        ValueError: anything else; the message names the field and the known values.
    """
    known = KNOWN_VALUES[field]
    if isinstance(value, str) and (value in known or (value.startswith("_") and len(value) > 1)):
        return
    shown = "status" if field == "planStatus" else field
    raise ValueError(
        f"{shown} {value!r} is not one of {', '.join(sorted(known))} (an extension starts with _)"
    )
