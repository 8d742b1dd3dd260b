"""`TurnRunner`: one session's worker, which runs the turns of its inserted messages.

The session's inbox (`acp_once.agent.inbox`) reports each committed user message to its runner
("inserted"); the runner queues the turn and runs the turns one at a time in its worker, in the
agent's task group, with the turn given as a callable (`SessionAgent.run_turn`). Each turn
starts with a `running` state update and ends with its end record (`state.turn_end`: the idle
update with its stop reason, naming the message), which is stored in the timeline before it
is sent (A10): a restarted process, or a node that took the session over, finds the turns that
never ended (`acp_once.agent.state.unfinished_turns`), and every client that resumes later
replays how each turn ended. A turn that `session/cancel` dropped from the queue gets its end
record too (`cancelled`), after the running turn's. When its turns run out, the worker asks
the inbox for the next held prompt, and stops when there is none.

Everything a turn sends goes out through one session broadcast (`publish`: this process's
connections and, in a cluster, the other nodes); how each turn ended goes to the broadcast's
"turn ended" subscribers (the v1 face of a v1 connection).

`TurnContext` is what a turn uses to report and to ask. What it reports is retained (stored,
then sent) unless its kind is live-only (`LIVE_ONLY_KINDS`, A11).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import orjson
from pydantic import BaseModel

from acp_once.agent.state import RECOVER_TIMEOUT, STARTED, Turn, marker, turn_end
from acp_once.agent.updates import check_update, tool_call, tool_call_update
from acp_once.protocol import schema as s
from acp_once.protocol.errors import InternalError
from acp_once.protocol.vocabulary import (
    Extension,
    StopReason,
    ToolCallStatus,
    ToolKind,
    check_open_value,
)
from acp_once.rpc.errors import ConnectionClosed
from acp_once.storage.base import FencingError, SessionMissing, SessionStore

if TYPE_CHECKING:
    from acp_once.agent.calls import AgentConnection
    from acp_once.rpc.tasks import TaskPool

__all__ = ["LIVE_ONLY_KINDS", "TurnContext", "TurnRunner", "TurnSetup"]

logger = logging.getLogger("acp_once.agent")

_STOP_TIMEOUT = 10.0

LIVE_ONLY_KINDS = frozenset({"state_update", "notice", "terminal_output_chunk"})
"""The `sessionUpdate` kinds `TurnContext.emit` sends without storing them unless told to
(A11): a state update is a snapshot of the session's activity (a resume sends the current one;
each turn's end is stored by the runtime itself), a notice is not part of session history (the
schema says so), and a terminal's output chunks are an unbounded byte stream (`terminal_update`
carries a replacement snapshot of the output, and is retained). Every other kind, an unknown
or custom one included, is part of the conversation: stored, then sent."""

RunTurn = Callable[[Turn, "TurnContext"], Awaitable[StopReason | Extension]]
"""`SessionAgent.run_turn`: work on one inserted message; return the stop reason."""
Publish = Callable[[dict[str, Any]], Awaitable[None]]
"""The session broadcast: send one update to the session's connections, here and elsewhere."""
TurnEnded = Callable[[str, dict[str, Any]], None]
"""`(message_id, idle)`: tell the "turn ended" subscribers how the turn of a message ended."""


class TurnSource(Protocol):
    """Where a worker whose turns ran out looks for more (the session's inbox)."""

    def may_stop(self) -> bool:
        """True when the worker may stop without taking the lock (nothing can be waiting)."""
        ...

    def waiting(self) -> bool:
        """Prompts wait to be inserted after the turns queued now."""
        ...

    async def next(self, has_turns: Callable[[], bool]) -> bool:
        """Insert the next waiting prompt (True: its turn is queued), or False: stop."""
        ...


def _no_pool() -> TaskPool:
    raise RuntimeError("use SessionAgent as an async context manager")


@dataclass(slots=True)
class TurnSetup:
    """What every runner of one agent shares (filled in as the agent is entered)."""

    run_turn: RunTurn
    store: SessionStore
    strict: bool
    pool: Callable[[], TaskPool] = _no_pool
    """The agent's task group's pool, where workers run."""
    new_scope: Callable[[], anyio.CancelScope] = field(default=anyio.CancelScope)


