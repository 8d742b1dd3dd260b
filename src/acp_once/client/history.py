"""What the client knows of a session's turns: which user messages it saw inserted, and how
their turns ended, learned from a replay of the session's history and from the live stream.

A prompt whose answer was lost, or that a caller names with its own key, may have been
inserted long before its answer comes (by an earlier run, or on a connection that is gone).
Its turn may have ended meanwhile: no update will ever say so again. `TurnLedger` answers
"has the turn of message M ended, and how?" from what the session reported:

- an idle `state_update` that names its message (`_meta.acpOnce.messageId`, as acp-once
  agents tag each turn's end) ends that message's turn, whatever its position;
- an idle `state_update` without that tag ends every turn seen inserted and not ended yet:
  the last of them with its stop reason, the earlier ones with none (when turns run back to
  back, only the last reports its end);
- the state a `session/resume` reports last (its snapshot): "idle" means every turn of the
  replayed history is over. With `stopReason: "error"` they were interrupted (the agent
  restarted before they finished); without one, their stop reason is not known.

A replay also tells the client what it missed while it was away: the ledger remembers the
message ids it saw live (`seen`), and `take` says when a replayed update is one of them, so
that the client passes on only what follows the last one it saw.

It is pure bookkeeping (no I/O): the client feeds it, and asks it when a message id arrives.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from acp_once.client.turns import SessionUpdate, end_tag, state_report
from acp_once.protocol import schema as s

__all__ = ["MAX_TURNS", "TurnEnd", "TurnLedger"]

MAX_TURNS = 4096
"""Turns whose updates and ends a ledger keeps (the oldest are forgotten first)."""

_MAX_UPDATES = 20_000
"""Replayed updates kept in all, so a long history costs bounded memory."""

MAX_SEEN = 4096
"""Message ids seen live that a ledger remembers."""


@dataclass(frozen=True)
class TurnEnd:
    """How one turn ended: its stop reason (None: not reported) and error object."""

    stop_reason: str | None
    error: dict[str, Any] | None = None


def end_of(report: dict[str, Any]) -> TurnEnd:
    """The `TurnEnd` an idle report carries."""
    reason = report.get("stopReason")
    error = report.get("error")
    return TurnEnd(
        str(reason) if reason is not None else None, error if isinstance(error, dict) else None
    )


@dataclass(eq=False)
class TurnLedger:
    """The turns of one session the client knows of (see the module docstring)."""

    ends: OrderedDict[str, TurnEnd] = field(default_factory=OrderedDict)
    """Message id -> how its turn ended."""
    turns: OrderedDict[str, list[SessionUpdate]] = field(default_factory=OrderedDict)
    """Message id -> its turn's updates from a replay (from its user message on)."""
    open: list[str] = field(default_factory=list)
    """Messages seen inserted whose turn has not ended, in order."""
    _kept: int = 0
    _current: str | None = None  # the message whose replayed updates are being collected
    _held: SessionUpdate | None = None  # a replay's latest state report: the snapshot if last
    replaying: bool = False
    """A `session/resume` with replay runs: updates are its replay, then its snapshot."""
    tagged: bool = False
    """The agent names the turn each end belongs to (an end with the tag was seen)."""
    seen: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """Message ids of the updates the application saw live (the most recent `MAX_SEEN`)."""

    def ended(self, message_id: str) -> TurnEnd | None:
        """How the turn of `message_id` ended, if the ledger knows it ended."""
        return self.ends.get(message_id)

    def known(self, message_id: str) -> bool:
        """Whether the ledger saw `message_id` inserted (or its end)."""
        return message_id in self.ends or message_id in self.open or message_id in self.turns

    def replayed(self, message_id: str) -> tuple[SessionUpdate, ...]:
        """The updates of the turn of `message_id` a replay carried (empty if none)."""
        return tuple(self.turns.get(message_id, ()))

    def feed(self, update: SessionUpdate, *, replay: bool = False) -> None:
        """Take one update of the session, live or (`replay`) from a replay of its history."""
        seen_id = getattr(update, "message_id", None)
        if not replay and isinstance(seen_id, str):
            self.seen[seen_id] = None
            self.seen.move_to_end(seen_id)
            if len(self.seen) > MAX_SEEN:
                self.seen.popitem(last=False)
        if isinstance(update, s.SessionUpdateUserMessage):
            message_id = update.message_id
            if message_id not in self.ends and message_id not in self.open:
                self.open.append(message_id)
            if replay:
                self._current = message_id
                self.turns[message_id] = []
                self.turns.move_to_end(message_id)
        if replay and self._current is not None and self._current in self.turns:
            self.turns[self._current].append(update)
            self._kept += 1
        report = state_report(update)
        if report is not None and report.get("state") == "idle":
            tag = end_tag(report)
            if tag is not None:
                self.tagged = True
                self._end(tag, end_of(report))
            elif self.open:
                self._end_all(end_of(report))
        self._trim()

    def begin_replay(self) -> None:
        """A `session/resume` with `replayFrom: start` is sent: what arrives until its answer
        is the session's history, then its snapshot (`take`, then `end_replay`)."""
        self.replaying = True
        self._held = None

    def take(self, update: SessionUpdate) -> bool:
        """One update of the replay under way; True when it carries a message id seen live
        (what follows it in the replay was missed). The latest state report is held back: it
        is the snapshot when nothing follows it before the answer."""
        if self._held is not None:
            self.feed(self._held, replay=True)
            self._held = None
        if state_report(update) is not None:
            self._held = update
        else:
            self.feed(update, replay=True)
        seen_id = getattr(update, "message_id", None)
        return isinstance(seen_id, str) and seen_id in self.seen

    def end_replay(self) -> None:
        """The resume was answered: the update held back is its snapshot. An idle snapshot
        ends every turn still open: interrupted, with its error, when it says
        `stopReason: "error"`; else with no stop reason (they ended while no one watched)."""
        held, self._held = self._held, None
        self.replaying = False
        self._current = None
        snapshot = state_report(held) if held is not None else None
        if held is not None and snapshot is not None and end_tag(snapshot) is not None:
            self.feed(held, replay=True)  # a turn's end, not a snapshot: it names its turn
        if snapshot is not None and snapshot.get("state") == "idle" and self.open:
            end = end_of(snapshot)
            if end.stop_reason != "error":
                end = TurnEnd(None)  # ended while no one watched: its reason is not known
            for message_id in list(self.open):
                self._end(message_id, end)
        self._trim()

    def _end(self, message_id: str, end: TurnEnd) -> None:
        if message_id in self.ends:
            return  # a turn ends once: the first report of its end is the one kept
        self.ends[message_id] = end
        if message_id in self.open:
            self.open.remove(message_id)

    def _end_all(self, end: TurnEnd) -> None:
        *earlier, last = self.open
        for message_id in earlier:
            # an untagged idle reports the last turn; an interruption covers them all
            self._end(message_id, end if end.stop_reason == "error" else TurnEnd(None))
        self._end(last, end)

    def _trim(self) -> None:
        while len(self.ends) > MAX_TURNS:
            self.ends.popitem(last=False)
        while len(self.open) > MAX_TURNS:
            self.open.pop(0)
        while self.turns and (len(self.turns) > MAX_TURNS or self._kept > _MAX_UPDATES):
            _, dropped = self.turns.popitem(last=False)
            self._kept -= len(dropped)
