"""`AcpClient`: a client that never makes its application think about lost answers.

    launcher = StdioLauncher(["acp-once", "agent"])
    async with AcpClient(launcher, outbox="sqlite:pending.db") as client:
        session = await client.new_session("/home/me/project")
        message_id = await session.prompt("Run the database migration")   # at insertion

        turn = session.prompt("Deploy it")          # a `PromptHandle`, already on its way
        result = await turn.finished()              # the end of its turn: stop reason, messages

What it does for you (the RFD's "shiny future"):

- **A key for every submission.** `prompt()` makes a fresh UUID key when called (or takes the
  application's own) and sends that key on every attempt, each with a fresh JSON-RPC id.
- **Durable pending input.** The submission is written to the outbox before the first attempt
  and removed only when a `messageId` or a definite error comes back. After a restart, the
  client finds its pending submissions and resends them once their sessions are resumed, in
  their original order per session; those older than `max_age` are handed to the application.
- **Recovery by retry class.** When an outcome is unknown (the agent process exited, the pipe
  broke), it reconnects with backoff and jitter, initializes, resumes every session it had,
  then resends: keyed prompts with their key, Idempotent requests as they are, Duplicating
  requests only when allowed, Not-retried messages never (`acp_once.protocol.retry`).
- **Every submission's turn ends.** A session with prompts in flight is resumed with its
  history replayed into a ledger of its turns (`acp_once.client.history`): a prompt inserted
  before the reconnect (or by an earlier run) ends with the outcome the history or the
  resume's snapshot gives (interrupted, when the agent restarted before the turn finished).

**ACP v1 agents.** The client offers v2 at `initialize`. An agent that answers as v1 (its
`protocolVersion` is 1, or its answer has v1's shape: no `info`) gets a v1 connection, whose
face (`acp_once.client.faces.V1Face`) does all that differs: new
sessions with v1's `session/new` params, v1 updates translated to the same typed v2 updates
(`acp_once.protocol.v1_to_v2`), prompts sent without a key and answered at the end of their
turn (see `acp_once.client.turns` for what the `PromptHandle` offers then), `session/cancel`
as in v2. v1 has no idempotency keys, so a resend after a lost answer may run the work twice:
`on_unaware` decides. "refuse" refuses the agent (`AgentRefused` from `async with`), "warn"
(the default) logs that once and proceeds, "trust" proceeds silently. Whatever the policy, a
prompt whose answer was lost is resent on its own only under "trust"; otherwise it fails with
`OutcomeUnknown`, and pending submissions of an earlier run are handed to the application
(`stale()`, `on_stale`) instead of being resent. After a reconnect, each session is
re-attached with v1's `session/load` when the agent advertises `loadSession` (the history it
replays is not passed on: the application saw it live); without it the session cannot
be re-attached, which is logged, and the agent answers later prompts for it with its error.

Errors a caller sees: `PromptCancelled` (-32800: withdrawn, cancelled or closed before
insertion), any other `AcpError` (a definite answer: nothing was inserted), `OutcomeUnknown`
(the outcome is unknown and the client may not resend: a Duplicating request without
permission, or an agent the application does not trust with keys), `AgentRefused` (the agent's
`initialize` answer is neither v1 nor v2, or it speaks v1 and `on_unaware` is "refuse").
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Self

import anyio
import orjson
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream

from acp_once.client._state import Job, SessionState
from acp_once.client.connection import ClientSideConnection
from acp_once.client.errors import AgentRefused, OutcomeUnknown, PromptCancelled
from acp_once.client.faces import FACES, Face
from acp_once.client.interface import Client
from acp_once.client.launchers import Launcher
from acp_once.client.outbox import Outbox, Submission, open_outbox
from acp_once.client.recovery import DEFAULT_MAX_AGE, Backoff, plan_resend
from acp_once.client.turns import PromptHandle, UpdateCallback
from acp_once.protocol import schema as s
from acp_once.protocol.errors import AcpError, MethodNotFound, SessionNotFound
from acp_once.protocol.initialization import PROTOCOL_VERSION
from acp_once.protocol.keys import new_key
from acp_once.protocol.retry import may_resend
from acp_once.protocol.v1_to_v2 import answer_version, not_acp_reason
from acp_once.rpc.connection import unwrap_single_exception
from acp_once.rpc.errors import ConnectionClosed, TransportError

if TYPE_CHECKING:
    from acp_once.protocol import v1

__all__ = ["AcpClient", "AgentRefused", "ClientSession", "OutcomeUnknown", "PromptCancelled"]

logger = logging.getLogger("acp_once.client")


PermissionHandler = Callable[[s.RequestPermissionRequest], Awaitable[s.RequestPermissionResponse]]
StaleHandler = Callable[[Submission], Awaitable[None]]


class _Handler(Client):
    def __init__(self, owner: AcpClient) -> None:
        self._owner = owner

    async def session_update(self, params: s.UpdateSessionNotification) -> None:
        await self._owner._dispatch_update(params)

    async def request_permission(
        self, params: s.RequestPermissionRequest, connection: ClientSideConnection
    ) -> s.RequestPermissionResponse:
        handler = self._owner.on_permission
        if handler is None:
            return s.RequestPermissionResponse.model_validate({"outcome": {"outcome": "cancelled"}})
        return await handler(params)


class ClientSession:
    """One session of an `AcpClient`."""

    def __init__(self, client: AcpClient, state: SessionState) -> None:
        self._client = client
        self._state = state

    @property
    def session_id(self) -> str:
        return self._state.session_id

    def prompt(
        self, prompt: str | Sequence[dict[str, Any]], *, idempotency_key: str | None = None
    ) -> PromptHandle:
        """Submit user input; return its `PromptHandle` (`acp_once.client.turns`).

        The submission is written to the outbox and sent in the background, after the
        session's earlier calls. `await session.prompt(...)` returns the `messageId` of the
        inserted user message; keep the handle to wait for the turn (`await
        handle.finished()`) or follow it (`async for update in handle.updates()`).

        A new call is a new submission with a new key (unless `idempotency_key` is given: pass
        the key you stored with your own pending input). Retries after lost answers happen
        inside, with the same key. A named submission that an earlier run may have made is
        the same submission: the agent answers the recorded `messageId`; resume the session
        with `resume_session(..., history=True)` first, and the handle ends at once when the
        history says its turn is over (`PromptHandle.from_history`).

        Against an ACP v1 agent no key is sent (v1 has none), the handle's `message_id` is a
        local id, and awaiting it returns at the end of the turn (`acp_once.client.turns`); a
        lost answer is resent only under `on_unaware="trust"`.

        Raises:
            RuntimeError: the client is not running (use it inside `async with AcpClient(...)`).

        Awaiting the handle raises:
            PromptCancelled: withdrawn or cancelled before insertion.
            AcpError: the agent refused it (e.g. -32602); nothing was inserted.
            OutcomeUnknown: the answer was lost and automatic resends are refused.
        """
        blocks = [{"type": "text", "text": prompt}] if isinstance(prompt, str) else list(prompt)
        return self._client._start_prompt(self._state, blocks, idempotency_key or new_key())

    async def cancel(self) -> None:
        """Send `session/cancel` (a notification: never resent)."""
        conn = await self._client._ready()
        await conn.agent.cancel(s.CancelSessionNotification(session_id=self.session_id))

    async def close(self) -> None:
        """Close the session (Idempotent: resent after a lost answer)."""
        await self._client._call("session/close", {"sessionId": self.session_id})
        self._client._sessions.pop(self.session_id, None)

    def on_update(self, callback: UpdateCallback) -> None:
        """Call `callback` with every update of this session, in order: the validated `update`
        model (`acp_once.client.turns.SessionUpdate`, e.g. `s.SessionUpdateAgentMessage`).

        `callback` may be a plain or an async function; it runs in the connection's reader, so
        it must not block (an exception it raises is logged, and the next update still comes).
        """
        self._state.callbacks.append(callback)

    @contextlib.asynccontextmanager
    async def updates(
        self, buffer: int = 10_000
    ) -> AsyncIterator[MemoryObjectReceiveStream[s.UpdateSessionNotification]]:
        """Subscribe to this session's updates: `async with session.updates() as stream:`.

        A subscriber more than `buffer` updates behind is dropped (its iteration ends) rather
        than stalling the connection; resume the session with replay to catch up.
        """
        send, receive = anyio.create_memory_object_stream[s.UpdateSessionNotification](buffer)
        self._state.subscribers.append(send)
        try:
            async with receive:
                yield receive
        finally:
            with contextlib.suppress(ValueError):
                self._state.subscribers.remove(send)
            send.close()


class AcpClient(anyio.AsyncContextManagerMixin):
    """A self-healing ACP v2 client (see the module docstring).

    Args:
        launcher: how to reach the agent (`StdioLauncher([...])`, `acp_once.client.launchers`).
        outbox: an `Outbox`, or a URL for `open_outbox` ("memory:" or "sqlite:PATH").
        info: what `initialize` says about this client.
        backoff: reconnect delays.
        max_age: pending submissions older than this (seconds) are handed to `on_stale`
            instead of being resent on their own.
        allow_duplicating: resend Duplicating requests (`session/new`, `session/fork`) whose
            answer was lost; the extra session is left unused.
        on_unaware: what to do with an agent that does not say it honours keys in its
            `initialize` `_meta` (no capability exists for it): "trust" resends as usual,
            "warn" logs a warning and resends, "refuse" raises `OutcomeUnknown` instead. An
            ACP v1 agent has no keys at all: "trust" resends a prompt whose answer was lost,
            "warn" logs why once and never resends on its own, "refuse" refuses the agent
            (`AgentRefused`).
        use_keys: False sends prompts without keys (only to demonstrate what keys prevent).
        on_permission: answers permission requests (default: cancelled, i.e. not approved).
        on_stale: receives stale submissions (also available from `stale()`).
        on_recovered: receives `(submission, message_id)` for each pending submission of an
            earlier run that was resent and inserted.
        recover_pending: resend what the outbox holds from an earlier run when the client
            starts (False leaves it to the application: `outbox.pending()`).
    """

    def __init__(
        self,
        launcher: Launcher,
        *,
        outbox: Outbox | str = "memory:",
        info: dict[str, Any] | None = None,
        backoff: Backoff | None = None,
        max_age: float = DEFAULT_MAX_AGE,
        allow_duplicating: bool = False,
        on_unaware: Literal["trust", "warn", "refuse"] = "warn",
        use_keys: bool = True,
        on_permission: PermissionHandler | None = None,
        on_stale: StaleHandler | None = None,
        on_recovered: Callable[[Submission, str], Awaitable[None]] | None = None,
        connect_timeout: float = 30.0,
        recover_pending: bool = True,
    ) -> None:
        self.recover_pending = recover_pending
        self.launcher = launcher
        self._outbox_spec = outbox
        self.info = info or {"name": "acp-once-client", "version": "0.1.0"}
        self.backoff = backoff or Backoff()
        self.max_age = max_age
        self.allow_duplicating = allow_duplicating
        self.on_unaware = on_unaware
        self.use_keys = use_keys
        self.on_permission = on_permission
        self.on_stale = on_stale
        self.on_recovered = on_recovered
        self.connect_timeout = connect_timeout
        self.outbox: Outbox = outbox if not isinstance(outbox, str) else None  # type: ignore[assignment]
        self._face: Face | None = None  # the last connection's (`acp_once.client.faces`)
        self._warned_v1 = False
        self.reconnects = 0
        self._sessions: dict[str, SessionState] = {}
        self._conn: ClientSideConnection | None = None
        self._connected = anyio.Event()
        self._tg: TaskGroup | None = None
        self._stale: list[Submission] = []
        self._closing = False

    # -- lifecycle -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncIterator[Self]:
        # one exception, not a group, reaches the caller (`except OutcomeUnknown:` works)
        with unwrap_single_exception():
            async with contextlib.AsyncExitStack() as stack:
                if isinstance(self._outbox_spec, str):
                    self.outbox = await stack.enter_async_context(open_outbox(self._outbox_spec))
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    try:
                        await tg.start(self._supervise)
                        if self.recover_pending:
                            await self._recover_pending()
                        yield self
                    finally:
                        self._closing = True
                        tg.cancel_scope.cancel()
                        self._abandon_turns()

    @property
    def protocol_version(self) -> int | None:
        """The protocol version the agent speaks: 2 or 1, once an agent answered."""
        return self._face.version if self._face is not None else None

    @property
    def agent_info(self) -> s.InitializeResponse | None:
        """A v2 agent's `initialize` answer (None before, or from a v1 agent)."""
        return self._face.agent_info if self._face is not None else None

    @property
    def agent_info_v1(self) -> v1.InitializeResponse | None:
        """A v1 agent's `initialize` answer (None before, or from a v2 agent)."""
        return self._face.agent_info_v1 if self._face is not None else None

    @property
    def keys_trusted(self) -> bool:
        """Whether a prompt whose answer was lost may be resent on its own."""
        return self._face.keys_trusted if self._face is not None else True

    @property
    def keyed(self) -> bool:
        """Whether prompts carry idempotency keys and are answered at insertion (False against
        a v1 agent: answered at the end of their turn, under a local message id)."""
        return self._face.keyed if self._face is not None else True

    @property
    def connected(self) -> bool:
        """True while a connection is up and its sessions are resumed."""
        return self._conn is not None and not self._conn.closed

    async def wait_connected(self) -> None:
        """Wait until a connection is up and its sessions are resumed."""
        await self._ready()

    # -- sessions ----------------------------------------------------------------------------

    async def new_session(self, cwd: str, **params: Any) -> ClientSession:
        """Create a session (Duplicating: resent after a lost answer only when allowed).

        `params` are further `session/new` params; for a v1 agent, `mcpServers` (which v1
        requires) defaults to none."""
        face = await self._ready_face()
        result = await self._call("session/new", face.new_session_params({"cwd": cwd, **params}))
        state = self._track(str(result["sessionId"]), cwd)
        return ClientSession(self, state)

    async def resume_session(
        self, session_id: str, cwd: str, *, history: bool = False
    ) -> ClientSession:
        """Resume an existing session on this client (Idempotent).

        With `history`, the agent replays the session's history from the start and the
        client learns from it which user messages were inserted and how their turns ended
        (the replay is not passed to the application): a prompt sent afterwards under a key
        an earlier run used (`prompt(..., idempotency_key=)`) then ends at once when its turn
        is over, with the outcome the history says (`acp_once.client.history`).

        A v1 agent's session is loaded with `session/load` instead; the history v1 replays
        then is not passed on (a v2 resume without replay sends none either).

        Raises:
            MethodNotFound: the agent speaks v1 and does not advertise `loadSession`.
            AcpError: the agent's answer (e.g. `SessionNotFound`).
        """
        face = await self._ready_face()
        return ClientSession(self, await face.resume(self, session_id, cwd, history=history))

    def session(self, session_id: str) -> ClientSession | None:
        state = self._sessions.get(session_id)
        return ClientSession(self, state) if state is not None else None

    def stale(self) -> list[Submission]:
        """Pending submissions too old to resend on their own (R16); show them to the user,
        then `resend_stale` or `discard`."""
        return list(self._stale)

    async def resend_stale(self, submission: Submission) -> str:
        """Resend a stale submission with its original key; returns its message id."""
        self._stale = [s_ for s_ in self._stale if s_.submission_id != submission.submission_id]
        state = self._sessions.get(submission.session_id)
        if state is None:
            raise SessionNotFound(submission.session_id, "The session is not resumed here")
        return await self._submit(state, submission)

    async def discard(self, submission: Submission) -> None:
        """Drop a pending submission without sending it."""
        self._stale = [s_ for s_ in self._stale if s_.submission_id != submission.submission_id]
        await self.outbox.complete(submission.submission_id)

    def _track(self, session_id: str, cwd: str) -> SessionState:
        state = self._sessions.get(session_id)
        if state is None:
            state = self._sessions[session_id] = SessionState(session_id, cwd)
            assert self._tg is not None
            self._tg.start_soon(self._session_sender, state, name=f"sender-{session_id}")
        return state

    # -- connection supervision --------------------------------------------------------------

    async def _supervise(self, *, task_status: Any) -> None:
        started = False
        attempt = 0
        while True:
            try:
                async with (
                    self.launcher.connect() as frames,
                    ClientSideConnection(_Handler(self), frames, name="acp-client") as conn,
                ):
                    with anyio.fail_after(self.connect_timeout):
                        await self._handshake(conn)
                    self._conn = conn
                    self._connected.set()
                    if not started:
                        task_status.started()
                        started = True
                    attempt = 0  # a healthy connection resets the backoff
                    await conn.wait_closed()
            except (TransportError, OSError, TimeoutError, AcpError, AgentRefused) as exc:
                if not started:  # the first connection must work: the caller hears why not
                    noted = getattr(self.launcher, "last_failure", None)
                    if isinstance(exc, ConnectionClosed) and noted:
                        # the engine saw only a lost connection; the launcher knows the status
                        refused = f"Could not connect: {noted}"
                        raise ConnectionClosed(refused) from exc
                    raise
                logger.warning("connection to the agent failed: %s", type(exc).__name__)
            finally:
                self._conn = None
                if self._connected.is_set():
                    # a fresh event for the next connection; an unset one keeps its waiters
                    self._connected = anyio.Event()
            if self._closing:
                return
            self.reconnects += 1
            if not self.backoff.should_retry(attempt):
                logger.error("giving up on the agent after %d attempts", attempt + 1)
                # nothing more will come: the handles waiting for an answer or a turn hear it
                self._abandon_turns("The client gave up reconnecting before the turn ended")
                return
            await anyio.sleep(self.backoff.next_delay(attempt))
            attempt += 1

    async def _handshake(self, conn: ClientSideConnection) -> None:
        raw = await conn.rpc.request(
            "initialize",
            {"protocolVersion": PROTOCOL_VERSION, "info": self.info, "capabilities": {}},
        )
        open_face = FACES.get(answer_version(raw) or 0)
        if open_face is None:
            raise AgentRefused(not_acp_reason(raw))
        self._face = await open_face(self, conn, raw)

    async def _ready(self) -> ClientSideConnection:
        while True:
            conn = self._conn
            if conn is not None and not conn.closed:
                return conn
            await self._connected.wait()

    async def _ready_face(self) -> Face:
        await self._ready()
        assert self._face is not None  # opened before the connection is ready
        return self._face

    async def _call(self, method: str, params: dict[str, Any]) -> Any:
        """One request with recovery by retry class."""
        while True:
            conn = await self._ready()
            try:
                return await conn.rpc.request(method, params)
            except TransportError:
                if not may_resend(method, has_key=False, allow_duplicating=self.allow_duplicating):
                    raise OutcomeUnknown(
                        f"The answer to '{method}' was lost and it may not be resent"
                    ) from None
                logger.info("resending '%s' after a lost answer", method)

    # -- prompts -------------------------------------------------------------------------------

    def _start_prompt(
        self, state: SessionState, blocks: list[dict[str, Any]], key: str
    ) -> PromptHandle:
        if self._tg is None or self._closing:
            raise RuntimeError("the client is not running: use it inside `async with AcpClient`")
        handle = PromptHandle(state.session_id)
        handle._tagged = state.ledger.tagged
        # registered now, so it sees every update from here on (the turn's start among them)
        state.handles.append(handle)
        handle._on_end = lambda h: state.handles.remove(h) if h in state.handles else None
        previous, state.added = state.added, anyio.Event()
        self._tg.start_soon(self._run_prompt, state, handle, blocks, key, previous, state.added)
        return handle

    async def _run_prompt(
        self,
        state: SessionState,
        handle: PromptHandle,
        blocks: list[dict[str, Any]],
        key: str,
        previous: anyio.Event,
        added: anyio.Event,
    ) -> None:
        try:
            try:
                await previous.wait()
                submission = await self.outbox.add(
                    state.session_id, orjson.dumps(blocks), idempotency_key=key
                )
                job = self._enqueue(state, submission)
            finally:
                added.set()
            if job.handle is None:
                job.handle = handle
            await job.done.wait()
        except Exception as exc:  # the outbox failed: the caller hears it from the handle
            handle._set_failed(exc)
            return
        if job.error is not None:
            handle._set_failed(job.error)
        else:
            message_id = job.message_id
            assert message_id is not None
            # A message the ledger knows was inserted before: its turn is what the ledger says.
            # One it does not know after a resume with the history was inserted since: its
            # user message comes on this connection.
            retried = job.attempts > 1 and not state.history_resumed
            handle._set_inserted(message_id, retried=retried and not state.ledger.known(message_id))
            state.settle(handle)

    def _abandon_turns(self, reason: str = "The client closed before the turn ended") -> None:
        error = OutcomeUnknown(reason)
        for state in self._sessions.values():
            for handle in list(state.handles):
                handle._set_failed(error)

    def _enqueue(self, state: SessionState, submission: Submission) -> Job:
        job = state.jobs.get(submission.submission_id)
        if job is None:
            # one sender per submission: a recovered submission that the application submits
            # again (with its own key) waits for the same attempt
            job = state.jobs[submission.submission_id] = Job(submission)
            state.queue.append(job)
            state.wake.set()
        return job

    async def _submit(self, state: SessionState, submission: Submission) -> str:
        job = self._enqueue(state, submission)
        await job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.message_id is not None
        return job.message_id

    async def _session_sender(self, state: SessionState) -> None:
        """Sends a session's submissions one at a time, in order (R15: original order)."""
        while True:
            while not state.queue:
                await state.wake.wait()
                state.wake = anyio.Event()
            job = state.queue.pop(0)
            state.sending = job
            try:
                job.message_id = await self._send_until_definite(state, job)
            except Exception as exc:
                job.error = exc
            finally:
                state.sending = None
                state.jobs.pop(job.submission.submission_id, None)
                job.done.set()

    async def _send_until_definite(self, state: SessionState, job: Job) -> str:
        while True:
            face = await self._ready_face()
            message_id = await face.send(self, job)
            if message_id is not None:
                return message_id
            # resent on the next connection, by its face

    async def _recover_pending(self) -> None:
        """Resend what an earlier run left pending (after resuming its sessions)."""
        pending = await self.outbox.pending()
        if not pending:
            return
        face = await self._ready_face()
        if face.hands_over_pending:
            # no keys: a resend may run the work twice; the application decides
            for sub in pending:
                self._stale.append(sub)
                if self.on_stale is not None:
                    await self.on_stale(sub)
            return
        # a stale one and everything after it in its session go to the application
        resend, hand_over = plan_resend(pending, time.time(), self.max_age)
        by_session: dict[str, list[Submission]] = {}
        for sub in pending:
            by_session.setdefault(sub.session_id, []).append(sub)
        conn = await self._ready()
        for session_id, subs in by_session.items():
            cwd = "/"
            # ValueError: an answer that is not a v2 list (pydantic's ValidationError is one)
            with contextlib.suppress(AcpError, TransportError, ValueError):
                listed = await conn.agent.list_sessions(s.ListSessionsRequest())
                cwd = next((x.cwd for x in listed.sessions if x.session_id == session_id), cwd)
            known = self._sessions.get(session_id)
            # one that was sent may be inserted and its turn over: the history says
            history = any(sub.attempts > 0 for sub in subs)
            try:
                # re-attached as the face does it: session/resume, or a v1 agent's session/load
                state = await face.resume(
                    self, session_id, known.cwd if known else cwd, history=history
                )
            except (SessionNotFound, MethodNotFound):
                # gone, or an agent that cannot re-attach it: the application decides
                self._sessions.pop(session_id, None)
                self._stale.extend(subs)
                continue
            assert self._tg is not None
            for sub in resend:
                if sub.session_id == session_id:
                    self._tg.start_soon(self._recover_one, state, sub)
            for sub in hand_over:
                if sub.session_id == session_id:
                    self._stale.append(sub)
                    if self.on_stale is not None:
                        await self.on_stale(sub)

    async def _recover_one(self, state: SessionState, submission: Submission) -> None:
        try:
            message_id = await self._submit(state, submission)
        except Exception as exc:
            logger.warning("a recovered submission failed: %s", type(exc).__name__)
            return
        if self.on_recovered is not None:
            await self.on_recovered(submission, message_id)

    # -- updates -------------------------------------------------------------------------------

    async def _dispatch_update(self, params: s.UpdateSessionNotification) -> None:
        state = self._sessions.get(params.session_id)
        if state is None or state.replaying:
            return
        if state.ledger.replaying:
            state.take_replayed(params)  # the history: to the ledger, and what was missed
            return
        state.ledger.feed(params.update)
        await self._deliver(state, params)

    async def _deliver_missed(self, params: s.UpdateSessionNotification) -> None:
        state = self._sessions.get(params.session_id)
        if state is not None:
            await self._deliver(state, params)

    async def _deliver(self, state: SessionState, params: s.UpdateSessionNotification) -> None:
        update = params.update
        for handle in list(state.handles):
            handle._feed(update)
        for callback in state.callbacks:
            try:
                # a plain function or an async one: call it, await what it returns if awaitable
                result = callback(update)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                logger.exception("an update callback failed")
        for send in list(state.subscribers):
            try:
                send.send_nowait(params)
            except anyio.WouldBlock:
                state.subscribers.remove(send)
                send.close()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                state.subscribers.remove(send)