class TurnRunner:
    """One session's worker and turn queue (see the module docstring)."""

    __slots__ = (
        "_drained",
        "_dropped",
        "_ended",
        "_on_stop",
        "conns",
        "publish",
        "running",
        "session_id",
        "setup",
        "source",
        "stopped",
        "turn_scope",
        "turns",
    )

    def __init__(
        self,
        session_id: str,
        setup: TurnSetup,
        *,
        publish: Publish,
        turn_ended: TurnEnded,
        conns: dict[str, AgentConnection],
        on_stop: Callable[[], None],
    ) -> None:
        self.session_id = session_id
        self.setup = setup
        self.publish = publish
        self.conns = conns
        """The connections the session is active on (a turn's permission requests go there)."""
        self.source: TurnSource | None = None
        # a list, not a deque: few turns wait at once, and a session's empty deque would be
        # ~0.8 KiB of every idle session
        self.turns: list[Turn] = []
        self.running = False
        """The worker runs (a prompt arriving now would be held under the hold policy)."""
        self.turn_scope: anyio.CancelScope | None = None
        self.stopped: anyio.Event | None = None
        """Set when the running worker ends; made only when someone waits for that."""
        self._ended = turn_ended
        self._on_stop = on_stop
        self._dropped: list[Turn] = []
        """Turns a cancel dropped from the queue, whose end records are not written yet."""
        self._drained: anyio.Event | None = None
        """Set when the worker has ended a cancelled turn and the turns dropped with it."""

    def busy(self) -> bool:
        """A turn runs or waits to (a worker that only drains the queue is not a turn)."""
        return self.running and (self.turn_scope is not None or bool(self.turns))

    # -- what the inbox reports --------------------------------------------------------------

    def inserted(self, turn: Turn) -> None:
        self.turns.append(turn)
        self.start()

    def start(self) -> None:
        if self.running:
            return
        self.running = True
        # a parked task of the group runs it when one waits: cheaper than a new task per turn
        self.setup.pool().start_soon(self._work)

    def resume(self, turns: list[Turn]) -> None:
        """Run again the turns an earlier process left unfinished."""
        self.turns.extend(turns)
        self.start()

    # -- the worker --------------------------------------------------------------------------

    def _has_turns(self) -> bool:
        return bool(self.turns)

    async def _work(self) -> None:
        context = TurnContext(self)
        source = self.source
        assert source is not None
        try:
            while True:
                if not self.turns:
                    if source.may_stop():
                        break  # nothing to insert and nobody inserting: no lock needed
                    if await source.next(self._has_turns):
                        continue
                    break
                turn = self.turns.pop(0)
                # the scope exists from the moment the turn leaves the queue, so a cancel that
                # arrives before the turn got going still stops it
                self.turn_scope = self.setup.new_scope()
                end = await self._run_one(turn, context, self.turn_scope)
                self._ended(turn.message_id, end)
                # every turn's end goes out, as stored (A10; a cancelled one: R57)
                await self.publish(end)
                if self._dropped or self._drained is not None:
                    await self._end_dropped()
        finally:
            self.running = False
            self.turn_scope = None
            if self.stopped is not None:
                self.stopped.set()
                self.stopped = None
            if self._drained is not None:
                self._drained.set()
                self._drained = None
            self._on_stop()  # its last connection may have gone during the turn

    async def _run_one(
        self, turn: Turn, context: TurnContext, scope: anyio.CancelScope
    ) -> dict[str, Any]:
        """Run one turn; store its end record (`turn_end`), and return it.

        A failure after insertion is never an error answer: it ends the turn with
        `stopReason: "error"` (R55). The end record is stored (with the turn's `final` update,
        in one write when the store can), shielded, before it is sent; a message without one
        was interrupted by a crash (A3).
        """
        context._turn = turn
        context._final = None
        error: dict[str, Any] | None = None
        reason = "error"
        with scope:
            if not turn.announced:
                await context.emit({"sessionUpdate": "state_update", "state": "running"})
            try:
                if turn.queued:  # stored before it runs: a restart must not run it again (A3)
                    await self.setup.store.append_update(
                        self.session_id, marker(STARTED, turn.message_id)
                    )
                returned = await self.setup.run_turn(turn, context)
                if self.setup.strict:
                    check_open_value("stopReason", returned)
                reason = returned
            except Exception as exc:
                logger.exception("session %s: turn failed", self.session_id)
                error = InternalError(f"The turn failed ({type(exc).__name__})").to_wire()
        self.turn_scope = None
        if scope.cancelled_caught or scope.cancel_called:
            reason, error = "cancelled", None
        end = turn_end(turn.message_id, reason, error)
        final = context.take_final()
        if not turn.live_only:
            if reason == "cancelled":
                # a session/cancel or close waits for it (R61): it must not be cut short
                with anyio.CancelScope(shield=True):
                    await self.record_end(end, final)
            else:
                # Not shielded (a shield costs ~7 us a turn): only the agent's own shutdown can
                # cancel this write, and a turn whose end it cut is found without one at the
                # next start, as after a crash (A3).
                await self.record_end(end, final)
        if final is not None:
            await self.publish(final[2])
        return end

    async def record_end(
        self, end: dict[str, Any], final: tuple[bytes, str | None, dict[str, Any]] | None = None
    ) -> bool:
        """Store a turn's end record (after its `final` update, in one write when the store
        can: `AppendsUpdates`); False when it was not stored. A failure is logged, never raised:
        the session's worker (and with it the agent) must outlive its store's, and the turn
        then has no end record, so a restart reports it interrupted. Only the error's type is
        logged: a store's error text could quote a key."""
        store = self.setup.store
        encoded = orjson.dumps(end)
        message_id = _ended_id(end)
        try:
            if final is None:
                await store.append_update(self.session_id, encoded)
                return True
            append_updates = getattr(store, "append_updates", None)
            if append_updates is not None:
                await append_updates(self.session_id, [(final[0], final[1]), (encoded, None)])
            else:
                await store.append_update(self.session_id, final[0], message_id=final[1])
                await store.append_update(self.session_id, encoded)
        except (FencingError, SessionMissing):  # taken over by another node, or deleted
            logger.warning(
                "session %s: the end of the turn of %s was not stored (lease lost or session "
                "deleted)",
                self.session_id,
                message_id,
            )
            return False
        except Exception as exc:
            logger.error(
                "session %s: the end of the turn of %s was not stored (%s)",
                self.session_id,
                message_id,
                type(exc).__name__,
            )
            return False
        return True

    async def end_unrun(self, end: dict[str, Any]) -> None:
        """Store the end record of a turn that will not run here (an interrupted one, A3);
        once stored, tell the "turn ended" subscribers and send it."""
        if await self.record_end(end):
            self._ended(_ended_id(end), end)
            await self.publish(end)

    async def _end_dropped(self) -> None:
        """Store and send the end records of the turns a cancel dropped (after the running
        turn's), shielded and bounded: their work will never run, and a turn without an end
        record counts as interrupted (a restart would run it again)."""
        dropped, self._dropped = self._dropped, []
        with anyio.move_on_after(RECOVER_TIMEOUT, shield=True):
            for turn in dropped:
                end = turn_end(turn.message_id, "cancelled")
                if not turn.live_only:
                    await self.record_end(end)
                await self.publish(end)
        if self._drained is not None:
            self._drained.set()
            self._drained = None

    # -- cancelling ----------------------------------------------------------------------------

    async def cancel(self) -> None:
        """`session/cancel`: drop the queued turns, cancel the running one, and wait (bounded)
        for the worker to send its last updates (R61). Each dropped turn ends `cancelled`
        (A10), after the running turn's end."""
        dropped = list(self.turns)
        self.turns.clear()
        for turn in dropped:
            self._ended(turn.message_id, turn_end(turn.message_id, "cancelled"))
        self._dropped.extend(dropped)
        if self.turn_scope is not None:
            self.turn_scope.cancel()
            # the worker ends the running turn, then the dropped ones, in that order
            if self._drained is None:
                self._drained = anyio.Event()
            drained = self._drained
            with anyio.move_on_after(_STOP_TIMEOUT):
                await drained.wait()
        if self._dropped:
            await self._end_dropped()  # no turn ran (or the worker is late): ended here
        if self.running:
            # the final updates and the idle state_update go out before we answer (R61)
            if self.stopped is None:
                self.stopped = anyio.Event()
            stopped = self.stopped
            with anyio.move_on_after(_STOP_TIMEOUT):
                await stopped.wait()

    def stop_turns(self) -> None:
        """Drop the turns waiting to run and cancel the running one (the session's lease was
        lost: its turns can no longer write)."""
        self.turns.clear()
        if self.turn_scope is not None:
            self.turn_scope.cancel()


