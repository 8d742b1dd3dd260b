"""A session runtime for agent authors: sessions, held prompts and idempotency keys, done right.

Subclass `SessionAgent`, implement `run_turn` (what your agent does with one inserted user
message), and the runtime takes care of the rest of the protocol:

- `session/new`, `session/list`, `session/resume` (with `replayFrom: {"type": "start"}`),
  `session/close`, `session/delete`, `session/fork`, `session/cancel`;
- a session is active on the connections that created or resumed it; elsewhere its
  session-scoped requests get -32002;
- `session/prompt` is answered with `{messageId}` once the user message is inserted; prompts
  that arrive during a turn are held and inserted in arrival order (or, with the steer policy,
  inserted at once);
- keys exactly as the v2 Idempotency Keys RFD says (R18-R41, docs/rules.md): the lookup table
  (nothing recorded / inserted / pending), errors leave the key unused, concurrent requests with
  one new key become one pending prompt, `$/cancel_request` on any of them withdraws it and
  answers all with -32800, scope per session, keys never leave the agent.

The key is written by the store in the same transaction as the message (`insert_user_message`),
so a crash can never keep one without the other. Live-only messages (locally handled commands,
which are not retained) keep their key in memory while the session is active on a connection.

`SessionAgent` is the protocol face and the registry of loaded sessions. A keyed prompt goes
`SessionAgent.prompt` -> the session's `SessionInbox` (`acp_once.agent.inbox`: the key rules
and the insert pipeline) -> its `Placement` (`acp_once.agent.placement`: insert now, hold, or
wait elsewhere) -> the store; the inbox settles it and `prompt` answers. The inserted message's
turn runs in the session's `TurnRunner` (`acp_once.agent.turns`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal, Self

import anyio
import orjson
from anyio.abc import TaskGroup

from acp_once.agent.calls import AgentConnection, CallContext
from acp_once.agent.coordinator import Coordinator
from acp_once.agent.inbox import InboxRules
from acp_once.agent.interface import Agent
from acp_once.agent.placement import LocalPlacement, Placement
from acp_once.agent.session import Session, SessionEvents
from acp_once.agent.state import (
    RECOVER_TIMEOUT,
    RECOVERY_WINDOW,
    RERUN,
    TURN_MARKER,
    Turn,
    last_end,
    marker,
    new_id,
    turn_end,
    unfinished_turns,
    wire_digest,
)
from acp_once.agent.turns import TurnContext, TurnSetup
from acp_once.protocol import schema as s
from acp_once.protocol.errors import (
    InternalError,
    InvalidParams,
    RequestCancelled,
    SessionNotFound,
)
from acp_once.protocol.initialization import PROTOCOL_VERSION, negotiate_version
from acp_once.protocol.limits import check_id, check_json_strings, check_path
from acp_once.protocol.vocabulary import Extension, StopReason
from acp_once.rpc.connection import unwrap_single_exception
from acp_once.rpc.tasks import TaskPool, cancel_scope_factory
from acp_once.storage.base import (
    InvalidCursor,
    SessionRecord,
    SessionStore,
)

__all__ = [
    "INTERRUPTED_MESSAGE",
    "STRICT_ENV",
    "HeldPolicy",
    "SessionAgent",
    "Turn",
    "TurnContext",
]

logger = logging.getLogger("acp_once.agent")

HeldPolicy = Literal["hold", "steer"]

STRICT_ENV = "ACP_ONCE_STRICT"
"""Set to 1: every `SessionAgent` validates the dicts its turns emit (`strict_updates`)."""

INTERRUPTED_MESSAGE = "The agent restarted before the turn finished"
"""The `error.message` of the idle `stopReason: "error"` reported for interrupted work."""
_BASELINE_BLOCKS: tuple[type[Any], ...] = (s.ContentBlockText, s.ContentBlockResourceLink)
"""Every agent accepts these in a prompt (the spec requires both)."""
_OPTIONAL_BLOCKS: dict[str, type[Any]] = {
    "image": s.ContentBlockImage,
    "audio": s.ContentBlockAudio,
    "embeddedContext": s.ContentBlockResource,
}
"""`promptCapabilities` entry -> the content block it lets a prompt carry."""


class SessionAgent(Agent, anyio.AsyncContextManagerMixin):
    """An `Agent` with sessions, held prompts and idempotency keys on a `SessionStore`.

    Use as `async with MyAgent(store) as agent: await serve_stdio(agent)`: the agent owns the
    task group in which turns run, so work can outlive the connection that started it.

    Args:
        store: where sessions, messages and keys live.
        policy: "hold" inserts prompts that arrive during a turn after it, in arrival order;
            "steer" inserts them at once.
        compare_prompts: refuse (-32602) a recorded key sent with a different prompt; off, such
            a request is answered as a retry (both are allowed by the RFD).
        resume_interrupted: the recovery policy (A3). After a restart (or a cluster node's
            takeover), each inserted message whose turn has no end record is run again from
            the start, at most once (`continue`; turns must then be safe to run again, e.g.
            idempotent tools keyed by message id). Off (`report`), its end record is stored
            as idle with `stopReason: "error"` and `INTERRUPTED_MESSAGE`, and every later
            resume replays it. Only the last 500 timeline entries are searched.
        name: the agent's name in what `initialize` reports.
        version: the agent's version in what `initialize` reports.
        coordinator: where held prompts wait and who inserts them
            (`acp_once.agent.coordinator`): None keeps sessions in this process;
            `acp_once.cluster.PostgresCoordinator` shares them with every node on the same
            PostgreSQL store (leases, queued prompts, updates). Subclasses that do not forward
            it may call `use_coordinator`.
        strict_updates: validate every dict a turn emits and refuse an invalid one with
            `ValueError` (for development and tests); None reads `ACP_ONCE_STRICT=1`. Off, the
            first dict of each kind is checked and a bad one logged at WARNING, then sent.
    """

    cooperative_cancel = frozenset({"session/prompt"})
    """A prompt decides for itself what `$/cancel_request` means: withdraw it, or succeed."""

    live_only_prefix = "/"
    """Prompts whose text starts with this are locally handled commands: echoed live, not
    retained, their keys kept in memory while the session is active."""

    def __init__(
        self,
        store: SessionStore,
        *,
        policy: HeldPolicy = "hold",
        compare_prompts: bool = True,
        resume_interrupted: bool = False,
        name: str = "acp-once-agent",
        version: str = "0.1.0",
        coordinator: Coordinator | None = None,
        strict_updates: bool | None = None,
    ) -> None:
        self._base_store = store
        # None: from the environment, so a test suite (or a developer) turns it on everywhere
        self.strict_updates = (
            os.environ.get(STRICT_ENV, "") not in ("", "0")
            if strict_updates is None
            else strict_updates
        )
        self.store = store
        self.policy = policy
        self.compare_prompts = compare_prompts
        self.resume_interrupted = resume_interrupted
        self.info = {"name": name, "version": version}
        self._sessions: dict[str, Session] = {}
        self._accepted_blocks: tuple[type[Any], ...] | None = None  # from agent_capabilities
        self._tg: TaskGroup | None = None
        self._pool: TaskPool | None = None  # the turn workers' (in the task group)
        self._coordinator: Coordinator | None = None
        self._placement: Placement = LocalPlacement(store)
        self._events = SessionEvents(
            self._sessions,
            spawn=self._spawn,
            steer=policy == "steer",
            cancel_work=self._cancel_work,
            recover=self._recover,
        )
        if coordinator is not None:
            self.use_coordinator(coordinator)

    def use_coordinator(self, coordinator: Coordinator) -> None:
        """Share sessions through `coordinator` (before entering the agent); see `__init__`.

        Raises:
            RuntimeError: the agent is entered already.
        """
        if self._tg is not None:
            raise RuntimeError("use_coordinator must be called before the agent is entered")
        self._coordinator = coordinator
        self._placement = coordinator.placement(self._base_store)
        self.store = self._placement.store

    async def ops_status(self) -> dict[str, Any]:
        """What `/ops/status` shows: per node, sessions owned, prompts held, dedup hits."""
        sessions = list(self._sessions.values())
        local = {
            "node": "local",
            "alive": True,
            "sessions_owned": sum(1 for x in sessions if x.runner.running),
            "prompts_held": sum(len(x.inbox.held) for x in sessions),
            "dedup_hits": None,  # counted by the cluster only (it is on the hot path)
        }
        if self._coordinator is not None:
            return await self._coordinator.status(local)
        return {"node": self.info["name"], "nodes": [local]}

    # -- lifecycle -------------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Self]:
        placement = self._placement
        self._rules = InboxRules(
            placement,
            hold=self.policy == "hold",
            compare_prompts=self.compare_prompts,
            live_only=self._is_live_only,
            # looked up at each call, as an attribute: an instance may replace its hooks
            after_insert=lambda sid, mid: self.after_insert(sid, mid),
        )
        self._setup = TurnSetup(
            lambda turn, emit: self.run_turn(turn, emit), placement.store, self.strict_updates
        )
        coordinator = self._coordinator
        try:
            with unwrap_single_exception():
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    self._setup.new_scope = cancel_scope_factory()
                    # One session's turn worker at a time, every busy session's at once: the
                    # loop-wide cap on parked tasks and their age bound this pool, not a
                    # count of its own (8 would start a new task for most turns of a server
                    # whose thousands of sessions all prompt).
                    pool = self._pool = TaskPool(
                        tg, max_idle=TaskPool.max_parked_per_loop, name="turn"
                    )
                    self._setup.pool = lambda: pool
                    if coordinator is not None:
                        await coordinator.start(self._events, tg)
                    try:
                        yield self
                    finally:
                        tg.cancel_scope.cancel()
        finally:
            # after the turns closed their markers
            if coordinator is not None:
                await coordinator.stop()

    # -- what subclasses provide -----------------------------------------------------------

    async def run_turn(self, turn: Turn, emit: TurnContext) -> StopReason | Extension:
        """Work on one inserted message; return the stop reason ("end_turn", ...): a
        `StopReason`, or an extension (`acp_once.protocol.vocabulary.extension("_mine")`).
        In strict mode any other value ends the turn with "error".

        Runs in the agent's task group, so it may outlive the connection that sent the prompt.
        It is cancelled by `session/cancel` and `session/close` (report "cancelled" then).
        """
        return "end_turn"

    async def after_insert(self, session_id: str, message_id: str) -> None:
        """Called right after a user message is committed, before anyone is answered.

        A hook for instrumentation and for fault injection in tests.
        """
        return None

    def agent_capabilities(self) -> dict[str, Any]:
        """What `initialize` advertises. `session.prompt` (`image`, `audio`,
        `embeddedContext`) also decides which content blocks `session/prompt` accepts beyond
        text and resource links; any other is refused with -32602."""
        return {"session": {"delete": {}, "fork": {}}}

    def _is_live_only(self, prompt: list[Any]) -> bool:
        first = prompt[0] if prompt else None
        return isinstance(first, s.ContentBlockText) and first.text.startswith(
            self.live_only_prefix
        )

    def _prompt_blocks(self) -> tuple[type[Any], ...]:
        # read once: the capabilities a client saw at initialize are the ones enforced
        if self._accepted_blocks is None:
            session = self.agent_capabilities().get("session") or {}
            advertised = session.get("prompt") or {}
            self._accepted_blocks = _BASELINE_BLOCKS + tuple(
                block
                for name, block in _OPTIONAL_BLOCKS.items()
                if advertised.get(name) is not None
            )
        return self._accepted_blocks

    # -- initialize, sessions ----------------------------------------------------------------

    async def initialize(
        self, params: s.InitializeRequest, ctx: CallContext
    ) -> s.InitializeResponse:
        version = negotiate_version(params.protocol_version, [PROTOCOL_VERSION])
        return s.InitializeResponse.model_validate(
            {
                "protocolVersion": version,
                "info": self.info,
                "capabilities": self.agent_capabilities(),
                # No capability exists for keys (every v2 agent must honour them); this tells
                # acp-once clients that this one really does.
                "_meta": {"acpOnce": {"idempotencyKeys": True}},
            }
        )

    async def new_session(
        self, params: s.NewSessionRequest, ctx: CallContext
    ) -> s.NewSessionResponse:
        _check_paths(params.cwd, params.additional_directories)
        now = time.time()
        record = SessionRecord(
            session_id=new_id("sess"),
            cwd=params.cwd,
            additional_directories=tuple(params.additional_directories or ()),
            title=None,
            created_at=now,
            updated_at=now,
            tenant=ctx.connection.tenant,
        )
        await self.store.create_session(record)
        session = self._register(record)
        self._attach(session, ctx.connection)
        return s.NewSessionResponse(session_id=record.session_id)

    async def list_sessions(
        self, params: s.ListSessionsRequest, ctx: CallContext
    ) -> s.ListSessionsResponse:
        if params.cwd is not None:
            _check_paths(params.cwd, None)
        if params.cursor is not None:
            _check_paths(params.cursor, None, field="cursor")  # opaque, but decoded by stores
        try:
            # the store filters, so a page is never short of the caller's own sessions
            records, next_cursor = await self.store.list_sessions(
                cwd=params.cwd, cursor=params.cursor, tenant=ctx.connection.tenant
            )
        except InvalidCursor:
            raise InvalidParams("The cursor is not valid") from None
        sessions = [
            {
                "sessionId": r.session_id,
                "cwd": r.cwd,
                **({"title": r.title} if r.title else {}),
                "updatedAt": _iso(r.updated_at),
            }
            for r in records
        ]
        result: dict[str, Any] = {"sessions": sessions}
        if next_cursor is not None:
            result["nextCursor"] = next_cursor
        return s.ListSessionsResponse.model_validate(result)

    async def resume_session(
        self, params: s.ResumeSessionRequest, ctx: CallContext
    ) -> s.ResumeSessionResponse:
        replay = params.replay_from
        if replay is not None and not isinstance(replay, s.ReplayFromStartModel):
            raise InvalidParams("Unsupported replayFrom cursor")
        _check_ids(params.session_id)
        _check_paths(params.cwd, params.additional_directories)
        session = await self._load(params.session_id, ctx.connection)
        session.users += 1  # no await since `_load` returned: it cannot have been evicted
        try:
            await self._resume_on(session, ctx.connection, replay is not None)
        finally:
            session.users -= 1
            self._evict_if_idle(session)
        return s.ResumeSessionResponse()

    async def _resume_on(self, session: Session, conn: AgentConnection, replay: bool) -> None:
        if replay:
            after = 0
            while True:
                page = await self.store.read_timeline(session.id, after_seq=after, limit=500)
                if not page:
                    break
                for entry in page:
                    update = orjson.loads(entry.update)
                    if update.get("sessionUpdate") == TURN_MARKER:
                        continue
                    await conn.client.session_update({"sessionId": session.id, "update": update})
                after = page[-1].seq
        self._attach(session, conn)
        await conn.client.session_update({"sessionId": session.id, "update": self._state(session)})

    async def close_session(
        self, params: s.CloseSessionRequest, ctx: CallContext
    ) -> s.CloseSessionResponse:
        session = self._sessions.get(params.session_id)
        conn = ctx.connection
        if session is None or conn.id not in session.conns:
            return s.CloseSessionResponse()  # idempotent: missing or inactive succeeds
        session.inbox.cancel_marks[conn.id] = conn.rpc.arrivals
        await self._cancel_work(session)
        session.broadcast.detach(conn.id)
        self._forget_live_keys(session)
        return s.CloseSessionResponse()

    async def delete_session(
        self, params: s.DeleteSessionRequest, ctx: CallContext
    ) -> s.DeleteSessionResponse:
        _check_ids(params.session_id)
        session = self._sessions.get(params.session_id)
        record = (
            session.record
            if session is not None
            else await self.store.get_session(params.session_id)
        )
        if record is None or not _owns(record, ctx.connection):
            # Another tenant's session gets the answer a missing one gets (success: delete is
            # idempotent), and stays as it is.
            return s.DeleteSessionResponse()
        session = self._sessions.pop(params.session_id, None)
        if session is not None:
            await self._cancel_work(session)
        await self.store.delete_session(params.session_id)
        return s.DeleteSessionResponse()

    async def fork_session(
        self, params: s.ForkSessionRequest, ctx: CallContext
    ) -> s.ForkSessionResponse:
        source = self._active(params.session_id, ctx.connection)
        _check_paths(params.cwd, params.additional_directories)
        now = time.time()
        record = SessionRecord(
            session_id=new_id("sess"),
            cwd=params.cwd,
            additional_directories=tuple(params.additional_directories or ()),
            title=source.record.title,
            created_at=now,
            updated_at=now,
            forked_from=source.id,
            tenant=source.record.tenant,  # a fork belongs to its source's tenant
        )
        await self.store.fork_session(source.id, record)  # copies history, never keys
        session = self._register(record)
        self._attach(session, ctx.connection)
        return s.ForkSessionResponse(session_id=record.session_id)

    async def cancel(self, params: s.CancelSessionNotification, ctx: CallContext) -> None:
        session = self._sessions.get(params.session_id)
        if session is None or ctx.connection.id not in session.conns:
            return
        # covers prompts that arrived before this notification, even those not handled yet
        session.inbox.cancel_marks[ctx.connection.id] = ctx.connection.rpc.arrivals
        await self._cancel_work(session)

    async def connection_closed(self, connection: AgentConnection) -> None:
        for session in list(self._sessions.values()):
            attached = session.broadcast.detach(connection.id)
            session.inbox.connection_gone(connection.id)
            if attached and not session.conns:
                self._forget_live_keys(session)
            self._evict_if_idle(session)

    # -- prompts -----------------------------------------------------------------------------

    async def prompt(self, params: s.PromptRequest, ctx: CallContext) -> s.PromptResponse:
        accepted = self._prompt_blocks()
        for block in params.prompt:
            if not isinstance(block, accepted):
                raise InvalidParams("Unsupported content block type in prompt")
        key = params.idempotency_key
        conn = ctx.connection
        if key is None:
            # covered by a later session/cancel: -32800 at once (a keyed one is looked up
            # first, by the inbox: its key may be in use)
            known = self._sessions.get(params.session_id)
            if known is not None and known.inbox.covered(conn.id, ctx.request):
                raise RequestCancelled("The prompt was cancelled before insertion")
        session = self._active(params.session_id, conn)
        # The stored copy must be JSON data: in Python mode a resource link's `uri` is an
        # `AnyUrl`, which orjson cannot write (it was -32603 "could not be stored"). Encoded
        # once with `str` for such values, which also refuses a lone surrogate anywhere (no
        # store can keep one; pydantic's JSON mode would silently turn one in a key into
        # U+FFFD), and read back as the wire form.
        dumped = [b.model_dump(by_alias=True, exclude_unset=True) for b in params.prompt]
        try:
            wire: list[dict[str, Any]] = orjson.loads(check_json_strings(dumped))
        except ValueError as exc:
            raise InvalidParams(str(exc)) from None
        # only keyed prompts compare digests; a placement that needs an unkeyed one's digest
        # computes it from the pending prompt
        digest = wire_digest(wire) if key is not None else None
        message_id = await session.inbox.submit(
            list(params.prompt), wire, key, digest, conn.id, ctx.request
        )
        return s.PromptResponse(message_id=message_id)

    # -- sessions in memory --------------------------------------------------------------------

    def _register(self, record: SessionRecord) -> Session:
        """A session loaded or created in this process, registered by its id."""
        coordinator = self._coordinator
        session = Session(
            record,
            self._rules,
            self._setup,
            remote=coordinator.publish if coordinator is not None else None,
            on_stop=self._evict_if_idle,
        )
        if type(self)._broadcast is not SessionAgent._broadcast:
            # a subclass rewrites what its sessions send
            session.runner.publish = functools.partial(self._broadcast, session)
        self._sessions[record.session_id] = session
        return session

    async def _broadcast(self, session: Session, update: dict[str, Any]) -> None:
        """Send one update of `session` through its broadcast (here and, in a cluster, on
        the other nodes); a subclass may override it to rewrite what goes out."""
        await session.broadcast.send(update)

    async def _handle_unfinished(self, session: Session, unfinished: list[Turn]) -> None:
        """Deal with the turns an earlier process (or a node whose lease expired) left
        without an end record (A3): one that never started (queued) is simply run; with
        `resume_interrupted`, run each again once (a
        `RERUN` marker stored first); otherwise, or when it ran again once already, store its
        interrupted end record (`stopReason: "error"`, `INTERRUPTED_MESSAGE`), once: a later
        load finds it ended."""
        if not unfinished:
            return
        runner = session.runner
        again: list[Turn] = []
        for turn in unfinished:
            if turn.queued:  # it never started: simply run (its STARTED marker first)
                again.append(turn)
                continue
            if self.resume_interrupted and not turn.reran:
                try:
                    await self.store.append_update(session.id, marker(RERUN, turn.message_id))
                except Exception as exc:  # unmarked, it could run a third time: reported
                    logger.warning(
                        "session %s: an unfinished turn is reported, not run again (%s)",
                        session.id,
                        type(exc).__name__,
                    )
                else:
                    again.append(turn)
                    continue
            error = InternalError(INTERRUPTED_MESSAGE).to_wire()
            await runner.end_unrun(turn_end(turn.message_id, "error", error))
        if again:
            runner.resume(again)

    async def _recover(self, session: Session) -> int:
        """Find the session's turns an earlier owner left unfinished, and deal with them;
        return how many there were."""
        tail = await self.store.read_timeline_tail(session.id, limit=RECOVERY_WINDOW)
        unfinished = unfinished_turns(session.id, tail)
        await self._handle_unfinished(session, unfinished)
        return len(unfinished)

    def _forget_live_keys(self, session: Session) -> None:
        if not session.conns:
            session.inbox.live_keys.clear()  # R36: live-only keys last while the session is active

    def _state(self, session: Session) -> dict[str, Any]:
        coordinator = self._coordinator
        if session.runner.busy() or (
            coordinator is not None and coordinator.running_elsewhere(session.id)
        ):
            return {"sessionUpdate": "state_update", "state": "running"}
        # idle: the end record of the last turn, as it was sent (A10)
        return session.broadcast.last_end or {"sessionUpdate": "state_update", "state": "idle"}

    async def _cancel_work(self, session: Session) -> None:
        await session.inbox.cancel_all()
        await session.runner.cancel()

    def _attach(self, session: Session, conn: AgentConnection) -> None:
        session.broadcast.attach(conn)

    def _active(self, session_id: str, conn: AgentConnection) -> Session:
        session = self._sessions.get(session_id)
        # Ownership is also checked here, though a session becomes active on a connection only
        # through new, resume or fork, which check it: a tenant never reaches another's.
        if session is None or conn.id not in session.conns or not _owns(session.record, conn):
            raise SessionNotFound(session_id)
        return session

    async def _load(self, session_id: str, conn: AgentConnection) -> Session:
        """The session, from memory or loaded from the store (its interrupted turns
        recovered), for `conn`.

        Raises:
            SessionNotFound: no such session, or another tenant's: refused before it is
                loaded, so a request of another tenant's recovers nothing.
        """
        session = self._sessions.get(session_id)
        if session is not None:
            if not _owns(session.record, conn):
                raise SessionNotFound(session_id)
            return session
        record = await self.store.get_session(session_id)
        if record is None or not _owns(record, conn):
            raise SessionNotFound(session_id)
        tail = await self.store.read_timeline_tail(session_id, limit=RECOVERY_WINDOW)
        loaded = self._sessions.get(session_id)
        if loaded is not None:  # another request loaded it meanwhile
            return loaded
        session = self._register(record)
        session.broadcast.last_end = last_end(tail)
        unfinished = unfinished_turns(session_id, tail)
        if unfinished:
            # Shielded (bounded): the session is registered now, so this is the one chance to
            # deal with its interrupted turns; a request cancelled half-way (its connection
            # closed) must not leave them neither run nor reported until the next restart.
            session.users += 1  # not evicted while it recovers: its caller has not attached
            try:
                with anyio.move_on_after(RECOVER_TIMEOUT, shield=True) as scope:
                    # only where this process may (a cluster takes the lease first); then the
                    # worker drains what waits and lets the lease go
                    if await session.inbox.claim():
                        await self._handle_unfinished(session, unfinished)
                        if self._placement.holds(session_id):
                            session.runner.start()
            finally:
                session.users -= 1
            if scope.cancelled_caught:
                logger.warning("session %s: recovering interrupted turns timed out", session_id)
        return session

    def _spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run `fn(*args)` in the agent's task group; a failure is logged, never raised."""
        if self._tg is not None:
            self._tg.start_soon(_guarded, fn, *args)

    def _evict_if_idle(self, session: Session) -> None:
        """Drop `session` from memory when nothing holds it there (`Session.idle`) and this
        process holds no claim on it (`Placement.holds`: a cluster's lease); it reloads from
        the store on resume. Otherwise `_sessions` grew by every session ever resumed."""
        if (
            session.idle()
            and not self._placement.holds(session.id)
            and self._sessions.get(session.id) is session
        ):
            del self._sessions[session.id]


async def _guarded(fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
    # a background step that fails must never take the agent's task group down
    try:
        await fn(*args)
    except Exception:
        logger.exception("a background step of the agent failed")


def _check_paths(cwd: str, additional: list[str] | None, field: str = "cwd") -> None:
    """-32602 for a path no store can keep (`acp_once.protocol.limits`), before any write."""
    try:
        check_path(cwd, field)
        for path in additional or ():
            check_path(path, "additionalDirectories")
    except ValueError as exc:
        raise InvalidParams(str(exc)) from None


def _owns(record: SessionRecord, conn: AgentConnection) -> bool:
    """Whether `conn` may see the session of `record`: the one tenant rule. A session belongs
    to the tenant that created it; a connection without a tenant (stdio, a single token) sees
    only sessions created without one. Every other session is answered as if it did not
    exist (-32002, or what a missing session gets), so a tenant cannot tell it is there."""
    return record.tenant == conn.tenant


def _check_ids(value: str, field: str = "sessionId") -> None:
    """-32602 for an id no store can look up (`acp_once.protocol.limits`)."""
    try:
        check_id(value, field)
    except ValueError as exc:
        raise InvalidParams(str(exc)) from None


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
