"""Waiting for a prompt's turn: `PromptHandle` and `TurnResult`.

    turn = session.prompt("Run the database migration")   # sent at once, in the background
    message_id = await turn                                # inserted (as `await session.prompt`)
    async for update in turn.updates():                    # the turn's updates, as they arrive
        ...
    result = await turn.finished()                         # its end: stop reason, messages

A turn begins with its `user_message` (the update carrying the `messageId` the agent answered)
and ends with the next idle `state_update` (its `stopReason`). The protocol reports the
session's foreground state, not each turn's: when held prompts run back to back, only the last
turn ends with an idle update, so an earlier turn ends when a later message's turn starts
(another `user_message`, then `running`) and its stop reason is not known (`None`). After a
reconnect the client resumes the session and the agent reports its state: a turn that ended
while the client was away ends then (an idle without stop reason: `None`), and a turn an agent
restart interrupted ends with `stopReason: "error"`.

Against an ACP v1 agent there is no insertion and no message id: a v1 `session/prompt` is
answered once, at the end of its turn, with `{stopReason}`. The client then gives the prompt a
local id (`v1_<hex>`, known to this client only, never sent) and reports the turn as a v2 agent
would: its `user_message` under that id when the prompt is sent, the agent's updates
translated to v2, and an idle `state_update` with the answer's stop reason. So `message_id` is
the local id from the moment the prompt is sent, `updates()` streams the turn as it runs,
`await handle` (`inserted()`) returns the local id at the end of the turn, and `finished()`
gives its stop reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeAlias

import anyio

from acp_once.protocol import schema as s

__all__ = [
    "INTERRUPTED_MESSAGE",
    "PromptHandle",
    "SessionUpdate",
    "TurnResult",
    "UpdateCallback",
    "end_tag",
    "state_report",
]

INTERRUPTED_MESSAGE = "The agent restarted before the turn finished"
"""The `error.message` with which acp-once agents end a turn a restart interrupted."""

SessionUpdate: TypeAlias = (
    s.SessionUpdateUserMessageChunk
    | s.SessionUpdateUserMessage
    | s.SessionUpdateAgentMessageChunk
    | s.SessionUpdateAgentMessage
    | s.SessionUpdateAgentThoughtChunk
    | s.SessionUpdateAgentThought
    | s.SessionUpdateToolCallContentChunk
    | s.SessionUpdateToolCallUpdate
    | s.SessionUpdateTerminalUpdate
    | s.SessionUpdateTerminalOutputChunk
    | s.SessionUpdatePlanUpdate
    | s.SessionUpdatePlanRemoved
    | s.SessionUpdateAvailableCommandsUpdate
    | s.SessionUpdateConfigOptionUpdate
    | s.SessionUpdateSessionInfoUpdate
    | s.SessionUpdateUsageUpdate
    | s.SessionUpdateNotice
    | s.SessionUpdateCompactionUpdate
    | s.SessionUpdateCompactionSummaryChunk
    | s.SessionUpdateSubagentUpdate
    | s.SessionUpdateSessionMessage
    | s.SessionUpdateSessionMessageChunk
    | s.SessionUpdateOther
    | s.SessionUpdateStateUpdate2
    | s.SessionUpdateStateUpdate3
    | s.SessionUpdateStateUpdate4
    | s.SessionUpdateStateUpdate5
    | s.SessionUpdateStateUpdate6
)
"""One validated `session/update` `update` object (`UpdateSessionNotification.update`)."""

_EARLY_LIMIT = 10_000
"""Updates kept while the message id is not known yet (the turn's start is among them)."""


def state_report(update: SessionUpdate) -> dict[str, Any] | None:
    """The wire form of a `state_update` (None for any other kind)."""
    if getattr(update, "session_update", None) != "state_update":
        return None
    return update.model_dump(by_alias=True, exclude_unset=True, mode="json")


def end_tag(report: dict[str, Any]) -> str | None:
    """The message id an idle report names as the turn it ends (`_meta.acpOnce.messageId`,
    as acp-once agents tag each turn's end), or None."""
    meta = report.get("_meta")
    ours = meta.get("acpOnce") if isinstance(meta, dict) else None
    tag = ours.get("messageId") if isinstance(ours, dict) else None
    return tag if isinstance(tag, str) else None


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    blocks = content if isinstance(content, list) else [content]
    return "".join(str(getattr(b, "text", "") or "") for b in blocks)


@dataclass(frozen=True)
class TurnResult:
    """How a prompt's turn ended.

    Attributes:
        message_id: the inserted user message.
        stop_reason: the idle `state_update`'s `stopReason` ("end_turn", "cancelled",
            "error", ...); None when the agent reported none for this turn (the next held
            prompt's turn started at once, or the turn ended while the client was reconnecting).
        error: the idle update's `error` object (with `stop_reason` "error"), else None.
        updates: every update of the turn, from its user message to its end, in order.
    """

    message_id: str
    stop_reason: str | None
    error: dict[str, Any] | None
    updates: tuple[SessionUpdate, ...]

    @property
    def interrupted(self) -> bool:
        """Whether the turn did not finish: it ended with `stop_reason` "error" (the agent
        restarted before it finished, or the turn failed)."""
        return self.stop_reason == "error"

    @property
    def messages(self) -> list[s.SessionUpdateAgentMessage | s.SessionUpdateAgentMessageChunk]:
        """The agent's messages of the turn (whole messages and chunks), in order."""
        return [
            u
            for u in self.updates
            if isinstance(u, s.SessionUpdateAgentMessage | s.SessionUpdateAgentMessageChunk)
        ]

    @property
    def text(self) -> str:
        """The text of the agent's messages, joined: chunks append to their message, a whole
        `agent_message` replaces what its `messageId` had (the schema's upsert rule)."""
        parts: dict[str, str] = {}
        for n, u in enumerate(self.messages):
            key = getattr(u, "message_id", None) or f"#{n}"
            text = _content_text(getattr(u, "content", None))
            if isinstance(u, s.SessionUpdateAgentMessage):
                if "content" in u.model_fields_set:
                    parts[key] = text
                else:
                    parts.setdefault(key, "")
            else:
                parts[key] = parts.get(key, "") + text
        return "".join(parts.values())


class PromptHandle:
    """One submitted prompt: await it for its `messageId`, then its turn.

    Returned by `ClientSession.prompt`, already on its way (the submission is written to the
    outbox and sent in the background, in the session's order). `await handle` returns the
    `messageId` at insertion, as `inserted()` does; `finished()` waits for the end of the turn;
    `updates()` yields the turn's updates as they arrive. The handle works across reconnects:
    the client resumes the session, and the turn's end arrives after the resume.
    """

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._inserted = anyio.Event()
        self._started = anyio.Event()  # inserted, failed, or (v1) the turn began
        self._ended = anyio.Event()
        self._changed = anyio.Event()
        self._message_id: str | None = None
        self._accepted = False  # the agent answered the prompt with success
        self._error: BaseException | None = None
        self._early: list[SessionUpdate] = []
        self._early_mark: int | None = None  # where the latest connection's updates begin
        self._history_mark: int | None = None  # where the updates after the last replay begin
        self._begun = False
        self._assume_begun = False  # the user message may have gone with a lost connection
        self._other_inserted = False
        self._tagged = False  # the agent names the turn each end belongs to
        self._from_history = False
        self._updates: list[SessionUpdate] = []
        self._result: TurnResult | None = None
        self._on_end: Callable[[PromptHandle], None] | None = None

    def __repr__(self) -> str:
        return f"PromptHandle({self.session_id!r}, message_id={self._message_id!r})"

    @property
    def message_id(self) -> str | None:
        """The inserted message's id; None until insertion (against a v1 agent: the local id,
        from the moment the prompt is sent)."""
        return self._message_id

    @property
    def from_history(self) -> bool:
        """True when the message was inserted before this client followed it (an earlier run,
        or a connection that is gone): the session's replayed history says so, and its turn
        is followed (or ended) from what the history holds."""
        return self._from_history

    @property
    def done(self) -> bool:
        """True once the turn ended, or the prompt failed before insertion."""
        return self._ended.is_set()

    def __await__(self) -> Generator[Any, None, str]:
        return self.inserted().__await__()

    async def inserted(self) -> str:
        """Wait for insertion; return the `messageId`.

        Raises:
            PromptCancelled: withdrawn or cancelled before insertion.
            AcpError: the agent refused it (e.g. -32602); nothing was inserted.
            OutcomeUnknown: the answer was lost and automatic resends are refused.
        """
        await self._inserted.wait()
        if self._accepted and self._message_id is not None:
            return self._message_id  # inserted, even if the turn's end was lost since
        assert self._error is not None
        raise self._error

    async def finished(self) -> TurnResult:
        """Wait for the end of the turn (bound it with `anyio.fail_after`: a turn may run long).

        Raises the errors of `inserted()`, and `OutcomeUnknown` also when the client closed, or
        gave up reconnecting, before the turn ended.
        """
        await self.inserted()
        await self._ended.wait()
        if self._result is None:
            assert self._error is not None
            raise self._error
        return self._result

    async def updates(self) -> AsyncIterator[SessionUpdate]:
        """Yield the turn's updates in order, from its user message to the update that ends it
        (earlier ones first, if the turn began before the call); several iterations may run.

        Raises the errors of `finished()`.
        """
        await self._started.wait()
        if self._inserted.is_set():
            await self.inserted()  # raises what the prompt failed with
        index = 0
        while True:
            while index < len(self._updates):
                index += 1
                yield self._updates[index - 1]
            if self._ended.is_set():
                if self._result is None and self._error is not None:
                    raise self._error
                return
            await self._changed.wait()

    # -- fed by the client -------------------------------------------------------------------

    def _set_inserted(self, message_id: str, *, retried: bool) -> None:
        self._message_id = message_id
        self._accepted = True
        # after a resend, the user message may have been broadcast on a connection that is gone
        self._assume_begun = self._assume_begun or retried
        self._inserted.set()
        self._started.set()
        self._try_begin()

    def _end_known(
        self, stop_reason: str | None, error: dict[str, Any] | None, replayed: tuple[Any, ...]
    ) -> None:
        """The turn ended before this handle saw it (its end was replayed, or the resume's
        snapshot said it is over): `replayed` is what the history holds of the turn."""
        if self._ended.is_set() or self._message_id is None:
            return
        self._from_history = True
        if not self._begun:
            self._begun = True
            self._started.set()
            self._early.clear()
            self._updates.extend(replayed)
        self._result = TurnResult(self._message_id, stop_reason, error, tuple(self._updates))
        self._finish()

    def _begin_known(self, replayed: tuple[Any, ...]) -> None:
        """The message was inserted before the resume that replayed `replayed` (its turn
        so far) and its turn has not ended: it is followed from here."""
        if self._begun or self._ended.is_set() or self._message_id is None:
            return
        self._from_history = True
        self._begun = True
        self._started.set()
        # what came after the replay belongs to this turn or later ones (the ledger saw it
        # all: none of it ended this turn); what came before is in the replay
        mark = self._history_mark if self._history_mark is not None else len(self._early)
        later = self._early[mark:]
        self._early.clear()
        self._updates.extend(replayed)
        self._notify()
        for update in later:
            if self._ended.is_set():
                break
            self._add(update)

    def _history_learned(self) -> None:
        """A resume replayed the history into the ledger: later updates are live ones."""
        self._history_mark = len(self._early)

    def _expect(self, message_id: str) -> None:
        """v1: the turn's user message will carry `message_id` (a local id); its turn is
        followed from there, before the end-of-turn answer says it was accepted."""
        self._message_id = message_id
        self._try_begin()

    def _set_failed(self, error: BaseException) -> None:
        if self._ended.is_set():
            return
        self._error = error
        self._inserted.set()
        self._started.set()
        self._finish()

    def _reconnected(self) -> None:
        """A new connection is about to resume the session: a user message not seen by now may
        have gone with the old one, and this turn then begins with the new connection."""
        self._assume_begun = True
        self._early_mark = len(self._early)
        self._try_begin()

    def _feed(self, update: SessionUpdate) -> None:
        if self._ended.is_set():
            return
        if not self._begun:
            self._early.append(update)
            if len(self._early) > _EARLY_LIMIT:  # bounded: the oldest half goes
                drop = _EARLY_LIMIT // 2
                del self._early[:drop]
                if self._early_mark is not None:
                    self._early_mark = max(0, self._early_mark - drop)
                if self._history_mark is not None:
                    self._history_mark = max(0, self._history_mark - drop)
            self._try_begin()
        else:
            self._add(update)

    def _try_begin(self) -> None:
        if self._begun or self._message_id is None or self._ended.is_set():
            return
        early = list(self._early)
        start = next(
            (
                i
                for i, u in enumerate(early)
                if isinstance(u, s.SessionUpdateUserMessage) and u.message_id == self._message_id
            ),
            None,
        )
        if start is None:
            if not self._assume_begun:
                return  # the user message is still on its way (the answer can overtake it)
            # it went with a lost connection: the turn is what the new connection reports
            start = self._early_mark if self._early_mark is not None else len(early)
        self._begun = True
        self._started.set()
        self._early.clear()
        if start is not None:
            for update in early[start:]:
                if self._ended.is_set():
                    break
                self._add(update)

    def _add(self, update: SessionUpdate) -> None:
        self._updates.append(update)
        stop: tuple[str | None, dict[str, Any] | None] | None = None
        if isinstance(update, s.SessionUpdateUserMessage):
            if update.message_id != self._message_id:
                self._other_inserted = True  # a later message: its turn follows this one
        elif (state := state_report(update)) is not None:
            tag = end_tag(state) if state.get("state") == "idle" else None
            if tag is not None and tag != self._message_id:
                self._tagged = True  # another turn's end: this one ends with its own
                self._updates.pop()
            elif state.get("state") == "idle":
                reason = state.get("stopReason")
                error = state.get("error")
                stop = (
                    str(reason) if reason is not None else None,
                    error if isinstance(error, dict) else None,
                )
            elif state.get("state") == "running" and self._other_inserted and not self._tagged:
                self._updates.pop()  # the next turn's start, not this turn's
                stop = (None, None)
        if stop is not None:
            assert self._message_id is not None
            self._result = TurnResult(self._message_id, stop[0], stop[1], tuple(self._updates))
            self._finish()
        else:
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _finish(self) -> None:
        self._ended.set()
        self._notify()
        self._early.clear()
        if self._on_end is not None:
            self._on_end(self)


UpdateCallback: TypeAlias = Callable[[SessionUpdate], Awaitable[None] | None]
"""What `ClientSession.on_update` accepts: a plain or an async function of one update."""