class TurnContext:
    """What a turn uses to report and to ask: live updates go to every connection the session
    is active on, and are retained in the store when they are part of the conversation.

    Updates are the builders' models (`acp_once.agent.updates`) or wire dicts; tool calls and
    permission requests have helpers of their own (`start_tool_call`, `update_tool_call`,
    `request_permission`)."""

    def __init__(self, runner: TurnRunner) -> None:
        self._runner = runner
        self._turn: Turn | None = None  # the turn being run
        # its `final` update, held back to be stored with its end record:
        # (encoded, message id, the update)
        self._final: tuple[bytes, str | None, dict[str, Any]] | None = None
        self._strict = runner.setup.strict

    @property
    def session_id(self) -> str:
        return self._runner.session_id

    async def emit(
        self,
        update: dict[str, Any] | BaseModel,
        *,
        retain: bool | None = None,
        final: bool = False,
    ) -> None:
        """Send one `session/update` `update` object, stored for replay first when it is
        part of the conversation.

        By default an update is retained unless its kind is live-only (`LIVE_ONLY_KINDS`:
        state updates, notices, terminal output chunks) or the turn is a locally handled
        command's (A11). Tool calls and their updates keep their `toolCallId` in the store,
        so a replay shows the same tool call.

        `final` says this is the turn's last update: it is held back, and stored together
        with the turn's end record (one write instead of two) when `run_turn` returns, then
        sent. A crash before that loses it with the turn's end, so the turn is reported
        interrupted. An update emitted after it sends it first (stored on its own).

        Args:
            update: a model from `acp_once.agent.updates` (or any `session/update` kind of
                `acp_once.protocol.schema`), or the wire dict.
            retain: True stores it whatever its kind; False sends it only (an update your
                own storage replays already); None decides by kind.
            final: the turn's last retained update (see above).

        Raises:
            ValueError: in strict mode (`SessionAgent(strict_updates=True)` or
                `ACP_ONCE_STRICT=1`), a dict that is not a valid update; the message names
                the kind or the field.
        """
        # dicts first: isinstance against a pydantic model class goes through ABCMeta (~200 ns)
        if not isinstance(update, dict):
            # JSON mode: URLs, datetimes and enums become strings orjson and clients accept
            update = update.model_dump(by_alias=True, exclude_unset=True, mode="json")
            if self._strict:  # a builder takes any string the schema's open sets allow
                check_update(update)
        elif self._strict:
            check_update(update)
        else:
            kind = update.get("sessionUpdate")
            if kind.__class__ is not str or kind not in _SAMPLED:
                _sample_update(update)  # the first dict of its kind: a set lookup after that
        runner = self._runner
        if self._final is not None:
            await self._send_final()
        turn = self._turn
        if retain is None:
            retain = (
                turn is not None
                and not turn.live_only
                and update.get("sessionUpdate") not in LIVE_ONLY_KINDS
            )
        if retain:
            encoded = orjson.dumps(update)
            message_id = update.get("messageId")
            if final and turn is not None and not turn.live_only:
                self._final = (encoded, message_id, update)
                return
            await runner.setup.store.append_update(
                runner.session_id, encoded, message_id=message_id
            )
        await runner.publish(update)

    def take_final(self) -> tuple[bytes, str | None, dict[str, Any]] | None:
        """The held-back `final` update (encoded, message id, update), now the runner's."""
        final, self._final = self._final, None
        return final

    async def _send_final(self) -> None:
        """Store and send the held-back `final` update on its own (something followed it)."""
        final, self._final = self._final, None
        if final is None:
            return
        runner = self._runner
        await runner.setup.store.append_update(runner.session_id, final[0], message_id=final[1])
        await runner.publish(final[2])

    async def start_tool_call(
        self,
        title: str,
        *,
        kind: ToolKind | Extension = "other",
        status: ToolCallStatus | Extension = "pending",
        tool_call_id: str | None = None,
        content: list[Any] | None = None,
        locations: list[Any] | None = None,
    ) -> str:
        """Report a new tool call (`updates.tool_call`) and return its id.

        Args:
            title: what the tool is doing, for the user.
            kind: read, edit, delete, move, search, execute, think, fetch, switch_mode, other.
            status: its first status (pending, in_progress...).
            tool_call_id: its id (None: a fresh one).
            content: tool-call content items (a string becomes a text item).
            locations: paths (or location dicts) it touches.

        Returns:
            The tool call's id, for `update_tool_call` and `request_permission`.
        """
        update = tool_call(
            title,
            kind=kind,
            status=status,
            tool_call_id=tool_call_id,
            content=content,
            locations=locations,
        )
        await self.emit(update)
        return update.tool_call_id

    async def update_tool_call(self, tool_call_id: str, **changes: Any) -> None:
        """Report a change to a tool call: `updates.tool_call_update(tool_call_id, **changes)`.

        Args:
            tool_call_id: the id `start_tool_call` returned.
            **changes: `status`, `content`, `title`, `kind`, `locations`, `raw_input`,
                `raw_output` (not given: unchanged).
        """
        await self.emit(tool_call_update(tool_call_id, **changes))

    async def request_permission(
        self,
        request: s.RequestPermissionRequest | None = None,
        *,
        title: str | None = None,
        options: list[Any] | None = None,
        tool_call_id: str | None = None,
        description: str | None = None,
    ) -> s.RequestPermissionResponse:
        """Ask the user through a client the session is active on.

        Give a `s.RequestPermissionRequest`, or the simple arguments:
        `await ctx.request_permission(title="Write the file?", tool_call_id=tool_id)`.
        With no client connected, or all of them gone, the answer is the `cancelled` outcome,
        which means "not approved". When the turn is cancelled, the pending request is
        cancelled with `$/cancel_request`.

        Args:
            request: the whole request (then no other argument).
            title: the prompt's title.
            options: the choices: `(kind, name)` pairs (the kind is the option id:
                allow_once, allow_always, reject_once, reject_always), dicts or
                `s.PermissionOption`s; None offers allow_once and reject_once.
            tool_call_id: the tool call asking (the client shows the request with it).
            description: why permission is needed.

        Returns:
            The client's answer: `response.outcome.outcome` is "selected" (with
            `.option_id`) or "cancelled".

        Raises:
            ValueError: both `request` and simple arguments, or neither.
        """
        if request is None:
            if title is None:
                raise ValueError("request_permission needs a request or a title")
            request = _permission_request(
                self._runner.session_id, title, options, tool_call_id, description
            )
        elif title is not None or options is not None or tool_call_id is not None:
            raise ValueError("request_permission takes a request or simple arguments, not both")
        for conn in list(self._runner.conns.values()):
            try:
                return await conn.client.request_permission(request)
            except ConnectionClosed:
                continue
        return s.RequestPermissionResponse.model_validate({"outcome": {"outcome": "cancelled"}})


