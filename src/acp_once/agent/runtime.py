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

Concurrency: each session's state changes happen without awaiting in between, or under the
session's lock around the store write; "inserted" (the store commit) is the point after which a
prompt can no longer be withdrawn.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal, Self

import anyio
import orjson
from anyio.abc import TaskGroup
from pydantic import BaseModel

from acp_once.agent.connection import AgentSideConnection, CallContext
from acp_once.agent.coordinator import Coordinator, LocalCoordinator
from acp_once.agent.interface import Agent
from acp_once.agent.state import (
    RECOVER_TIMEOUT,
    RECOVERY_WINDOW,
    TURN_MARKER,
    PendingPrompt,
    Session,
    Turn,
    marker,
    new_id,
    unfinished_turns,
    wire_digest,
)
from acp_once.agent.updates import check_update, tool_call, tool_call_update
from acp_once.protocol import schema as s
from acp_once.protocol.errors import (
    AcpError,
    InternalError,
    InvalidParams,
    RequestCancelled,
    SessionNotFound,
    key_reused,
)
from acp_once.protocol.initialization import PROTOCOL_VERSION, negotiate_version
from acp_once.protocol.jsonrpc import encode_notification
from acp_once.protocol.limits import check_id, check_json_strings, check_path
from acp_once.protocol.methods import SESSION_UPDATE
from acp_once.rpc.connection import unwrap_single_exception
from acp_once.rpc.errors import ConnectionClosed
from acp_once.rpc.tasks import TaskPool, cancel_scope_factory
from acp_once.storage.base import (
    FencingError,
    InsertOutcome,
    InvalidCursor,
    KeyRecord,
    SessionMissing,
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

_STOP_TIMEOUT = 10.0
_LANDED_TIMEOUT = 10.0  # seconds: looking up whether a failed insert was stored, shielded
_LANDED_WINDOW = 100  # timeline entries searched for an unkeyed message after a failed insert
STRICT_ENV = "ACP_ONCE_STRICT"
"""Set to 1: every `SessionAgent` validates the dicts its turns emit (`strict_updates`)."""

INTERRUPTED_MESSAGE = "The agent restarted before the turn finished"
"""The `error.message` of the idle `stopReason: "error"` reported for interrupted work."""
_DROPPED_IDLE = {"sessionUpdate": "state_update", "state": "idle", "stopReason": "cancelled"}
"""How a queued turn that a cancel dropped ended (it never ran)."""
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
        resume_interrupted: after a restart, run the turns of inserted messages whose turn did
            not finish (the RFD leaves this to the agent). Off, such work is reported once as
            idle with `stopReason: "error"` and `INTERRUPTED_MESSAGE`. Turns must then be safe
            to run again from the start (e.g. idempotent tools keyed by message id). Only the
            last 500 timeline entries are searched.
        name: the agent's name in what `initialize` reports.
        version: the agent's version in what `initialize` reports.
        coordinator: where held prompts wait and who inserts them
            (`acp_once.agent.coordinator`): None or a `LocalCoordinator` keeps sessions in
            this process; `acp_once.cluster.PostgresCoordinator` shares them with every node on
            the same PostgreSQL store (leases, queued prompts, updates). Subclasses that do not
            forward it may call `use_coordinator`.
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
        self._new_scope: Callable[[], anyio.CancelScope] = anyio.CancelScope
        self._pool: TaskPool | None = None  # the task group's, looked up once (a weak dict)
        self._coordinator: Coordinator = LocalCoordinator()
        self._host = _Host(self)
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
        self.store = coordinator.wrap_store(self._base_store)

    async def ops_status(self) -> dict[str, Any]:
        """What `/ops/status` shows: per node, sessions owned, prompts held, dedup hits."""
        return await self._coordinator.status()

    # -- lifecycle -------------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Self]:
        try:
            with unwrap_single_exception():
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    self._new_scope = cancel_scope_factory()
                    self._pool = TaskPool.of(tg)
                    await self._coordinator.start(self._host, tg)
                    try:
                        yield self
                    finally:
                        tg.cancel_scope.cancel()
        finally:
            # after the turns closed their markers
            await self._coordinator.stop()

    # -- what subclasses provide -----------------------------------------------------------

    async def run_turn(self, turn: Turn, emit: TurnContext) -> str:
        """Work on one inserted message; return the stop reason ("end_turn", ...).

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
        session = Session(record)
        self._sessions[record.session_id] = session
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

    async def _resume_on(self, session: Session, conn: AgentSideConnection, replay: bool) -> None:
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
        session.interrupted = False

    async def close_session(
        self, params: s.CloseSessionRequest, ctx: CallContext
    ) -> s.CloseSessionResponse:
        session = self._sessions.get(params.session_id)
        conn = ctx.connection
        if session is None or conn.id not in session.conns:
            return s.CloseSessionResponse()  # idempotent: missing or inactive succeeds
        session.cancel_marks[conn.id] = conn.rpc.arrivals
        await self._cancel_work(session)
        session.conns.pop(conn.id, None)
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
        session = Session(record)
        self._sessions[record.session_id] = session
        self._attach(session, ctx.connection)
        return s.ForkSessionResponse(session_id=record.session_id)

    async def cancel(self, params: s.CancelSessionNotification, ctx: CallContext) -> None:
        session = self._sessions.get(params.session_id)
        if session is None or ctx.connection.id not in session.conns:
            return
        # covers prompts that arrived before this notification, even those not handled yet
        session.cancel_marks[ctx.connection.id] = ctx.connection.rpc.arrivals
        await self._cancel_work(session)

    async def connection_closed(self, connection: AgentSideConnection) -> None:
        for session in list(self._sessions.values()):
            # no request of a closed connection arrives any more: its mark would only pile up
            session.cancel_marks.pop(connection.id, None)
            if session.conns.pop(connection.id, None) is None:
                self._evict_if_idle(session)
                continue
            # D11: a held prompt stays held while a request for it waits on a live connection;
            # otherwise nobody can hear its answer, so it is withdrawn and its key stays unused.
            for pending in list(session.held):
                pending.waiters = [w for w in pending.waiters if w[0] != connection.id]
                if not pending.waiters:
                    if self._coordinator.detach(session, pending):
                        continue  # the coordinator keeps it: other nodes may still wait on it
                    self._withdraw(session, pending)
            if not session.conns:
                self._forget_live_keys(session)
            self._evict_if_idle(session)

    # -- prompts -----------------------------------------------------------------------------

    async def prompt(self, params: s.PromptRequest, ctx: CallContext) -> s.PromptResponse:
        accepted = self._prompt_blocks()
        for block in params.prompt:
            if not isinstance(block, accepted):
                raise InvalidParams("Unsupported content block type in prompt")
        key = params.idempotency_key
        if key is None:
            # covered by a later session/cancel: -32800 at once (a keyed one is looked up
            # first, below: its key may be in use)
            self._check_cancel_mark(params.session_id, ctx)
        session = self._active(params.session_id, ctx.connection)
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
        # only keyed prompts compare digests; a coordinator that needs an unkeyed one's digest
        # computes it from the pending prompt
        digest = wire_digest(wire) if key is not None else None
        conn_id = ctx.connection.id
        pending: PendingPrompt | None = None
        async with session.lock:
            hold = self._would_hold(session)
            if key is not None:
                recorded = session.live_keys.get(key)
                if recorded is not None:
                    return s.PromptResponse(message_id=recorded)
                pending = session.pending_by_key.get(key)
                if pending is None and (
                    hold
                    or self._is_live_only(params.prompt)
                    or self._cancel_marked(session.id, ctx)
                ):
                    # It would be held (or not stored): look for an inserted message first, so
                    # a retry of it is answered now instead of queued. A prompt inserted at
                    # once needs no lookup: the store's insert answers for a recorded key.
                    # Covered by a session/cancel that arrived after it, a retry of a key in
                    # use gets its id too: -32800 would say the key is unused (R19).
                    found = await self.store.find_key(session.id, key)
                    if found is not None:
                        self._check_digest(found.prompt_digest, digest)
                        return s.PromptResponse(message_id=found.message_id)
                    pending = session.pending_by_key.get(key)  # the lookup awaited
                    hold = self._would_hold(session)
            if pending is None:
                # no await from this check to the queueing below: a session/cancel or close
                # that ran while this waited for the lock or the lookup is seen here (D33). A
                # request joining a pending prompt gets that prompt's outcome, which a cancel
                # decides for every request of the key alike (R26, R27).
                self._check_cancel_mark(session.id, ctx)
            if pending is not None:
                self._check_digest(pending.digest, digest)
                pending.waiters.append((conn_id, ctx.request))
            else:
                pending = PendingPrompt(session.id, list(params.prompt), key, wire, _digest=digest)
                pending.waiters.append((conn_id, ctx.request))
                if key is not None:
                    session.pending_by_key[key] = pending
                try:
                    await self._coordinator.admit(session, pending, hold=hold)
                except BaseException:
                    self._abandon(session, pending)
                    raise
        # No timeout here: a held prompt may wait as long as the turn before it runs. The wait
        # ends with insertion, a withdrawal ($/cancel_request, session/cancel, session/close),
        # or the end of the connection, which cancels this handler. Inserted at once (the
        # common case): answer now, without a trip through the event loop, and with no cancel
        # callback (a cancel of an answered prompt changes nothing, R27).
        if pending.state != "done":
            if ctx.request is not None:
                request = ctx.request
                request.on_cancel(lambda: self._on_cancel_request(session, pending))
            await pending.done.wait()
        if pending.error is not None:
            raise pending.error
        assert pending.message_id is not None
        return s.PromptResponse(message_id=pending.message_id)

    def _would_hold(self, session: Session) -> bool:
        """A prompt arriving now is held: a turn runs (hold policy), or others wait already."""
        return (session.running and self.policy == "hold") or bool(session.held)

    def _cancel_marked(self, session_id: str, ctx: CallContext) -> bool:
        """A session/cancel or session/close that arrived after this request covers it."""
        session = self._sessions.get(session_id)
        if session is None or ctx.request is None:
            return False
        return session.cancel_marks.get(ctx.connection.id, -1) > ctx.request.seq

    def _check_cancel_mark(self, session_id: str, ctx: CallContext) -> None:
        if self._cancel_marked(session_id, ctx):
            raise RequestCancelled("The prompt was cancelled before insertion")

    def _reuses_key(self, recorded: bytes | None, digest: bytes | None) -> bool:
        """Whether a prompt whose digest is `digest` must be refused because its key is
        recorded (or queued) with the digest `recorded` of another prompt (R23, when
        `compare_prompts` is on; None: no digest to compare)."""
        return (
            self.compare_prompts
            and recorded is not None
            and digest is not None
            and recorded != digest
        )

    def _check_digest(self, recorded: bytes | None, digest: bytes | None) -> None:
        if self._reuses_key(recorded, digest):
            raise key_reused()

    def _on_cancel_request(self, session: Session, pending: PendingPrompt) -> None:
        # R25/R26: a cancel for any request of the key withdraws an un-inserted prompt and
        # answers every request for it with -32800; once inserting, insertion wins (R27).
        if pending.state == "held":
            self._withdraw(session, pending)

    def _abandon(self, session: Session, pending: PendingPrompt) -> None:
        """Its admission was cancelled (the connection closed) or raised: a prompt registered
        by its key must still end. One neither queued nor being inserted is settled -32800
        with its key unused; nobody else waits on it (joining takes the session lock, which
        its admission holds). A queued or inserting one is left to its own outcome."""
        if pending.state == "held" and pending not in session.held:
            session.settle(
                pending, error=RequestCancelled("The prompt was cancelled before insertion")
            )

    def _withdraw(
        self, session: Session, pending: PendingPrompt, error: AcpError | None = None
    ) -> None:
        if pending.state != "held":
            return
        if self._coordinator.withdraw(session, pending, error):
            return  # the coordinator keeps it elsewhere: withdrawn there, answered with its outcome
        session.settle(
            pending, error=error or RequestCancelled("The prompt was withdrawn before insertion")
        )

    async def _insert(self, session: Session, pending: PendingPrompt) -> None:
        """Insert under the session lock: the store commit is the point of no return."""
        pending.state = "inserting"
        message_id = new_id("msg_user")
        live_only = self._is_live_only(pending.prompt)
        update = {
            "sessionUpdate": "user_message",
            "messageId": message_id,
            "content": pending.wire,
        }
        try:
            if live_only:
                if pending.key is not None:
                    session.live_keys[pending.key] = message_id
                inserted = True
            else:
                outcome = await self._coordinator.insert_message(
                    self.store,
                    session.id,
                    pending,
                    message_id=message_id,
                    update=orjson.dumps(update),
                )
                inserted = outcome.inserted
                message_id = outcome.message_id
        except anyio.get_cancelled_exc_class():
            # The connection that sent it closed, which cancels its handler here (a
            # `$/cancel_request` does not: `_on_cancel_request` leaves an inserting prompt
            # alone, R27). A store lets a cancellation out of its insert only before anything
            # was committed (`SessionStore.insert_user_message`; group commit withdraws a
            # write still queued), so the prompt was not inserted. It must still end, or a
            # resend of its key would join it and wait forever (D11): withdrawn, key unused.
            self._unregister(session, pending)
            pending.finish(error=RequestCancelled("The prompt was withdrawn before insertion"))
            raise
        except Exception as exc:
            if isinstance(exc, FencingError):  # a cluster race (lease moved, row withdrawn)
                logger.debug("session %s: insert refused (%s)", session.id, exc)
            else:
                logger.exception("session %s: storing a user message failed", session.id)
            # Refused or failed, the key may be recorded all the same: by this insert (its
            # commit landed, its answer was lost), or by the node that took the session over
            # while this one stalled (a fencing refusal). An error would tell the client the
            # key is unused (R19); a read needs no lease, so look.
            found = await self._find_after_failure(session, pending, message_id)
            if found is None:
                self._unregister(session, pending)
                pending.finish(error=InternalError("The message could not be stored"))
                return
            # The store failed but the message is there: the commit landed and only its answer
            # was lost (a connection cut at COMMIT), or another process inserted this key.
            inserted = found.message_id == message_id
            outcome = InsertOutcome(found.message_id, inserted, found.prompt_digest)
            message_id = found.message_id
        self._unregister(session, pending)
        if not inserted:
            # The key was recorded already (by an earlier attempt, or another process): answer
            # as a retry, or refuse a different prompt; nothing new was inserted (R19, R23).
            if self._reuses_key(outcome.prompt_digest, pending.digest):
                pending.finish(error=key_reused())
            else:
                pending.finish(message_id=message_id)
            return
        # Stored: from here on its turn must run and it must be answered, even if this handler
        # is cancelled (its connection closed) in one of the two awaits below. Otherwise the
        # message would stay stored with no work started, and a keyed retry would be answered
        # with its id as if all was well (R19). Once inserting, insertion wins (R27).
        try:
            try:
                await self.after_insert(session.id, message_id)
            except Exception:  # a hook's failure is not the prompt's: it was inserted
                logger.exception("session %s: after_insert failed", session.id)
            pending.finish(message_id=message_id)
            await self._broadcast(session, update)
        finally:
            pending.finish(message_id=message_id)
            session.turns.append(Turn(session.id, message_id, pending.prompt, live_only))
            self._ensure_worker(session)

    @staticmethod
    def _unregister(session: Session, pending: PendingPrompt) -> None:
        """A later request with its key no longer joins `pending` (it has its outcome)."""
        if pending.key is not None and session.pending_by_key.get(pending.key) is pending:
            del session.pending_by_key[pending.key]

    async def _find_after_failure(
        self, session: Session, pending: PendingPrompt, message_id: str
    ) -> KeyRecord | None:
        """After an insert that raised or was refused: where the store has the message after
        all, its key's record (or, unkeyed, `message_id` itself); None if it is not stored or
        the lookup failed too.

        A failed insert may have committed (PostgreSQL's connection lost at COMMIT, an insert
        past its bound). Answering it with an error would leave a stored message whose turn
        runs only at the session's next recovery, while a keyed retry is answered with its id
        as if all was well. A keyed message is looked up by its key; an unkeyed one among the
        last entries of the timeline (this node holds the session lock: it is near the end).
        Shielded and bounded, as the insert itself: a cut connection must not stop it.
        """
        with anyio.move_on_after(_LANDED_TIMEOUT, shield=True):
            try:
                if pending.key is not None:
                    return await self.store.find_key(session.id, pending.key)
                tail = await self.store.read_timeline_tail(session.id, limit=_LANDED_WINDOW)
            except Exception as exc:  # its text could quote the key: only its type is logged
                logger.warning(
                    "session %s: after a failed insert, looking it up failed too (%s)",
                    session.id,
                    type(exc).__name__,
                )
                return None
            if any(entry.message_id == message_id for entry in tail):
                return KeyRecord(message_id, None)
        return None

    def _is_live_only(self, prompt: list[Any]) -> bool:
        first = prompt[0] if prompt else None
        return isinstance(first, s.ContentBlockText) and first.text.startswith(
            self.live_only_prefix
        )

    # -- turns -------------------------------------------------------------------------------

    def _ensure_worker(self, session: Session) -> None:
        if session.worker:
            return
        session.worker = True
        session.running = True
        assert self._pool is not None, "use SessionAgent as an async context manager"
        # a parked task of the group runs it when one waits: cheaper than a new task per turn
        self._pool.start_soon(self._worker, session)

    async def _worker(self, session: Session) -> None:
        context = TurnContext(self, session)
        coordinator = self._coordinator
        try:
            while True:
                if not session.turns:
                    if coordinator.may_stop(session):
                        break  # nothing to insert and nobody inserting: no lock needed
                    async with session.lock:
                        # whoever held the lock may have inserted a prompt meanwhile: its
                        # turn is ours to run (starting a worker did nothing, this one runs)
                        if session.turns or await coordinator.insert_next(session):
                            continue
                        break
                turn = session.turns.popleft()
                # the scope exists from the moment the turn leaves the queue, so a cancel that
                # arrives before the turn got going still stops it
                session.turn_scope = self._new_scope()
                idle = await self._run_one(session, turn, context, session.turn_scope)
                self._turn_ended(session, turn.message_id, idle)
                # a cancelled turn always ends with its idle update (R57), even when a
                # prompt sent after the cancel is already waiting
                if idle["stopReason"] == "cancelled" or not (session.turns or session.held):
                    await context.emit(idle)
        finally:
            session.worker = False
            session.running = False
            session.turn_scope = None
            if session.stopped is not None:
                session.stopped.set()
                session.stopped = None
            self._evict_if_idle(session)  # its last connection may have gone during the turn

    async def _run_one(
        self, session: Session, turn: Turn, context: TurnContext, scope: anyio.CancelScope
    ) -> dict[str, Any]:
        """Run one turn; return the idle update that ends it.

        A failure after insertion is never an error answer: it ends the turn with
        `stopReason: "error"` (R55). The retained "idle" marker written at the end says
        the message's turn finished; a message without one was interrupted by a crash.
        """
        idle: dict[str, Any] = {"sessionUpdate": "state_update", "state": "idle"}
        context._turn = turn
        context._marked = False
        with scope:
            await context.emit({"sessionUpdate": "state_update", "state": "running"})
            try:
                idle["stopReason"] = await self.run_turn(turn, context)
            except Exception as exc:
                logger.exception("session %s: turn failed", session.id)
                idle["stopReason"] = "error"
                idle["error"] = InternalError(f"The turn failed ({type(exc).__name__})").to_wire()
        session.turn_scope = None
        if scope.cancelled_caught or scope.cancel_called:
            idle["stopReason"] = "cancelled"
        if not turn.live_only and not context._marked:  # not written with a `final` emit
            with anyio.CancelScope(shield=True):
                try:
                    await self._mark_turn(session, "idle", turn.message_id)
                except Exception as exc:
                    # The session's worker (and with it the agent) must outlive its store's
                    # failure: the turn stays unmarked, so a restart reports it interrupted.
                    # Only the type is logged: a store's error text could quote a key.
                    logger.error(
                        "session %s: the end of the turn of %s was not stored (%s)",
                        session.id,
                        turn.message_id,
                        type(exc).__name__,
                    )
        return idle

    async def _mark_turn(self, session: Session, state: str, message_id: str) -> None:
        try:
            await self.store.append_update(session.id, marker(state, message_id))
        except (FencingError, SessionMissing):  # taken over by another node, or deleted
            logger.warning(
                "session %s: turn of %s not marked (lease lost or session deleted)",
                session.id,
                message_id,
            )

    async def _append_final(
        self, session: Session, update: bytes, message_id: str | None, turn: Turn
    ) -> None:
        """Store a turn's last retained update and its closing marker in one write when the
        store can (`AppendsUpdates`: one SQLite transaction instead of two); otherwise one
        after the other, with the marker's failures handled as `_mark_turn` does."""
        append_updates = getattr(self.store, "append_updates", None)
        if append_updates is not None:
            closing = marker("idle", turn.message_id)
            await append_updates(session.id, [(update, message_id), (closing, None)])
        else:
            await self.store.append_update(session.id, update, message_id=message_id)
            await self._mark_turn(session, "idle", turn.message_id)

    async def _cancel_work(self, session: Session) -> None:
        await self._coordinator.cancel_session(session)
        # prompts received before the cancel and not inserted: -32800 (R28)
        for pending in list(session.held):
            self._withdraw(session, pending)
        for key, pending in list(session.pending_by_key.items()):
            if pending.state == "held":
                self._withdraw(session, pending)
            else:
                session.pending_by_key.pop(key, None)
        cleared = list(session.turns)
        dropped = [t for t in cleared if not t.live_only]
        session.turns.clear()
        for turn in cleared:
            self._turn_ended(session, turn.message_id, dict(_DROPPED_IDLE))
        if session.turn_scope is not None:
            session.turn_scope.cancel()
        if dropped:
            # their work will never run: close their markers, even if this request is cut
            # (an unmarked turn counts as interrupted: a restart would run it again)
            with anyio.move_on_after(RECOVER_TIMEOUT, shield=True):
                for turn in dropped:
                    await self._mark_turn(session, "idle", turn.message_id)
        if session.worker:
            # the final updates and the idle state_update go out before we answer (R61)
            if session.stopped is None:
                session.stopped = anyio.Event()
            stopped = session.stopped
            with anyio.move_on_after(_STOP_TIMEOUT):
                await stopped.wait()

    # -- helpers -----------------------------------------------------------------------------

    def _attach(self, session: Session, conn: AgentSideConnection) -> None:
        session.conns[conn.id] = conn

    def _active(self, session_id: str, conn: AgentSideConnection) -> Session:
        session = self._sessions.get(session_id)
        # Ownership is also checked here, though a session becomes active on a connection only
        # through new, resume or fork, which check it: a tenant never reaches another's.
        if session is None or conn.id not in session.conns or not _owns(session.record, conn):
            raise SessionNotFound(session_id)
        return session

    async def _load(self, session_id: str, conn: AgentSideConnection) -> Session:
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
        session = self._sessions[session_id] = Session(record)
        unfinished = unfinished_turns(session_id, tail)
        if unfinished:
            # Shielded (bounded): the session is registered now, so this is the one chance to
            # deal with its interrupted turns; a request cancelled half-way (its connection
            # closed) must not leave them neither run nor reported until the next restart.
            session.users += 1  # not evicted while it recovers: its caller has not attached
            try:
                with anyio.move_on_after(RECOVER_TIMEOUT, shield=True) as scope:
                    await self._coordinator.recover(session, unfinished)
            finally:
                session.users -= 1
            if scope.cancelled_caught:
                logger.warning("session %s: recovering interrupted turns timed out", session_id)
        return session

    def _evict_if_idle(self, session: Session) -> None:
        """Drop `session` from memory when nothing holds it there (`Session.idle`); it reloads
        from the store on resume. Otherwise `_sessions` grew by every session ever resumed.

        Only with the in-process coordinator: a cluster coordinator keeps state per session
        id (its lease, prompts other nodes queued for it) and looks the session up by id, so
        a session it still owns must stay where it can be found.
        """
        if not isinstance(self._coordinator, LocalCoordinator):
            return
        if session.idle() and self._sessions.get(session.id) is session:
            del self._sessions[session.id]

    async def _handle_unfinished(self, session: Session, unfinished: list[Turn]) -> None:
        """Run again (`resume_interrupted`) or report as interrupted the turns an earlier
        process (or a node whose lease expired) left unfinished."""
        if not unfinished:
            return
        if self.resume_interrupted:
            session.turns.extend(unfinished)
            self._ensure_worker(session)
        else:
            session.interrupted = True
            for turn in unfinished:
                await self._mark_turn(session, "idle", turn.message_id)

    def _forget_live_keys(self, session: Session) -> None:
        if not session.conns:
            session.live_keys.clear()  # R36: live-only keys last while the session is active

    def _state(self, session: Session) -> dict[str, Any]:
        # a worker that only drains the queue (no turn taken or waiting) is not a running turn
        running = session.running and (session.turn_scope is not None or bool(session.turns))
        if running or self._coordinator.running_elsewhere(session.id):
            return {"sessionUpdate": "state_update", "state": "running"}
        if session.interrupted:
            return {
                "sessionUpdate": "state_update",
                "state": "idle",
                "stopReason": "error",
                "error": InternalError(INTERRUPTED_MESSAGE).to_wire(),
            }
        return {"sessionUpdate": "state_update", "state": "idle"}

    def _turn_ended(self, session: Session, message_id: str, idle: dict[str, Any]) -> None:
        """Tell the v1 connections of `session` how the turn of `message_id` ended (its idle
        update): their v1 `session/prompt` is answered with it (`acp_once.agent.v1face`). The
        idle update itself is sent only after the last queued turn."""
        for conn in list(session.conns.values()):
            if conn.v1_face is not None:
                conn.v1_face.turn_ended(session.id, message_id, idle)

    async def _broadcast(self, session: Session, update: dict[str, Any]) -> None:
        self._coordinator.publish(session.id, update)
        if not session.conns:
            return
        # encoded once, whatever the number of connections
        frame = encode_notification(SESSION_UPDATE, {"sessionId": session.id, "update": update})
        for conn in list(session.conns.values()):
            try:
                if conn.v1_face is not None:  # a v1 client: its face translates (v1face.py)
                    await conn.v1_face.session_update(session.id, update)
                # no coroutine when the frame can be queued at once (the common case)
                elif not conn.rpc.send_encoded_nowait(frame):
                    await conn.rpc.send_encoded(frame)
            except ConnectionClosed:
                session.conns.pop(conn.id, None)


class TurnContext:
    """What a turn uses to report and to ask: live updates go to every connection the session
    is active on, and are retained in the store when they are part of the conversation.

    Updates are the builders' models (`acp_once.agent.updates`) or wire dicts; tool calls and
    permission requests have helpers of their own (`start_tool_call`, `update_tool_call`,
    `request_permission`)."""

    def __init__(self, agent: SessionAgent, session: Session) -> None:
        self._agent = agent
        self._session = session
        self._turn: Turn | None = None  # the turn being run
        self._marked = False  # its closing marker is stored (by a `final` emit)
        self._strict = getattr(agent, "strict_updates", False)

    @property
    def session_id(self) -> str:
        return self._session.id

    async def emit(
        self, update: dict[str, Any] | BaseModel, *, retain: bool = False, final: bool = False
    ) -> None:
        """Send one `session/update` `update` object; with `retain`, store it for replay first.

        `final` (with `retain`) says this is the turn's last update: it is stored together
        with the marker that says the turn finished, in one write instead of two. A crash
        after it counts as a finished turn (not reported as interrupted after a restart), so
        use it only when nothing the user must know about follows.

        Args:
            update: a model from `acp_once.agent.updates` (or any `session/update` kind of
                `acp_once.protocol.schema`), or the wire dict.
            retain: store it as part of the conversation (replayed on resume).
            final: with `retain`, store it with the turn's closing marker.

        Raises:
            ValueError: in strict mode (`SessionAgent(strict_updates=True)` or
                `ACP_ONCE_STRICT=1`), a dict that is not a valid update; the message names
                the kind or the field.
        """
        # dicts first: isinstance against a pydantic model class goes through ABCMeta (~200 ns)
        if not isinstance(update, dict):
            # JSON mode: URLs, datetimes and enums become strings orjson and clients accept
            update = update.model_dump(by_alias=True, exclude_unset=True, mode="json")
        elif self._strict:
            check_update(update)
        else:
            kind = update.get("sessionUpdate")
            if kind.__class__ is not str or kind not in _SAMPLED:
                _sample_update(update)  # the first dict of its kind: a set lookup after that
        if retain:
            turn = self._turn
            encoded = orjson.dumps(update)
            message_id = update.get("messageId")
            if final and turn is not None and not turn.live_only and not self._marked:
                await self._agent._append_final(self._session, encoded, message_id, turn)
                self._marked = True  # after the write: a failed one leaves it to _run_one
            else:
                await self._agent.store.append_update(
                    self._session.id, encoded, message_id=message_id
                )
        await self._agent._broadcast(self._session, update)

    async def start_tool_call(
        self,
        title: str,
        *,
        kind: str = "other",
        status: str = "pending",
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
                self._session.id, title, options, tool_call_id, description
            )
        elif title is not None or options is not None or tool_call_id is not None:
            raise ValueError("request_permission takes a request or simple arguments, not both")
        for conn in list(self._session.conns.values()):
            try:
                return await conn.client.request_permission(request)
            except ConnectionClosed:
                continue
        return s.RequestPermissionResponse.model_validate({"outcome": {"outcome": "cancelled"}})


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


def _check_paths(cwd: str, additional: list[str] | None, field: str = "cwd") -> None:
    """-32602 for a path no store can keep (`acp_once.protocol.limits`), before any write."""
    try:
        check_path(cwd, field)
        for path in additional or ():
            check_path(path, "additionalDirectories")
    except ValueError as exc:
        raise InvalidParams(str(exc)) from None


def _owns(record: SessionRecord, conn: AgentSideConnection) -> bool:
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


class _Host:
    """The `SessionHost` a coordinator sees: the runtime's operations, nothing more."""

    __slots__ = ("_agent",)

    def __init__(self, agent: SessionAgent) -> None:
        self._agent = agent

    @property
    def store(self) -> SessionStore:
        return self._agent.store

    @property
    def policy(self) -> str:
        return self._agent.policy

    @property
    def compare_prompts(self) -> bool:
        return self._agent.compare_prompts

    @property
    def name(self) -> str:
        return self._agent.info["name"]

    def session(self, session_id: str) -> Session | None:
        return self._agent._sessions.get(session_id)

    def sessions(self) -> list[Session]:
        return list(self._agent._sessions.values())

    async def insert(self, session: Session, pending: PendingPrompt) -> None:
        await self._agent._insert(session, pending)

    def start_worker(self, session: Session) -> None:
        self._agent._ensure_worker(session)

    async def handle_unfinished(self, session: Session, unfinished: list[Turn]) -> None:
        await self._agent._handle_unfinished(session, unfinished)

    async def find_unfinished(self, session: Session) -> list[Turn]:
        tail = await self._agent.store.read_timeline_tail(session.id, limit=RECOVERY_WINDOW)
        return unfinished_turns(session.id, tail)

    async def cancel_work(self, session: Session) -> None:
        await self._agent._cancel_work(session)

    def reuses_key(self, recorded: bytes | None, pending: PendingPrompt) -> bool:
        return self._agent._reuses_key(recorded, pending.digest)

    def is_live_only(self, prompt: list[Any]) -> bool:
        return self._agent._is_live_only(prompt)
