"""The cluster's NOTIFY format, defined here once: the channel, each kind of payload, built
in Python or (a queued prompt's outcome, inside the insert that settles it) by PostgreSQL
from the same field names, and how a received payload is read (`read`).

Notifications go on one channel per schema (`channel_for(schema)`), JSON payloads:

* `{"k": "o", "r": row, "st": state, "m": message_id, "p": same_prompt}` a queued prompt's
  outcome (`outcome`, `outcome_sql`);
* `{"k": "w", "s": session, "o": owner}` wake the owner: a prompt was queued (`wake`);
* `{"k": "u", "s": session, "n": instance, "u": update | "e": event_id}` a session update
  (`update`; `e` names a `session_events` row when the update is over `NOTIFY_LIMIT`);
* `{"k": "c", "s": session, "n": instance}` cancel the session's work (`cancel`);
* `{"k": "j", "n": instance}` an instance joined (or came back after a stall or a lost
  listener): the others publish their updates from now on (`join`);
* `{"k": "a", "n": instance, "t": joined}` `instance` saw the join of `joined` (`ack`).

Idempotency keys never appear in a payload (nor in a log line or an error message).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Final

import orjson

__all__ = [
    "NOTIFY_LIMIT",
    "Ack",
    "Cancel",
    "Join",
    "Note",
    "Outcome",
    "Update",
    "Wake",
    "ack",
    "cancel",
    "channel_for",
    "join",
    "outcome",
    "outcome_sql",
    "read",
    "update",
    "wake",
]

NOTIFY_LIMIT: Final = 7000
"""Largest NOTIFY payload we send (PostgreSQL's limit is 8000 bytes); larger updates go
through `session_events`."""

_OUTCOME_FIELDS: Final = ("r", "st", "m", "p")
"""A queued prompt's outcome after `"k": "o"`: row, state, message id, same prompt."""


def channel_for(schema: str) -> str:
    """The NOTIFY channel of the nodes sharing `schema` (an identifier under 63 bytes)."""
    return "acp_once_" + hashlib.sha256(schema.encode()).hexdigest()[:20]


def _payload(**fields: Any) -> str:
    return orjson.dumps(fields).decode()


def outcome(row: int, state: str, message_id: str | None, same_prompt: bool | None) -> str:
    """A queued prompt's outcome."""
    values = (row, state, message_id, same_prompt)
    return _payload(k="o", **dict(zip(_OUTCOME_FIELDS, values, strict=True)))


def outcome_sql(row: str, state: str, message_id: str, same_prompt: str) -> str:
    """The payload of `outcome` as a SQL expression (text) over the four SQL expressions
    given, for a statement that settles the row and notifies in one."""
    values = (row, state, message_id, same_prompt)
    pairs = ", ".join(
        f"'{name}', {value}" for name, value in zip(_OUTCOME_FIELDS, values, strict=True)
    )
    return f"json_build_object('k', 'o', {pairs})::text"


def wake(session_id: str, owner: str | None) -> str:
    """Wake the lease owner of a session: a prompt was queued behind its work."""
    return _payload(k="w", s=session_id, o=owner)


def update(
    session_id: str, instance: str, value: dict[str, Any] | None, event: int | None = None
) -> str:
    """A session update sent by `instance`: the update itself, or the id of the
    `session_events` row holding it (`event`, when the update is too large)."""
    if event is not None:
        return _payload(k="u", s=session_id, n=instance, e=event)
    return _payload(k="u", s=session_id, n=instance, u=value)


def cancel(session_id: str, instance: str) -> str:
    """Ask the owner of a session to cancel its work (session/cancel on `instance`)."""
    return _payload(k="c", s=session_id, n=instance)


def join(instance: str) -> str:
    """`instance` listens and wants the other instances' session updates."""
    return _payload(k="j", n=instance)


def ack(instance: str, joined: str) -> str:
    """`instance` saw the join of `joined` (and publishes its updates from then on)."""
    return _payload(k="a", n=instance, t=joined)


@dataclass(frozen=True, slots=True)
class Outcome:
    """Read from `outcome`: what became of a queued prompt."""

    row: int
    state: str
    message_id: str | None
    same_prompt: bool | None


@dataclass(frozen=True, slots=True)
class Wake:
    """Read from `wake`: a prompt was queued behind the work of `owner`."""

    session_id: str
    owner: str | None


@dataclass(frozen=True, slots=True)
class Update:
    """Read from `update`: the update itself, or the `session_events` row holding it."""

    session_id: str
    instance: str | None
    update: dict[str, Any] | None
    event: int | None


@dataclass(frozen=True, slots=True)
class Cancel:
    """Read from `cancel`."""

    session_id: str
    instance: str | None


@dataclass(frozen=True, slots=True)
class Join:
    """Read from `join`."""

    instance: str


@dataclass(frozen=True, slots=True)
class Ack:
    """Read from `ack`: `instance` saw the join of `joined`."""

    instance: str
    joined: str


Note = Outcome | Wake | Update | Cancel | Join | Ack


def read(payload: str) -> Note | None:
    """A received payload, or None when it is not one of ours (or malformed)."""
    try:
        note = orjson.loads(payload)
        kind = note.get("k")
        if kind == "o":
            return Outcome(int(note["r"]), str(note["st"]), note.get("m"), note.get("p"))
        if kind == "u":
            value = note.get("u")
            if isinstance(value, dict):
                return Update(str(note["s"]), note.get("n"), value, None)
            if value is None and "e" in note:
                return Update(str(note["s"]), note.get("n"), None, int(note["e"]))
            return None
        if kind == "w":
            return Wake(str(note["s"]), note.get("o"))
        if kind == "c":
            return Cancel(str(note["s"]), note.get("n"))
        if kind == "j":
            return Join(str(note["n"]))
        if kind == "a":
            return Ack(str(note["n"]), str(note["t"]))
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
        return None
    return None
