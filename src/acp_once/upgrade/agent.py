"""`UpgradedAgent`: any v1 stdio agent behind a v2 face that keeps the Idempotency Keys RFD.

The v2 side is a `SessionAgent`, so it owns the timeline and the keys exactly as for our own
agents: a keyed `session/prompt` is stored (the key in the same transaction as the user
message), answered `{messageId}`, and only then does its turn run; `run_turn` forwards the
prompt to the child's v1 `session/prompt`, and the child's stop reason ends the turn. A retry of
a recorded key is answered from the store and never reaches the child.

What crosses between the two sides:

- the child's v1 `session/update`s become v2 updates (`acp_once.upgrade.translate`, on the
  one v1 -> v2 translation, `acp_once.protocol.v1_to_v2`): message chunks are sent live under
  message ids this side assigns, and each whole message is stored for replay; tool calls and
  plans are stored and sent;
- v2 `session/cancel` (or `session/close`) cancels the turn: the child gets v1
  `session/cancel`, its pending permission requests are answered `cancelled`, and its answer
  to the prompt is awaited (bounded) so that its last updates come before the idle state;
- the child's `session/request_permission` goes to a v2 client the session is active on, and
  the answer comes back;
- the child is told its client has no `fs` or `terminal` capabilities (v2 has nothing to
  forward them to), and requests for them are answered -32601.

Sessions: each v2 session has one v1 session in the child, created with it, under an id no
other v2 session has in that child: a child that answers `session/new` (or a load) with an id
it gave another session gets an error for that session (-32603), never a shared route. The v1
session id is kept in the v2 session's timeline as a private marker (never replayed), so it
survives a restart. A v2 session used after the child was restarted (the whole agent SIGKILLed and
started again, or the child alone died) is attached again on its next turn: with v1
`session/load` where the child advertises `loadSession` (the history it replays is dropped:
the store has it already), otherwise with a new v1 session, which has lost the earlier
conversation (logged at WARNING, and the new id recorded). A turn a crash interrupted is
reported once, on resume, as idle with `stopReason: "error"` (`INTERRUPTED_MESSAGE`): it is
never run again, since the child's work is not known to be safe to repeat.

No prompt is live-only here: a text starting with `/` is a command of the child (v1 agents
advertise them), stored and forwarded like any other. Forking is not offered (v1 has no fork).
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, Self

import anyio
import orjson

from acp_once.agent.connection import CallContext
from acp_once.agent.coordinator import Coordinator
from acp_once.agent.runtime import HeldPolicy, SessionAgent, Turn, TurnContext
from acp_once.agent.session import Session
from acp_once.agent.state import TURN_MARKER
from acp_once.protocol import schema as s
from acp_once.protocol.errors import AcpError, InternalError, InvalidParams, MethodNotFound
from acp_once.protocol.v1_to_v2 import v2_stop_reason_from_v1
from acp_once.protocol.vocabulary import Extension, StopReason
from acp_once.rpc.connection import RequestContext
from acp_once.rpc.errors import ConnectionClosed, RequestTimeout
from acp_once.storage.base import SessionStore
from acp_once.upgrade.child import ChildError, V1Child, V1Children
from acp_once.upgrade.translate import (
    Out,
    StoredV1ToV2Updates,
    permission_to_v1,
    permission_to_v2,
    prompt_to_v1,
)

__all__ = ["CHILD_SESSION_STATE", "UpgradedAgent", "V1AgentExited", "V1TurnFailed"]

logger = logging.getLogger("acp_once.upgrade")

CHILD_SESSION_STATE = "v1_session"
"""The `state` of the private timeline marker that records a v2 session's v1 session id."""
_CANCEL_TIMEOUT = 5.0  # seconds the child has to answer a cancelled prompt
_SESSION_TIMEOUT = 60.0  # seconds for the child's session/new or session/load
_CANCELLED = {"outcome": {"outcome": "cancelled"}}
_PROMPT_BLOCKS = ("image", "audio", "embeddedContext")


class V1AgentExited(Exception):
    """The child died during a turn (the turn ends with `stopReason: "error"`)."""