def _ended_id(end: dict[str, Any]) -> str:
    """The message an end record (`turn_end`) names."""
    message_id: str = end["_meta"]["acpOnce"]["messageId"]
    return message_id


_DEFAULT_OPTIONS = [("allow_once", "Allow"), ("reject_once", "Reject")]


def _permission_request(
    session_id: str,
    title: str,
    options: list[Any] | None,
    tool_call_id: str | None,
    description: str | None,
) -> s.RequestPermissionRequest:
    choices = [
        {"optionId": option[0], "kind": option[0], "name": option[1]}
        if isinstance(option, tuple)
        else option
        for option in (options or _DEFAULT_OPTIONS)
    ]
    fields: dict[str, Any] = {"sessionId": session_id, "title": title, "options": choices}
    if tool_call_id is not None:
        fields["subject"] = {"type": "tool_call", "toolCall": {"toolCallId": tool_call_id}}
    if description is not None:
        fields["description"] = description
    return s.RequestPermissionRequest.model_validate(fields)


_SAMPLED: set[Any] = set()  # kinds whose first dict was checked (outside strict mode)


def _sample_update(update: dict[str, Any]) -> None:
    """Outside strict mode, check only the first dict of each kind and log a bad one once:
    after that an emit costs one set lookup, not a validation (the hot path stays as fast)."""
    kind = update.get("sessionUpdate")
    if not isinstance(kind, str):
        if None in _SAMPLED:  # a missing or non-string kind is logged once, too
            return
        kind = None
    _SAMPLED.add(kind)
    try:
        check_update(update)
    except ValueError as exc:
        logger.warning("%s (sent anyway; ACP_ONCE_STRICT=1 refuses it)", exc)
