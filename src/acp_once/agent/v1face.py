"""The v1 face of a connection: an agent written for ACP v2 served to a v1 client.

`AgentSideConnection` creates one when a client's `initialize` asks for `protocolVersion: 1`
(`acp_once.protocol.initialization.route_initialize`). From then on every request, notification
and update of the connection passes through it, and the agent sees v2 only:

- `session/new` becomes the agent's `new_session`; `session/load` its `resume_session` with
  the history replayed (as v1 updates), answered `{}`; `session/list`, `session/resume`,
  `session/close` and `session/delete` map to the v2 methods of the same name.
- `session/prompt` is sent to the agent's `prompt` without a key (an `idempotencyKey` in v1
  params is an unknown field: ignored, never echoed) and answered when that message's turn
  ends, with the stop reason of the idle `state_update` that ends it; `stopReason: "error"`
  becomes an error answer with the turn's error.
- `session/cancel` becomes the agent's `cancel`; the client's prompts that were waiting answer
  `{stopReason: "cancelled"}`.
- Updates (`session_update`) are translated by `acp_once.protocol.v2_to_v1`; the user message
  of the client's own prompt is not echoed back (a v1 client shows it already), and kinds v1
  does not have are dropped. Permission requests are sent in v1's shape.

Which turn ends when: with a `SessionAgent`, the face is subscribed to the "turn ended" news of
each session its connection is active on (`turn_ended`, a listener of the session's broadcast,
`acp_once.agent.session`: told as each turn ends and, by a cancel, for each queued turn it
drops), by message id. Any other agent, and a turn run by another node of a cluster, is
followed from the session's updates: turns run in the order their user messages are inserted,
each starts with a `running` state update and ends with an idle one, which names its message
when it is a `SessionAgent`'s end record (A10); an idle update that names none ends the
running turn and drops the queued ones, and a turn followed by `running` without an idle
update of its own is answered `end_turn`. The first outcome
known for a message is the one answered; outcomes of recent turns are kept, as a turn can end
before its prompt's handler resumes.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import orjson
from pydantic import ValidationError

from acp_once.agent.interface import Agent
from acp_once.agent.state import ended_message
from acp_once.protocol import methods as m
from acp_once.protocol import schema as s
from acp_once.protocol import v1
from acp_once.protocol.errors import (
    InternalError,
    InvalidParams,
    MethodNotFound,
    RequestCancelled,
    error_from_wire,
)
from acp_once.protocol.initialization import UNKNOWN_IMPLEMENTATION
from acp_once.protocol.limits import check_json_strings
from acp_once.protocol.methods import to_wire
from acp_once.protocol.v2_to_v1 import (
    V2ToV1Updates,
    initialize_response,
    permission_request,
    v1_stop_reason_from_v2,
)

if TYPE_CHECKING:
    from acp_once.agent.calls import AgentConnection, CallContext

__all__ = ["SESSION_LOAD", "V1Face"]

SESSION_LOAD = "session/load"
"""v1's `session/load` (v2 has `session/resume` with `replayFrom` instead)."""

_logger = logging.getLogger("acp_once.agent")
_ENDED_KEPT = 64  # outcomes of turns kept per session for prompts whose handler resumes late
_permission_ids = itertools.count(1)
_CANCELLED: dict[str, Any] = {"stopReason": "cancelled"}
_END_TURN_IDLE: dict[str, Any] = {"sessionUpdate": "state_update", "state": "idle"}


@dataclass
class _Waiter:
    done: anyio.Event = field(default_factory=anyio.Event)
    idle: dict[str, Any] | None = None


@dataclass
class _SessionView:
    """What the face knows of one session, from the updates sent to this connection."""

    translator: V2ToV1Updates = field(default_factory=V2ToV1Updates)
    queued: deque[str] = field(default_factory=deque)  # inserted, turn not started
    current: str | None = None  # the message whose turn runs
    ended: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    waiting: dict[str, _Waiter] = field(default_factory=dict)  # this client's prompts
    echoes: list[Any] = field(default_factory=list)  # contents of this client's prompts in flight
    replaying: int = 0  # a load's replay runs: history, not turns