class V1TurnFailed(Exception):
    """The child answered a prompt with an error (the turn ends with `stopReason: "error"`)."""


def _child_session_marker(session_id: str, child_session_id: str) -> bytes:
    return orjson.dumps(
        {
            "sessionUpdate": TURN_MARKER,
            "state": CHILD_SESSION_STATE,
            "sessionId": session_id,
            "childSessionId": child_session_id,
        }
    )


class UpgradedAgent(SessionAgent):
    """A v2 agent whose turns are run by the v1 stdio agent `command` (see the module
    docstring).

    Use as `async with UpgradedAgent(store, command) as agent: await serve_stdio(agent)`:
    entering starts the child and initializes it.

    Args:
        store: where sessions, messages, keys and the v1 session ids live.
        command: the v1 agent's command line.
        policy: "hold" or "steer", as for `SessionAgent` (the child always gets one prompt
            at a time per session: a steered prompt is answered at once and forwarded when
            the turn before it ends).
        compare_prompts: as for `SessionAgent`.
        env: the child's environment (None: ours without our secrets, `ACP_ONCE_TOKEN`).
        cwd: the child's working directory (None: ours).
        ready_timeout: seconds allowed for the child to start and answer `initialize`.
        coordinator: as for `SessionAgent`.
        strict_updates: as for `SessionAgent`.
        group_file: where the child's process group is recorded, so that the next runtime on
            the same store kills it if this one dies without stopping it (see
            `acp_once.upgrade.containment`); None: not recorded.

    Raises:
        ChildError: (on entering) the child could not be started or initialized.
        OSError: (on entering) the group file cannot be opened.
    """

    def __init__(
        self,
        store: SessionStore,
        command: Sequence[str],
        *,
        policy: HeldPolicy = "hold",
        compare_prompts: bool = True,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        ready_timeout: float = 30.0,
        coordinator: Coordinator | None = None,
        strict_updates: bool | None = None,
        group_file: Path | None = None,
    ) -> None:
        super().__init__(
            store,
            policy=policy,
            compare_prompts=compare_prompts,
            resume_interrupted=False,
            name="acp-once-upgrade",
            coordinator=coordinator,
            strict_updates=strict_updates,
        )
        self.children = V1Children(
            command,
            on_request=self._child_request,
            on_notification=self._child_notification,
            env=env,
            cwd=cwd,
            ready_timeout=ready_timeout,
            group_file=group_file,
        )
        self.forwarded = 0
        """Prompts forwarded to the child by this process."""
        self._bound: dict[str, tuple[int, str]] = {}  # session -> (generation, v1 session)
        self._routes: dict[tuple[int, str], str] = {}  # (generation, v1 session) -> session
        self._translators: dict[str, StoredV1ToV2Updates] = {}
        self._mcp_servers: dict[str, list[Any]] = {}  # as the last new/resume gave them
        self._attach_locks: collections.defaultdict[str, anyio.Lock] = collections.defaultdict(
            anyio.Lock
        )
        self._permissions: collections.defaultdict[str, set[anyio.CancelScope]] = (
            collections.defaultdict(set)
        )

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Self]:
        # the child outlives the turns: they end (and cancel theirs) before it is stopped
        async with self.children:
            first = await self.children.current()
            info = first.init_result.get("agentInfo")
            if isinstance(info, dict) and isinstance(info.get("name"), str):
                version = info.get("version")
                self.info = {
                    "name": f"{info['name']} (acp-once upgrade)",
                    "version": version if isinstance(version, str) else self.info["version"],
                }
            async with super().__asynccontextmanager__():
                yield self

    def agent_capabilities(self) -> dict[str, Any]:
        child = self.children.latest
        advertised = child.capabilities.get("promptCapabilities") if child is not None else None
        prompt: dict[str, Any] = {
            name: {}
            for name in _PROMPT_BLOCKS
            if isinstance(advertised, dict) and advertised.get(name) is True
        }
        # no fork: a v1 agent cannot copy its side of a session
        return {"session": {"delete": {}, "prompt": prompt}}

    def _is_live_only(self, prompt: list[Any]) -> bool:
        return False  # a `/command` is the child's: stored and forwarded like any prompt

    # -- sessions ----------------------------------------------------------------------------

    async def new_session(
        self, params: s.NewSessionRequest, ctx: CallContext
    ) -> s.NewSessionResponse:
        mcp_servers = _mcp_servers(params)
        child = await self._child()
        child_session = await self._child_new_session(child, params.cwd, mcp_servers)
        self._check_distinct(child, child_session, None)
        response = await super().new_session(params, ctx)
        session_id = response.session_id
        self._mcp_servers[session_id] = mcp_servers
        self._bind(session_id, child, child_session)
        await self.store.append_update(session_id, _child_session_marker(session_id, child_session))
        return response

    async def resume_session(
        self, params: s.ResumeSessionRequest, ctx: CallContext
    ) -> s.ResumeSessionResponse:
        response = await super().resume_session(params, ctx)
        self._mcp_servers[params.session_id] = _mcp_servers(params)
        return response

    async def close_session(
        self, params: s.CloseSessionRequest, ctx: CallContext
    ) -> s.CloseSessionResponse:
        response = await super().close_session(params, ctx)
        session = self._sessions.get(params.session_id)
        if session is None or not session.conns:
            self._drop_session_state(params.session_id)
        return response

    async def delete_session(
        self, params: s.DeleteSessionRequest, ctx: CallContext
    ) -> s.DeleteSessionResponse:
        response = await super().delete_session(params, ctx)
        bound = self._bound.pop(params.session_id, None)
        if bound is not None:
            self._routes.pop(bound, None)
        self._drop_session_state(params.session_id)
        return response

    def _evict_if_idle(self, session: Session) -> None:
        super()._evict_if_idle(session)
        if session.id not in self._sessions:
            self._drop_session_state(session.id)

    def _drop_session_state(self, session_id: str) -> None:
        """Forget what this side keeps of a session no connection is active on: its
        `mcpServers` (a resume gives them again before its next turn) and its translator. Its
        binding to the child's session stays (two small strings), so that its next turn goes on
        in the same v1 session, even in a child that cannot load one."""
        self._mcp_servers.pop(session_id, None)
        translator = self._translators.get(session_id)
        if translator is not None and not translator.streaming:
            del self._translators[session_id]
        lock = self._attach_locks.get(session_id)
        if lock is not None and not lock.locked():
            del self._attach_locks[session_id]

    async def fork_session(
        self, params: s.ForkSessionRequest, ctx: CallContext
    ) -> s.ForkSessionResponse:
        raise MethodNotFound("session/fork is not offered: the v1 agent cannot fork a session")

    # -- the turn ----------------------------------------------------------------------------

    async def run_turn(self, turn: Turn, emit: TurnContext) -> StopReason | Extension:
        session_id = turn.session_id
        child, child_session = await self._attach_child(session_id)
        wire = [b.model_dump(by_alias=True, exclude_unset=True, mode="json") for b in turn.prompt]
        params = {"sessionId": child_session, "prompt": prompt_to_v1(wire)}
        call = await child.rpc.start_request("session/prompt", params)
        self.forwarded += 1
        try:
            # No timeout: a turn takes as long as the child works. It ends with the child's
            # answer, its death (ConnectionClosed), or a cancel (below).
            result = await call.result()
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._cancel_child_turn(session_id, child, child_session, call)
            raise
        except ConnectionClosed:
            raise V1AgentExited("the v1 agent exited during the turn") from None
        except AcpError as exc:
            # the child answered the prompt with an error: its code is logged, not its text
            # (which could quote anything); the turn ends with stopReason "error"
            raise V1TurnFailed(f"the v1 agent answered the prompt with error {exc.code}") from None
        finally:
            with anyio.CancelScope(shield=True):
                await self._deliver(session_id, self._translator(session_id).finish())
        return v2_stop_reason_from_v1(result)

    async def _cancel_child_turn(
        self, session_id: str, child: V1Child, child_session: str, call: Any
    ) -> None:
        """v1 cancellation: cancel its permission requests, send `session/cancel`, and wait
        (bounded) for its answer to the prompt, so its last updates precede the idle state."""
        for scope in list(self._permissions.get(session_id, ())):
            scope.cancel()
        with anyio.move_on_after(_CANCEL_TIMEOUT):
            with suppress(ConnectionClosed):
                await child.rpc.notify("session/cancel", {"sessionId": child_session})
            with suppress(AcpError, ConnectionClosed):
                await call.result()

    # -- the child's sessions ----------------------------------------------------------------

    async def _child(self) -> V1Child:
        try:
            return await self.children.current()
        except ChildError as exc:
            logger.error("%s", exc)
            raise InternalError("The v1 agent is not available") from None

    async def _child_new_session(self, child: V1Child, cwd: str, mcp_servers: list[Any]) -> str:
        try:
            result = await child.rpc.request(
                "session/new", {"cwd": cwd, "mcpServers": mcp_servers}, timeout=_SESSION_TIMEOUT
            )
        except AcpError as exc:
            raise InternalError(f"The v1 agent refused session/new ({exc.code})") from None
        except (ConnectionClosed, RequestTimeout):
            raise InternalError("The v1 agent did not answer session/new") from None
        child_session = result.get("sessionId") if isinstance(result, dict) else None
        if not isinstance(child_session, str):
            raise InternalError("The v1 agent's session/new answer has no sessionId")
        return child_session

    def _check_distinct(self, child: V1Child, child_session: str, session_id: str | None) -> None:
        """Refuse a v1 session id the child gave another v2 session: the child's updates are
        routed by it, so sharing it would send one session's work into the other's history.

        Raises:
            InternalError: `child_session` is bound to a session other than `session_id`.
        """
        owner = self._routes.get((child.generation, child_session))
        if owner is not None and owner != session_id:
            logger.error(
                "the v1 agent gave session %s the session id it gave %s; refused",
                session_id or "(new)",
                owner,
            )
            raise InternalError("The v1 agent answered with the session id of another session")

    def _bind(self, session_id: str, child: V1Child, child_session: str) -> None:
        self._check_distinct(child, child_session, session_id)
        old = self._bound.get(session_id)
        if old is not None:
            self._routes.pop(old, None)
        self._bound[session_id] = (child.generation, child_session)
        self._routes[(child.generation, child_session)] = session_id

    async def _attach_child(self, session_id: str) -> tuple[V1Child, str]:
        """The live child and the v1 session of `session_id` in it: loaded again, or a new one,
        when the session was bound to an earlier child (or to none in this process)."""
        async with self._attach_locks[session_id]:
            child = await self._child()
            bound = self._bound.get(session_id)
            if bound is not None and bound[0] == child.generation:
                return child, bound[1]
            recorded = bound[1] if bound is not None else await self._recorded(session_id)
            session = self._sessions.get(session_id)
            cwd = session.record.cwd if session is not None else "/"
            mcp_servers = self._mcp_servers.get(session_id, [])
            if recorded is not None:
                self._check_distinct(child, recorded, session_id)
                if child.can_load and await self._load_child_session(
                    child, recorded, cwd, mcp_servers
                ):
                    self._bind(session_id, child, recorded)
                    return child, recorded
                logger.warning(
                    "session %s: the v1 agent %s; it gets a new session, without the earlier "
                    "conversation",
                    session_id,
                    "could not load its session" if child.can_load else "cannot load sessions",
                )
            child_session = await self._child_new_session(child, cwd, mcp_servers)
            self._bind(session_id, child, child_session)  # refused when not distinct
            await self.store.append_update(
                session_id, _child_session_marker(session_id, child_session)
            )
            return child, child_session

    async def _load_child_session(
        self, child: V1Child, child_session: str, cwd: str, mcp_servers: list[Any]
    ) -> bool:
        """v1 `session/load`; the history the child replays meanwhile is not routed anywhere
        (the store has it). False when the child refused or did not answer."""
        params = {"sessionId": child_session, "cwd": cwd, "mcpServers": mcp_servers}
        try:
            await child.rpc.request("session/load", params, timeout=_SESSION_TIMEOUT)
        except (AcpError, ConnectionClosed, RequestTimeout) as exc:
            logger.warning("the v1 agent's session/load failed (%s)", type(exc).__name__)
            return False
        return True

    async def _recorded(self, session_id: str) -> str | None:
        """The v1 session id last recorded in the timeline of `session_id`, if any."""
        found: str | None = None
        after = 0
        while True:
            page = await self.store.read_timeline(session_id, after_seq=after, limit=1000)
            if not page:
                return found
            for entry in page:
                if CHILD_SESSION_STATE.encode() not in entry.update:
                    continue
                update = orjson.loads(entry.update)
                if (
                    update.get("sessionUpdate") == TURN_MARKER
                    and update.get("state") == CHILD_SESSION_STATE
                    and update.get("sessionId") == session_id  # not a fork's copied marker
                    and isinstance(update.get("childSessionId"), str)
                ):
                    found = update["childSessionId"]
            after = page[-1].seq

    # -- what the child sends ----------------------------------------------------------------

    def _translator(self, session_id: str) -> StoredV1ToV2Updates:
        translator = self._translators.get(session_id)
        if translator is None:
            translator = self._translators[session_id] = StoredV1ToV2Updates(f"plan_{session_id}")
        return translator

    async def _child_notification(
        self, child: V1Child, method: str, params: dict[str, Any] | None
    ) -> None:
        if method != "session/update" or not isinstance(params, dict):
            return
        child_session = params.get("sessionId")
        session_id = (
            self._routes.get((child.generation, child_session))
            if isinstance(child_session, str)
            else None
        )
        if session_id is None:
            return  # a session being loaded (its replayed history), or one no longer bound
        await self._deliver(
            session_id, self._translator(session_id).translate(params.get("update"))
        )

    async def _deliver(self, session_id: str, outs: list[Out]) -> None:
        """Store and send translated updates; a failure is logged (by type: a store's text
        could quote anything) and never reaches the child."""
        session = self._sessions.get(session_id)
        for out in outs:
            try:
                if out.mode != "live":
                    encoded = orjson.dumps(out.update)
                    await self.store.append_update(
                        session_id, encoded, message_id=out.update.get("messageId")
                    )
                if out.mode != "store" and session is not None:
                    await self._broadcast(session, out.update)
            except Exception as exc:
                logger.warning(
                    "session %s: an update of the v1 agent was lost (%s)",
                    session_id,
                    type(exc).__name__,
                )

    async def _child_request(
        self, child: V1Child, method: str, params: dict[str, Any] | None, ctx: RequestContext
    ) -> Any:
        if method != "session/request_permission":
            # fs/*, terminal/*: the child was told the client has none of them
            raise MethodNotFound(f"Method not found: {method}")
        params = params or {}
        child_session = params.get("sessionId")
        session_id = (
            self._routes.get((child.generation, child_session))
            if isinstance(child_session, str)
            else None
        )
        session = self._sessions.get(session_id) if session_id is not None else None
        if session_id is None or session is None:
            return _CANCELLED
        try:
            request = s.RequestPermissionRequest.model_validate(
                permission_to_v2(params, session_id)
            )
        except ValueError as exc:  # pydantic's ValidationError is one
            raise InvalidParams(f"The permission request cannot be forwarded: {exc}") from None
        await self._deliver(session_id, self._translator(session_id).announce_permission(params))
        scope = anyio.CancelScope()
        self._permissions[session_id].add(scope)
        try:
            with scope:
                answer = await TurnContext(session.runner).request_permission(request)
                return permission_to_v1(answer.model_dump(by_alias=True, exclude_unset=True))
        finally:
            self._permissions[session_id].discard(scope)
            if not self._permissions[session_id]:
                del self._permissions[session_id]
        return _CANCELLED  # the turn was cancelled meanwhile


def _mcp_servers(params: s.NewSessionRequest | s.ResumeSessionRequest) -> list[Any]:
    wire = params.model_dump(by_alias=True, exclude_unset=True, mode="json")
    servers = wire.get("mcpServers")
    return servers if isinstance(servers, list) else []
