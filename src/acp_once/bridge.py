"""A stdio ACP agent served over WebSocket and Streamable HTTP: `acp-once bridge -- CMD ARGS`.

    async with Bridge(["acp-once", "agent", "--store", "sqlite:s.db"]) as bridge:
        app = create_app(None, token=token, handler=bridge.serve)
        await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=8765)).serve()

One child process (the stdio agent) serves every remote connection. The bridge is a JSON-RPC
proxy, not an agent: it decodes each message only to rewrite its id for the next hop and to
keep track of sessions; params travel untouched (re-encoded from the parsed JSON, so
`idempotencyKey` reaches the child exactly as the client sent it, R42), and a notification's
frame is forwarded as it arrived. Keys are never logged or sent anywhere but to the child.

- **Ids per hop.** A remote request gets a fresh child-side id; the answer goes back with the
  remote id. `$/cancel_request` is translated per hop (D26): the remote id becomes the child
  id; a cancel for an unknown or answered id is dropped. Requests the child sends toward the
  client get an id of the remote connection they are sent on, and the answer goes back to the
  child under the child's id; the child's `$/cancel_request` for one is translated likewise.
- **Order.** Each remote connection's messages are forwarded in arrival order from its reader
  (a `session/cancel` can never overtake the prompt sent before it, D33); answers and updates
  from the child are queued per remote connection (bounded: when a connection's queue is
  full the child's messages wait a few seconds, then that connection is closed with 1008),
  so a slow client cannot stall the others for long.
- **`initialize` is answered by the bridge.** The child is initialized once per process, at
  its start, by the bridge (`client_capabilities`, none by default: one child connection
  serves clients with different capabilities, so it claims only what all of them have). The
  child rejects `initialize` after its first other request, so a remote `initialize` cannot
  be forwarded; the bridge answers it from the child's answer (`info`, `capabilities`,
  `authMethods`, `_meta` unchanged) with the version negotiated per digest D23 against the
  version the child speaks (-32022 below it). The initialize rules (-32600 before and after)
  apply per remote connection.
- **Sessions per remote connection.** A session is active on a remote connection once its
  `session/new` or `session/fork` answer names it, or its `session/resume` succeeds (while the
  resume is in flight it receives the session's updates: the replay and the state snapshot).
  `session/prompt`, `session/fork`, `session/set_config_option`, `tool_call/cancel` and
  `terminal/cancel` for a session not active on that connection get -32002 from the bridge, as
  the child would answer on a connection of its own; `session/cancel` for one is dropped;
  `session/close` for one succeeds (D24). `session/update` goes to every remote connection
  the session is active on, except during a resume that asked for replay: then only to the
  resuming connection, so others do not see the history twice (live updates sent in that
  window reach only the resumer). Requests from the child with a `sessionId` go to one remote
  connection the session is active on; when that connection ends unanswered they are resent
  on another one (they are Idempotent), and when there is none (or no `sessionId` names one)
  the child gets the method's cancellation answer (`session/request_permission`: outcome
  `cancelled`, "not approved"; others -32800). Notifications without a `sessionId` go to
  every initialized remote connection.
- **`session/close` and `session/delete`.** To the child, all remote connections are one
  connection. A close from the last remote connection the session is active on is forwarded;
  from any other, the bridge sends the child `session/cancel` (closing stops the work, as the
  agent does for a close on one of several connections), waits (bounded) for the session's
  idle `state_update` so the closing connection sees the final updates, then detaches only
  that connection and answers.
  A successful `session/delete` detaches the session from every remote connection.
- **A remote connection ends** (D11, as the reference agent does per connection): its
  sessions stay active in the child and are resumable from any connection; work goes on. Its
  requests still pending at the child are cancelled per hop with `$/cancel_request`, except a
  keyed `session/prompt` for which another live connection has a request pending (a retry
  with the same key): a held prompt nobody can hear is withdrawn (its key stays unused, so
  the client's retry inserts it once), and one still awaited elsewhere stays held. An
  already inserted prompt is unaffected by the cancel (R27).
- **The child dies.** Every remote connection with state in it (active sessions, pending
  requests either way) is closed with 1001 (the client reconnects, initializes, resumes and
  resends: keys still hold where the child stores its sessions durably, e.g. the reference
  agent on SQLite); connections without state stay open. The child is started again after a
  jittered, exponentially growing delay (`backoff`), reset once a child has lived
  `stable_after` seconds. Meanwhile requests wait up to `ready_timeout` for it, then get
  -32603. The first child must start and initialize, or `Bridge` raises `BridgeError`.
- **Limits.** Updates for a session no remote connection has active are dropped (an agent
  that sends updates before its `session/new` answer names the session loses them). The child
  never sees a remote connection end, so its sessions stay active on its one connection while
  it lives (live-only keys, R36, are kept that long). One child process is one agent's
  capacity: the bridge adds connections, not parallelism.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import anyio
import orjson
from anyio.abc import TaskGroup, TaskStatus
from pydantic import ValidationError

from acp_once.protocol import jsonrpc
from acp_once.protocol import methods as m
from acp_once.protocol import schema as s
from acp_once.protocol.errors import (
    AcpError,
    InternalError,
    InvalidRequest,
    RequestCancelled,
    SessionNotFound,
    invalid_params_from_validation,
)
from acp_once.protocol.framing import OversizedFrame, sniff_request_id
from acp_once.protocol.initialization import PROTOCOL_VERSION, InitializeGate, negotiate_version
from acp_once.protocol.jsonrpc import RequestId
from acp_once.rpc.connection import unwrap_single_exception
from acp_once.rpc.streams import FrameStream
from acp_once.support.backoff import Backoff
from acp_once.transports.http import message_session_id
from acp_once.transports.stdio import AgentProcess, spawn
from acp_once.transports.websocket import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    ServerWebSocketFrames,
)

__all__ = ["DEFAULT_BACKOFF", "Bridge", "BridgeError"]

logger = logging.getLogger("acp_once.bridge")

DEFAULT_BACKOFF = Backoff(base=0.2, factor=2.0, cap=5.0)
"""Delay before restarting a dead child: up to 0.2 s, doubling, never above 5 s."""

_ACTIVE_ONLY = frozenset(
    {
        m.SESSION_PROMPT,
        m.SESSION_FORK,
        m.SESSION_SET_CONFIG_OPTION,
        m.TOOL_CALL_CANCEL,
        m.TERMINAL_CANCEL,
    }
)
"""Session-scoped requests that need the session active on the connection (else -32002)."""

_SHIELDED_WRITE = 5.0


class BridgeError(Exception):
    """The child agent could not be started or initialized."""


class _Unavailable(Exception):
    """No initialized child right now (it is restarting)."""


def _dumps(obj: Any) -> bytes:
    try:
        return orjson.dumps(obj)
    except TypeError:
        # a string with a lone surrogate (valid JSON, refused by orjson): keep it escaped, so
        # the agent judges it (an idempotencyKey like that is its -32602 to give)
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _request(id: RequestId, method: str, params: Any) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
    if params is not None:
        message["params"] = params
    return _dumps(message)


def _result(id: RequestId, result: Any) -> bytes:
    return _dumps({"jsonrpc": "2.0", "id": id, "result": result})


def _error(id: RequestId | None, error: AcpError | dict[str, Any]) -> bytes:
    body = error.to_wire() if isinstance(error, AcpError) else error
    return _dumps({"jsonrpc": "2.0", "id": id, "error": body})


def _cancel(id: RequestId) -> bytes:
    return _dumps({"jsonrpc": "2.0", "method": m.CANCEL_REQUEST, "params": {"requestId": id}})


def _cancelled_id(params: Mapping[str, Any] | None) -> RequestId | None:
    value = (params or {}).get("requestId")
    return value if jsonrpc.is_request_id(value) else None


def _session_id(params: Mapping[str, Any] | None) -> str | None:
    return message_session_id({"params": params}) if params is not None else None


class _Forward:
    """A remote request forwarded to the child (by its child-side id)."""

    __slots__ = ("key", "method", "remote", "remote_id", "replay", "session_id")

    def __init__(
        self,
        remote: _Remote,
        remote_id: RequestId,
        method: str,
        session_id: str | None,
        key: str | None,
        replay: bool,
    ) -> None:
        self.remote = remote
        self.remote_id = remote_id
        self.method = method
        self.session_id = session_id
        self.key = key  # only to keep a held prompt another connection awaits (never shown)
        self.replay = replay


class _Ask:
    """A request the child sent toward the clients (by the child's id)."""

    __slots__ = ("child", "child_id", "method", "params", "remote", "remote_id", "session_id")

    def __init__(
        self, child: _Child, child_id: RequestId, method: str, params: dict[str, Any] | None
    ) -> None:
        self.child = child
        self.child_id = child_id
        self.method = method
        self.params = params
        self.session_id = _session_id(params)
        self.remote: _Remote | None = None
        self.remote_id: RequestId | None = None


class _Child:
    """One child process and the state that lives and dies with it."""

    def __init__(self, proc: AgentProcess, generation: int, tg: TaskGroup) -> None:
        self.proc = proc
        self.generation = generation
        self.tg = tg
        self.alive = True
        self.gone = anyio.Event()
        self.ids = itertools.count(1)
        self.forwards: dict[RequestId, _Forward] = {}
        self.asks: dict[RequestId, _Ask] = {}
        self.calls: dict[RequestId, anyio.Event] = {}
        self.answers: dict[RequestId, jsonrpc.Message] = {}
        self.send_lock = anyio.Lock()
        self.init_result: dict[str, Any] = {}
        self.version = PROTOCOL_VERSION

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.process.kill()


class _Remote:
    """One remote connection (WebSocket or Streamable HTTP) and its view of the sessions."""

    def __init__(self, frames: FrameStream, name: str, queue: int, stall: float) -> None:
        self.frames = frames
        self.name = name
        self.stall = stall
        self.gate = InitializeGate()
        self.sessions: set[str] = set()
        self.attaching: dict[str, int] = {}
        """Sessions with a `session/resume` in flight (they get its replay and snapshot)."""
        self.replaying: dict[str, int] = {}
        """Of those, the resumes that asked for replay."""
        self.forwards: dict[RequestId, tuple[_Child, RequestId]] = {}
        """Requests pending at the child: remote id -> (child, child id)."""
        self.asks: dict[RequestId, _Ask] = {}
        """Requests of the child sent on this connection, by the id used on it."""
        self.ids = itertools.count(1)
        self.out_send, self.out_recv = anyio.create_memory_object_stream[bytes](queue)
        self.scope = anyio.CancelScope()
        self.tg: TaskGroup | None = None
        self.ended = False
        self.close_code = CLOSE_NORMAL

    def active(self, session_id: str) -> bool:
        return session_id in self.sessions or session_id in self.attaching

    async def put(self, frame: bytes) -> None:
        """Queue a frame for this connection. A full queue holds the caller back for up to
        `stall` seconds (backpressure, so a burst such as a long replay gets through), then
        ends the connection: one slow client must not hold up the others for long."""
        if self.ended:
            return
        try:
            try:
                self.out_send.send_nowait(frame)
                return
            except anyio.WouldBlock:
                pass
            with anyio.move_on_after(self.stall):
                await self.out_send.send(frame)
                return
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.end(CLOSE_NORMAL)
            return
        logger.warning("%s: the client reads too slowly; closing the connection", self.name)
        self.end(CLOSE_POLICY)

    def end(self, code: int) -> None:
        if not self.ended:
            self.ended = True
            self.close_code = code
        self.scope.cancel()


def _count(counts: dict[str, int], key: str, delta: int) -> None:
    value = counts.get(key, 0) + delta
    if value > 0:
        counts[key] = value
    else:
        counts.pop(key, None)


class Bridge:
    """Serves one stdio agent (`command`) to many remote connections (see the module docstring).

    Use as `async with Bridge(command) as bridge:` and pass `bridge.serve` as the `handler` of
    `acp_once.server.create_app`. Entering starts the child and initializes it; leaving closes
    the remote connections and stops the child (stdin closed, then SIGTERM, then SIGKILL).

    Args:
        command: the agent's command line.
        env, cwd: the child's environment and working directory (default: ours).
        client_capabilities: the `capabilities` the bridge's `initialize` gives the child.
        info: the bridge's `Implementation` in that `initialize`.
        backoff: delays between restarts of a dead child.
        stable_after: seconds after which a child counts as healthy (the backoff starts over).
        ready_timeout: seconds a request waits for a restarting child before -32603; also the
            bound on the child's `initialize`.
        send_timeout: seconds a write may wait for a peer to read: a child that stops reading
            its input is killed (and restarted), a remote connection is closed.
        queue: messages waiting per remote connection; when it is full the agent's messages
            wait up to `stall_timeout` seconds, then that connection is closed (1008).
        close_timeout: seconds a `session/close` kept on one connection waits for the
            cancelled work's idle state before it is answered.
        stderr: the child's stderr (None: ours).
        shutdown_timeout: seconds for each step of stopping the child.

    Attributes:
        restarts: how many times the child was started again.
        pid: the running child's process id (None while it restarts).

    Raises:
        BridgeError: on entering, when the first child cannot be started, exits before it
            answers `initialize`, refuses it, or speaks another protocol version.
        ValueError: an empty command or a non-positive queue.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        client_capabilities: Mapping[str, Any] | None = None,
        info: Mapping[str, Any] | None = None,
        backoff: Backoff = DEFAULT_BACKOFF,
        stable_after: float = 10.0,
        ready_timeout: float = 30.0,
        send_timeout: float = 30.0,
        queue: int = 1000,
        stall_timeout: float = 5.0,
        close_timeout: float = 10.0,
        stderr: int | None = None,
        shutdown_timeout: float = 5.0,
    ) -> None:
        if not command:
            raise ValueError("the agent's command is empty")
        if queue < 1:
            raise ValueError("queue must be positive")
        self.command = list(command)
        self.env = env
        self.cwd = cwd
        self.client_capabilities = dict(client_capabilities or {})
        self.info = dict(info or {"name": "acp-once-bridge", "version": _version()})
        self.backoff = backoff
        self.stable_after = stable_after
        self.ready_timeout = ready_timeout
        self.send_timeout = send_timeout
        self.queue = queue
        self.stall_timeout = stall_timeout
        self.close_timeout = close_timeout
        self.stderr = stderr
        self.shutdown_timeout = shutdown_timeout
        self.restarts = 0
        self._child: _Child | None = None
        self._ready = anyio.Event()
        self._remotes: dict[_Remote, None] = {}  # an ordered set: oldest first
        self._tg: TaskGroup | None = None
        self._started = False
        self._busy: set[str] = set()
        """Sessions whose latest state_update from the child was not idle."""
        self._idle: dict[str, anyio.Event] = {}

    @property
    def pid(self) -> int | None:
        child = self._child
        return child.proc.pid if child is not None and child.alive else None

    async def wait_ready(self) -> int:
        """Wait until an initialized agent is running (bound it with a timeout); returns its
        process id."""
        while True:
            child = self._child
            if child is not None and child.alive:
                return child.proc.pid
            await self._ready.wait()

    @property
    def connections(self) -> int:
        """How many remote connections are being served."""
        return len(self._remotes)

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        try:
            await tg.start(self._supervise)
        except BaseException as exc:
            tg.cancel_scope.cancel()
            with unwrap_single_exception():
                await tg.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._tg = tg
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        for remote in list(self._remotes):
            remote.end(CLOSE_GOING_AWAY)
        self._tg.cancel_scope.cancel()
        with unwrap_single_exception():
            return await self._tg.__aexit__(exc_type, exc, tb)

    async def _supervise(self, *, task_status: TaskStatus[None]) -> None:
        attempt = 0
        for generation in itertools.count(1):
            began = anyio.current_time()
            failure: BaseException | None = None
            returncode: int | None = None
            try:
                async with spawn(
                    self.command,
                    env=self.env,
                    cwd=self.cwd,
                    stderr=self.stderr,
                    shutdown_timeout=self.shutdown_timeout,
                ) as proc:
                    with unwrap_single_exception():
                        await self._run_child(proc, generation, task_status)
                returncode = proc.returncode
            except (OSError, BridgeError, TimeoutError) as exc:
                failure = exc
            if not self._started:
                raise BridgeError(f"the agent could not be started: {failure}") from failure
            self.restarts += 1
            if anyio.current_time() - began >= self.stable_after:
                attempt = 0
            delay = self.backoff.next_delay(attempt)
            attempt += 1
            logger.warning(
                "agent exited (%s); starting it again in %.2f s",
                f"exit code {returncode}" if failure is None else type(failure).__name__,
                delay,
            )
            await anyio.sleep(delay)

    async def _run_child(
        self, proc: AgentProcess, generation: int, task_status: TaskStatus[None]
    ) -> None:
        """Run one child until it dies: read it, initialize it, then serve with it."""
        async with anyio.create_task_group() as tg:
            child = _Child(proc, generation, tg)
            tg.start_soon(self._read_child, child)
            try:
                await self._initialize_child(child)
            except BaseException:
                child.kill()
                raise
            self._child = child
            self._ready.set()
            logger.warning("agent started (pid %d)", proc.pid)
            if not self._started:
                self._started = True
                task_status.started()
            await child.gone.wait()
            tg.cancel_scope.cancel()

    async def _initialize_child(self, child: _Child) -> None:
        id = next(child.ids)
        event = child.calls[id] = anyio.Event()
        params = {
            "protocolVersion": PROTOCOL_VERSION,
            "info": self.info,
            "capabilities": self.client_capabilities,
        }
        await self._to_child(child, _request(id, m.INITIALIZE, params))
        with anyio.fail_after(self.ready_timeout):
            await event.wait()
        answer = child.answers.pop(id, None)
        if isinstance(answer, jsonrpc.ErrorResponse):
            raise BridgeError(f"the agent refused initialize ({answer.error.get('code')})")
        if not isinstance(answer, jsonrpc.Response):
            raise BridgeError("the agent exited before answering initialize")
        try:
            result = s.InitializeResponse.model_validate(answer.result)
        except ValidationError:
            raise BridgeError("the agent's initialize answer is not valid") from None
        if result.protocol_version != PROTOCOL_VERSION:
            raise BridgeError(
                f"the agent speaks protocol version {result.protocol_version}, "
                f"the bridge {PROTOCOL_VERSION}"
            )
        child.version = result.protocol_version
        child.init_result = dict(answer.result)

    async def _ready_child(self) -> _Child:
        """The initialized child, waiting up to `ready_timeout` while it restarts.

        Raises:
            _Unavailable: no child became ready in time.
        """
        with anyio.move_on_after(self.ready_timeout):
            while True:
                child = self._child
                if child is not None and child.alive:
                    return child
                await self._ready.wait()
        raise _Unavailable

    async def _to_child(self, child: _Child, frame: bytes) -> None:
        """Write one frame to the child, whole (shielded), within `send_timeout`; a child
        that does not read is killed (its death ends what depended on it)."""
        if not child.alive:
            return
        try:
            async with child.send_lock:
                with anyio.CancelScope(
                    shield=True, deadline=anyio.current_time() + self.send_timeout
                ) as scope:
                    await child.proc.frames.send(frame)
                if scope.cancelled_caught:
                    logger.warning("the agent stopped reading its input; killing it")
                    child.kill()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            child.kill()

    def _child_died(self, child: _Child) -> None:
        """Everything that lived in `child` is gone: end the remote connections that depended
        on it (their clients reconnect and resume), forget its requests."""
        child.alive = False
        child.gone.set()
        if self._child is child:
            self._child = None
            self._ready = anyio.Event()
        for remote in list(self._remotes):
            dead = [rid for rid, (c, _) in remote.forwards.items() if c is child]
            asks = [rid for rid, ask in remote.asks.items() if ask.child is child]
            if dead or asks or remote.sessions or remote.attaching:
                remote.end(CLOSE_GOING_AWAY)
            for rid in dead:
                remote.forwards.pop(rid, None)
            for rid in asks:
                remote.asks.pop(rid, None)
        child.forwards.clear()
        child.asks.clear()
        self._busy.clear()
        for idle in self._idle.values():
            idle.set()
        self._idle.clear()
        for event in child.calls.values():
            event.set()

    # -- the child's side ------------------------------------------------------------------

    async def _read_child(self, child: _Child) -> None:
        try:
            while True:
                try:
                    frame = await child.proc.frames.receive()
                except (
                    anyio.EndOfStream,
                    anyio.ClosedResourceError,
                    anyio.BrokenResourceError,
                    OSError,
                ):
                    break
                if isinstance(frame, OversizedFrame):
                    await self._child_oversized(child, frame)
                    continue
                try:
                    await self._from_child(child, jsonrpc.decode(frame), frame)
                except Exception:  # a bug here must not take every connection down
                    logger.exception("failed to handle a message from the agent")
        finally:
            self._child_died(child)

    async def _child_oversized(self, child: _Child, frame: OversizedFrame) -> None:
        id = sniff_request_id(frame.head)
        logger.warning("the agent sent a message of %d bytes, over the limit", frame.size)
        if id is None:
            return
        if b'"method"' in frame.head:
            self._answer_child(child, _error(id, InvalidRequest("Message too large")))
            return
        forward = child.forwards.pop(id, None)
        if forward is not None:
            forward.remote.forwards.pop(forward.remote_id, None)
            await forward.remote.put(
                _error(forward.remote_id, InternalError("The agent's answer was too large"))
            )

    async def _from_child(self, child: _Child, msg: jsonrpc.Message, frame: bytes) -> None:
        # Never blocks: anything for a remote connection is queued, anything for the child
        # is written by a task (writing inline could deadlock with a child that is itself
        # blocked writing to us).
        match msg:
            case jsonrpc.Response(id=id) | jsonrpc.ErrorResponse(id=id):
                if id is None:
                    logger.warning("the agent sent an error without an id")
                elif id in child.calls:
                    child.answers[id] = msg
                    child.calls.pop(id).set()
                else:
                    await self._child_answered(child, id, msg)
            case jsonrpc.Request(id=id, method=method, params=params):
                if id in child.asks:
                    self._answer_child(child, _error(None, InvalidRequest("Request id in use")))
                    return
                ask = _Ask(child, id, method, params)
                child.asks[id] = ask
                await self._route_ask(ask)
            case jsonrpc.Notification(method=method, params=params):
                await self._child_notified(child, method, params, frame)
            case jsonrpc.Invalid(code=code):
                logger.warning("the agent sent an invalid message (%d)", code)

    async def _child_answered(
        self, child: _Child, id: RequestId, msg: jsonrpc.Response | jsonrpc.ErrorResponse
    ) -> None:
        forward = child.forwards.pop(id, None)
        if forward is None:
            return  # a request whose remote connection gave up on it
        remote = forward.remote
        remote.forwards.pop(forward.remote_id, None)
        ok = isinstance(msg, jsonrpc.Response)
        result = msg.result if isinstance(msg, jsonrpc.Response) else None
        self._track(forward, ok, result)
        if isinstance(msg, jsonrpc.Response):
            await remote.put(_result(forward.remote_id, msg.result))
        else:
            await remote.put(_error(forward.remote_id, msg.error))

    def _track(self, forward: _Forward, ok: bool, result: Any) -> None:
        """Which sessions are active on which remote connection, from the child's answers."""
        remote, sid = forward.remote, forward.session_id
        method = forward.method
        if method == m.SESSION_RESUME and sid is not None:
            _count(remote.attaching, sid, -1)
            if forward.replay:
                _count(remote.replaying, sid, -1)
            if ok:
                remote.sessions.add(sid)
        elif method in (m.SESSION_NEW, m.SESSION_FORK) and ok and isinstance(result, dict):
            new = result.get("sessionId")
            if isinstance(new, str):
                remote.sessions.add(new)
        elif method == m.SESSION_CLOSE and sid is not None:
            remote.sessions.discard(sid)
        elif method == m.SESSION_DELETE and sid is not None and ok:
            for other in self._remotes:
                other.sessions.discard(sid)
            remote.sessions.discard(sid)

    async def _child_notified(
        self, child: _Child, method: str, params: dict[str, Any] | None, frame: bytes
    ) -> None:
        if method == m.CANCEL_REQUEST:
            request_id = _cancelled_id(params)
            ask = child.asks.get(request_id) if request_id is not None else None
            if ask is not None and ask.remote is not None and ask.remote_id is not None:
                await ask.remote.put(_cancel(ask.remote_id))
            return
        sid = _session_id(params)
        if sid is None:
            for remote in list(self._remotes):
                if remote.gate.initialized:
                    await remote.put(frame)
            return
        targets = [r for r in self._remotes if r.active(sid)]
        replaying = [r for r in targets if sid in r.replaying]
        for remote in replaying or targets:
            await remote.put(frame)
        update = (params or {}).get("update")
        if isinstance(update, dict) and update.get("sessionUpdate") == "state_update":
            if update.get("state") == "idle":
                self._busy.discard(sid)
                idle = self._idle.pop(sid, None)
                if idle is not None:
                    idle.set()
            else:
                self._busy.add(sid)

    async def _route_ask(self, ask: _Ask, avoid: _Remote | None = None) -> None:
        """Send the child's request to a remote connection its session is active on, or give
        the child the method's cancellation answer when there is none."""
        sid = ask.session_id
        remote = next(
            (
                r
                for r in self._remotes
                if r is not avoid and not r.ended and sid is not None and r.active(sid)
            ),
            None,
        )
        if remote is None:
            ask.child.asks.pop(ask.child_id, None)
            if ask.method == m.SESSION_REQUEST_PERMISSION:
                answer = _result(ask.child_id, {"outcome": {"outcome": "cancelled"}})
            else:
                answer = _error(ask.child_id, RequestCancelled("No client can answer it"))
            self._answer_child(ask.child, answer)
            return
        remote_id = f"bridge-{next(remote.ids)}"
        ask.remote, ask.remote_id = remote, remote_id
        remote.asks[remote_id] = ask
        await remote.put(_request(remote_id, ask.method, ask.params))

    def _answer_child(self, child: _Child, frame: bytes) -> None:
        if child.alive:
            child.tg.start_soon(self._to_child, child, frame)

    # -- the remote side -------------------------------------------------------------------

    async def serve(self, frames: FrameStream, name: str) -> None:
        """Serve one remote connection until it ends (an `acp_once.server.ConnectionHandler`).

        Never raises for what the peer does; its frames are closed on return (1001 when the
        child it depended on died or the bridge stops, 1008 when it read too slowly)."""
        remote = _Remote(frames, name, self.queue, self.stall_timeout)
        self._remotes[remote] = None
        try:
            with remote.scope:
                async with anyio.create_task_group() as tg:
                    remote.tg = tg
                    tg.start_soon(self._write_remote, remote)
                    await self._read_remote(remote)
                    tg.cancel_scope.cancel()
        finally:
            remote.ended = True
            self._remotes.pop(remote, None)
            with anyio.CancelScope(shield=True), anyio.move_on_after(_SHIELDED_WRITE):
                await self._release(remote)
                if isinstance(frames, ServerWebSocketFrames):
                    await frames.close(remote.close_code)
                else:
                    await frames.aclose()
            remote.out_send.close()
            remote.out_recv.close()

    async def _release(self, remote: _Remote) -> None:
        """What a remote connection leaves behind when it ends (D11, see the module docstring)."""
        cancels: list[tuple[_Child, RequestId]] = []
        for child, child_id in remote.forwards.values():
            forward = child.forwards.get(child_id)
            if forward is None or not child.alive:
                continue
            if forward.method == m.SESSION_PROMPT and self._awaited_elsewhere(child, forward):
                continue
            cancels.append((child, child_id))
        remote.forwards.clear()
        asks = list(remote.asks.values())
        remote.asks.clear()
        for ask in asks:
            ask.remote = ask.remote_id = None
            if ask.child.alive and ask.child_id in ask.child.asks:
                await self._route_ask(ask, avoid=remote)
        for child, child_id in cancels:
            await self._to_child(child, _cancel(child_id))

    def _awaited_elsewhere(self, child: _Child, forward: _Forward) -> bool:
        if forward.key is None:
            return False
        return any(
            other is not forward
            and not other.remote.ended
            and other.method == m.SESSION_PROMPT
            and other.session_id == forward.session_id
            and other.key == forward.key
            for other in child.forwards.values()
        )

    async def _write_remote(self, remote: _Remote) -> None:
        async for frame in remote.out_recv:
            try:
                with anyio.fail_after(self.send_timeout):
                    await remote.frames.send(frame)
            except TimeoutError:
                logger.warning(
                    "%s: the client stopped reading; closing the connection", remote.name
                )
                remote.end(CLOSE_POLICY)
                return
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                remote.end(CLOSE_NORMAL)
                return

    async def _read_remote(self, remote: _Remote) -> None:
        while True:
            try:
                frame = await remote.frames.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError:
                return
            if isinstance(frame, OversizedFrame):
                logger.warning("%s: dropped a message of %d bytes", remote.name, frame.size)
                if b'"method"' in frame.head:
                    error = InvalidRequest("Message exceeds the maximum frame size")
                    await remote.put(_error(sniff_request_id(frame.head), error))
                continue
            match jsonrpc.decode(frame):
                case jsonrpc.Request() as request:
                    await self._remote_request(remote, request)
                case jsonrpc.Notification() as notification:
                    await self._remote_notification(remote, notification, frame)
                case jsonrpc.Response() | jsonrpc.ErrorResponse() as answer:
                    await self._remote_answer(remote, answer)
                case jsonrpc.Invalid(code=code, message=message, id=id, answer=answer):
                    if answer:
                        await remote.put(_error(id, {"code": code, "message": message}))

    async def _remote_request(self, remote: _Remote, msg: jsonrpc.Request) -> None:
        if msg.id in remote.forwards:
            # digest D19: echoing the id would look like the original's answer
            await remote.put(_error(None, InvalidRequest("Request id is already in use")))
            return
        try:
            remote.gate.admit_request(msg.method)
        except AcpError as exc:
            await remote.put(_error(msg.id, exc))
            return
        if msg.method == m.INITIALIZE:
            await self._remote_initialize(remote, msg)
            return
        sid = _session_id(msg.params)
        if sid is not None and msg.method == m.SESSION_CLOSE:
            if not remote.active(sid):
                await remote.put(_result(msg.id, {}))  # D24: closing an inactive session succeeds
                return
            if any(r is not remote and r.active(sid) for r in self._remotes):
                # the child's only connection keeps the session for the others: stop its work
                # as a close would, and detach it from this connection alone
                child = self._child
                if child is not None:
                    cancel = {"sessionId": sid}
                    await self._to_child(
                        child,
                        _dumps({"jsonrpc": "2.0", "method": m.SESSION_CANCEL, "params": cancel}),
                    )
                assert remote.tg is not None
                remote.tg.start_soon(self._close_here, remote, msg.id, sid)
                return
        elif sid is not None and msg.method in _ACTIVE_ONLY and not remote.active(sid):
            await remote.put(_error(msg.id, SessionNotFound(sid)))
            return
        try:
            child = await self._ready_child()
        except _Unavailable:
            await remote.put(_error(msg.id, InternalError("The agent is not available; try again")))
            return
        params = msg.params
        key = params.get("idempotencyKey") if params and msg.method == m.SESSION_PROMPT else None
        replay = bool(params and msg.method == m.SESSION_RESUME and params.get("replayFrom"))
        child_id = next(child.ids)
        forward = _Forward(
            remote, msg.id, msg.method, sid, key if isinstance(key, str) else None, replay
        )
        child.forwards[child_id] = forward
        remote.forwards[msg.id] = (child, child_id)
        if msg.method == m.SESSION_RESUME and sid is not None:
            _count(remote.attaching, sid, 1)
            if replay:
                _count(remote.replaying, sid, 1)
        await self._to_child(child, _request(child_id, msg.method, params))

    async def _close_here(self, remote: _Remote, id: RequestId, sid: str) -> None:
        """Answer a close that stays on this connection: like the agent's close, after the
        cancelled work's final updates and idle state (bounded), then detach."""
        if sid in self._busy:
            event = self._idle.setdefault(sid, anyio.Event())
            with anyio.move_on_after(self.close_timeout):
                await event.wait()
        remote.sessions.discard(sid)
        await remote.put(_result(id, {}))

    async def _remote_initialize(self, remote: _Remote, msg: jsonrpc.Request) -> None:
        ok = False
        try:
            request = s.InitializeRequest.model_validate(msg.params or {})
            child = await self._ready_child()
            version = negotiate_version(request.protocol_version, [child.version])
            await remote.put(_result(msg.id, {**child.init_result, "protocolVersion": version}))
            ok = True
        except ValidationError as exc:
            await remote.put(_error(msg.id, invalid_params_from_validation(exc)))
        except AcpError as exc:
            await remote.put(_error(msg.id, exc))
        except _Unavailable:
            await remote.put(_error(msg.id, InternalError("The agent is not available; try again")))
        finally:
            remote.gate.initialize_done(ok)

    async def _remote_notification(
        self, remote: _Remote, msg: jsonrpc.Notification, frame: bytes
    ) -> None:
        if not remote.gate.admit_notification(msg.method):
            return
        if msg.method == m.CANCEL_REQUEST:
            request_id = _cancelled_id(msg.params)
            pending = remote.forwards.get(request_id) if request_id is not None else None
            if pending is not None:  # unknown or answered ids: dropped
                await self._to_child(pending[0], _cancel(pending[1]))
            return
        if msg.method == m.SESSION_CANCEL:
            sid = _session_id(msg.params)
            if sid is None or not remote.active(sid):
                return
        child = self._child
        if child is not None:
            await self._to_child(child, frame)

    async def _remote_answer(
        self, remote: _Remote, msg: jsonrpc.Response | jsonrpc.ErrorResponse
    ) -> None:
        if msg.id is None:
            return
        ask = remote.asks.pop(msg.id, None)
        if ask is None:
            return
        child = ask.child
        if child.asks.pop(ask.child_id, None) is None:
            return
        if isinstance(msg, jsonrpc.Response):
            await self._to_child(child, _result(ask.child_id, msg.result))
        else:
            await self._to_child(child, _error(ask.child_id, msg.error))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("acp-once")
    except PackageNotFoundError:
        return "0"