class V1Face:
    """Serves one connection in ACP v1 on top of its v2 `Agent` (see the module docstring)."""

    def __init__(self, connection: AgentConnection) -> None:
        self._conn = connection
        self._agent: Agent = connection.agent
        self._sessions: dict[str, _SessionView] = {}
        agent_type = type(self._agent)
        self._serves = {
            name: getattr(agent_type, method) is not getattr(Agent, method)
            for name, method in (
                ("load", "resume_session"),
                ("list", "list_sessions"),
                ("resume", "resume_session"),
                ("close", "close_session"),
                ("delete", "delete_session"),
            )
        }
        self._routes: dict[str, Callable[[dict[str, Any], CallContext], Awaitable[Any]]] = {
            m.SESSION_NEW: self._new_session,
            SESSION_LOAD: self._load_session,
            m.SESSION_PROMPT: self._prompt,
            m.SESSION_LIST: self._list_sessions,
            m.SESSION_RESUME: self._resume_session,
            m.SESSION_CLOSE: self._close_session,
            m.SESSION_DELETE: self._delete_session,
        }

    # -- initialize --------------------------------------------------------------------------

    async def initialize(self, params: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """Answer a v1 `initialize` (validated v1 params) from the agent's v2 `initialize`.

        Raises:
            AcpError: the agent's `initialize` refused.
        """
        info = params.get("clientInfo") or UNKNOWN_IMPLEMENTATION
        request = s.InitializeRequest.model_validate({"protocolVersion": 2, "info": info})
        result = to_wire(await self._agent.initialize(request, ctx))
        self._conn.client_info = request
        return initialize_response(
            result,
            load_session=self._serves["load"],
            session_methods=[
                name for name in ("list", "delete", "resume", "close") if self._serves[name]
            ],
        )

    # -- inbound -----------------------------------------------------------------------------

    async def handle_request(
        self, method: str, params: dict[str, Any] | None, ctx: CallContext
    ) -> Any:
        """Serve one v1 request (after `initialize`); returns its v1 result.

        Raises:
            AcpError: the agent's answer was an error, or v1 has no such method here (-32601).
            ValidationError: the params are not valid v1 params (the engine answers -32602).
        """
        route = self._routes.get(method)
        if route is not None:
            return await route(params or {}, ctx)
        if method.startswith("_"):
            return await self._agent.ext_method(method, params, ctx)
        raise MethodNotFound(f"Method not found: {method}")

    async def handle_notification(
        self, method: str, params: dict[str, Any] | None, ctx: CallContext
    ) -> None:
        """Handle one v1 notification: `session/cancel`; extensions go to the agent."""
        if method == m.SESSION_CANCEL:
            try:
                cancel = v1.CancelNotification.model_validate(params or {})
            except ValidationError as exc:
                _logger.warning(
                    "%s: dropped a session/cancel with invalid params (%d errors)",
                    self._conn.id,
                    exc.error_count(),
                )
                return
            await self._cancel(cancel.session_id, ctx)
        elif method != m.CANCEL_REQUEST:
            await self._agent.ext_notification(method, params, ctx)

    def _v2(self, method: str, fields: dict[str, Any]) -> Any:
        return m.AGENT_METHODS[method].params.validate_python(fields)

    async def _new_session(self, params: dict[str, Any], ctx: CallContext) -> Any:
        request = v1.NewSessionRequest.model_validate(params)
        # MCP servers are not passed on: v2's description of them differs, and the agent
        # runtime connects none
        fields: dict[str, Any] = {"cwd": request.cwd}
        if request.additional_directories:
            fields["additionalDirectories"] = request.additional_directories
        result = await self._agent.new_session(self._v2(m.SESSION_NEW, fields), ctx)
        self._sessions.setdefault(result.session_id, _SessionView())
        return {"sessionId": result.session_id}

    async def _load_session(self, params: dict[str, Any], ctx: CallContext) -> Any:
        if not self._serves["load"]:
            raise MethodNotFound("session/load is not supported")
        request = v1.LoadSessionRequest.model_validate(params)
        fields: dict[str, Any] = {
            "sessionId": request.session_id,
            "cwd": request.cwd,
            "replayFrom": {"type": "start"},
        }
        if request.additional_directories:
            fields["additionalDirectories"] = request.additional_directories
        view = self._view(request.session_id)
        view.replaying += 1
        try:
            await self._agent.resume_session(self._v2(m.SESSION_RESUME, fields), ctx)
        finally:
            view.replaying -= 1
        return {}

    async def _resume_session(self, params: dict[str, Any], ctx: CallContext) -> Any:
        if not self._serves["resume"]:
            raise MethodNotFound("session/resume is not supported")
        request = v1.ResumeSessionRequest.model_validate(params)
        fields: dict[str, Any] = {"sessionId": request.session_id, "cwd": request.cwd}
        view = self._view(request.session_id)
        view.replaying += 1  # the state snapshot it sends is not a turn's end
        try:
            await self._agent.resume_session(self._v2(m.SESSION_RESUME, fields), ctx)
        finally:
            view.replaying -= 1
        return {}

    async def _list_sessions(self, params: dict[str, Any], ctx: CallContext) -> Any:
        request = v1.ListSessionsRequest.model_validate(params)
        fields = request.model_dump(by_alias=True, exclude_none=True, include={"cwd", "cursor"})
        result = to_wire(await self._agent.list_sessions(self._v2(m.SESSION_LIST, fields), ctx))
        sessions = [
            {
                name: info[name]
                for name in ("sessionId", "cwd", "title", "updatedAt")
                if name in info
            }
            for info in result.get("sessions", [])
        ]
        answer: dict[str, Any] = {"sessions": sessions}
        if result.get("nextCursor") is not None:
            answer["nextCursor"] = result["nextCursor"]
        return answer

    async def _close_session(self, params: dict[str, Any], ctx: CallContext) -> Any:
        request = v1.CloseSessionRequest.model_validate(params)
        fields = {"sessionId": request.session_id}
        await self._agent.close_session(self._v2(m.SESSION_CLOSE, fields), ctx)
        return {}

    async def _delete_session(self, params: dict[str, Any], ctx: CallContext) -> Any:
        request = v1.DeleteSessionRequest.model_validate(params)
        fields = {"sessionId": request.session_id}
        await self._agent.delete_session(self._v2(m.SESSION_DELETE, fields), ctx)
        return {}

    async def _prompt(self, params: dict[str, Any], ctx: CallContext) -> Any:
        request = v1.PromptRequest.model_validate(params)
        # the v2 request is built from the validated v1 fields only: an `idempotencyKey` the
        # client added is an unknown field in v1, so it never becomes a key
        blocks = [b.model_dump(by_alias=True, exclude_none=True) for b in request.prompt]
        v2_request = self._v2(m.SESSION_PROMPT, {"sessionId": request.session_id, "prompt": blocks})
        view = self._view(request.session_id)
        # the content as the agent stores and broadcasts it: its user_message is not echoed
        try:
            encoded = check_json_strings(
                [b.model_dump(by_alias=True, exclude_unset=True) for b in v2_request.prompt]
            )
        except ValueError as exc:  # a lone surrogate: no store can keep it
            raise InvalidParams(str(exc)) from None
        echo = orjson.loads(encoded)
        view.echoes.append(echo)
        try:
            accepted = await self._agent.prompt(v2_request, ctx)
        except RequestCancelled:
            return _CANCELLED  # withdrawn before insertion by a cancel: v1 says "cancelled"
        finally:
            if echo in view.echoes:
                view.echoes.remove(echo)
        message_id = accepted.message_id
        idle = view.ended.pop(message_id, None)
        if idle is None:
            waiter = view.waiting[message_id] = _Waiter()
            try:
                # No timeout: a turn may run as long as its work takes. The wait ends with the
                # idle update that ends the turn, with a session/cancel from this client, or
                # with the connection, which cancels this handler.
                await waiter.done.wait()
            finally:
                view.waiting.pop(message_id, None)
            idle = waiter.idle or _CANCELLED
        return _prompt_result(idle)

    async def _cancel(self, session_id: str, ctx: CallContext) -> None:
        view = self._sessions.get(session_id)
        waiting = list(view.waiting.values()) if view is not None else []
        await self._agent.cancel(s.CancelSessionNotification(session_id=session_id), ctx)
        # The prompts this client sent before its cancel: their turns were stopped or dropped
        # (a dropped turn never reports its end), so they answer "cancelled" now.
        for waiter in waiting:
            if not waiter.done.is_set():
                waiter.idle = _CANCELLED
                waiter.done.set()

    def turn_ended(self, session_id: str, message_id: str, idle: dict[str, Any]) -> None:
        """The "turn ended" listener this face subscribes to a session's broadcast with: the
        turn of `message_id` ended with the idle update `idle` (its `stopReason`, and `error`
        for a failed turn), and a v1 prompt waiting for it is answered."""
        self._ended(self._view(session_id), message_id, idle)

    # -- outbound ----------------------------------------------------------------------------

    async def session_update(self, session_id: str, update: dict[str, Any]) -> None:
        """Send a v2 `update` of `session_id` to the v1 client, translated, and follow the
        session's turns with it.

        Raises:
            ConnectionClosed: the connection has ended.
        """
        view = self._view(session_id)
        if not view.replaying and not self._follow(view, update):
            return
        for translated in view.translator.translate(update):
            await self._conn.rpc.notify(
                m.SESSION_UPDATE, {"sessionId": session_id, "update": translated}
            )

    async def request_permission(
        self, request: s.RequestPermissionRequest, *, timeout: float | None = None
    ) -> s.RequestPermissionResponse:
        """Ask the v1 client's user for permission (v1's `session/request_permission`).

        Raises:
            AcpError: the client answered with an error.
            ConnectionClosed: the connection ended first.
            RequestTimeout: no answer within `timeout`.
        """
        params = permission_request(to_wire(request), f"permission-{next(_permission_ids)}")
        result = await self._conn.rpc.request(m.SESSION_REQUEST_PERMISSION, params, timeout=timeout)
        try:
            return s.RequestPermissionResponse.model_validate(
                {"outcome": (result or {}).get("outcome")}
            )
        except (ValidationError, AttributeError):
            # an answer that is not one of the two outcomes approves nothing
            return s.RequestPermissionResponse.model_validate({"outcome": {"outcome": "cancelled"}})

    def _view(self, session_id: str) -> _SessionView:
        view = self._sessions.get(session_id)
        if view is None:
            view = self._sessions[session_id] = _SessionView()
        return view

    def _follow(self, view: _SessionView, update: dict[str, Any]) -> bool:
        """Follow the session's turns; False for an update not to send (the echo of this
        client's own prompt)."""
        kind = update.get("sessionUpdate")
        if kind == "user_message":
            message_id = update.get("messageId")
            if isinstance(message_id, str) and message_id != view.current:
                view.queued.append(message_id)
            content = update.get("content")
            if content in view.echoes:
                view.echoes.remove(content)
                return False
        elif kind == "state_update":
            state = update.get("state")
            if state == "running":
                # a new turn: the one before it ended without an idle update of its own
                self._ended(view, view.current, _END_TURN_IDLE)
                view.current = view.queued.popleft() if view.queued else None
            elif state == "idle":
                ended = ended_message(update)
                if ended is not None:  # a turn's end record (A10): that message's turn only
                    self._ended(view, ended, update)
                    if ended == view.current:
                        view.current = None
                    elif ended in view.queued:
                        view.queued.remove(ended)
                    return True
                self._ended(view, view.current, update)
                # idle: no foreground work is left, so no queued turn will run (a cancel
                # dropped them)
                for message_id in view.queued:
                    self._ended(view, message_id, update)
                view.queued.clear()
                view.current = None
        return True

    def _ended(self, view: _SessionView, message_id: str | None, idle: dict[str, Any]) -> None:
        """The first outcome known for a message is kept: `turn_ended` reports it before the
        updates that end the turn arrive."""
        if message_id is None:
            return
        waiter = view.waiting.get(message_id)
        if waiter is not None:
            if not waiter.done.is_set():
                waiter.idle = idle
                waiter.done.set()
            return
        if message_id in view.ended:
            return
        view.ended[message_id] = idle
        while len(view.ended) > _ENDED_KEPT:
            view.ended.popitem(last=False)


def _prompt_result(idle: dict[str, Any]) -> dict[str, Any]:
    """The v1 `session/prompt` result for the idle update that ended its turn.

    Raises:
        AcpError: the turn failed (`stopReason: "error"`): its error, or -32603.
    """
    reason = idle.get("stopReason")
    if reason == "error":
        error = idle.get("error")
        raise (
            error_from_wire(error) if isinstance(error, dict) else InternalError("The turn failed")
        )
    return {"stopReason": v1_stop_reason_from_v2(reason)}
