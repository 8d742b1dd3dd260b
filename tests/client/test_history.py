"""The client's ledger of a session's turns (`acp_once.client.history`): which turn an end
belongs to, from tagged ends, untagged ends in order, and a resume's snapshot."""

from __future__ import annotations

from typing import Any

from acp_once.client import SessionUpdate
from acp_once.client.history import TurnEnd, TurnLedger
from acp_once.protocol.updates import validate_update_notification

INTERRUPTED = {"code": -32603, "message": "The agent restarted before the turn finished"}


def update(**fields: Any) -> SessionUpdate:
    return validate_update_notification({"sessionId": "s", "update": fields}).update


def user(message_id: str) -> SessionUpdate:
    return update(
        sessionUpdate="user_message",
        messageId=message_id,
        content=[{"type": "text", "text": message_id}],
    )


def idle(reason: str | None = None, tag: str | None = None, **extra: Any) -> SessionUpdate:
    fields: dict[str, Any] = {"sessionUpdate": "state_update", "state": "idle", **extra}
    if reason is not None:
        fields["stopReason"] = reason
    if tag is not None:
        fields["_meta"] = {"acpOnce": {"messageId": tag}}
    return update(**fields)


RUNNING = update(sessionUpdate="state_update", state="running")


def test_tagged_ends_are_matched_by_message_id_not_position() -> None:
    ledger = TurnLedger()
    for u in (user("A"), user("B"), idle("end_turn", tag="B")):
        ledger.feed(u)
    assert ledger.ended("B") == TurnEnd("end_turn")
    assert ledger.ended("A") is None  # B's end is not A's, though A came first
    ledger.feed(idle("cancelled", tag="A"))
    assert ledger.ended("A") == TurnEnd("cancelled")
    assert ledger.tagged


def test_an_untagged_end_ends_every_open_turn_the_last_with_its_reason() -> None:
    ledger = TurnLedger()
    for u in (user("A"), RUNNING, user("B"), idle("end_turn")):
        ledger.feed(u)
    assert ledger.ended("A") == TurnEnd(None)
    assert ledger.ended("B") == TurnEnd("end_turn")
    assert not ledger.open


def test_an_idle_snapshot_after_a_replay_ends_the_replayed_turns() -> None:
    ledger = TurnLedger()
    ledger.begin_replay()
    agent = update(
        sessionUpdate="agent_message", messageId="m", content=[{"type": "text", "text": "hi"}]
    )
    for u in (user("A"), agent, idle("error", error=INTERRUPTED)):
        ledger.take(u)
    assert ledger.ended("A") is None  # the snapshot is known only when the answer comes
    ledger.end_replay()
    assert ledger.ended("A") == TurnEnd("error", INTERRUPTED)
    assert [u.session_update for u in ledger.replayed("A")] == ["user_message", "agent_message"]
    # a snapshot without a stop reason: over, with no reason known
    other = TurnLedger()
    other.begin_replay()
    other.take(user("A"))
    other.take(idle())
    other.end_replay()
    assert other.ended("A") == TurnEnd(None)


def test_a_running_snapshot_leaves_turns_open_and_a_replayed_tagged_end_wins() -> None:
    ledger = TurnLedger()
    ledger.begin_replay()
    for u in (user("A"), idle("end_turn", tag="A"), user("B"), RUNNING):
        ledger.take(u)
    ledger.end_replay()
    assert ledger.ended("A") == TurnEnd("end_turn")
    assert ledger.ended("B") is None and ledger.known("B")
    ledger.feed(idle("end_turn"))  # live: the end of what ran
    assert ledger.ended("B") == TurnEnd("end_turn")
    assert not ledger.known("C")


def test_the_ledger_is_bounded() -> None:
    from acp_once.client.history import MAX_TURNS

    ledger = TurnLedger()
    ledger.begin_replay()
    for n in range(MAX_TURNS + 10):
        ledger.take(user(f"m{n}"))
        ledger.take(idle("end_turn", tag=f"m{n}"))
    ledger.end_replay()
    assert len(ledger.ends) == MAX_TURNS and len(ledger.turns) <= MAX_TURNS
    assert ledger.ended(f"m{MAX_TURNS + 9}") == TurnEnd("end_turn")
