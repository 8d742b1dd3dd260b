"""`Bridge`: the JSON-RPC proxy between remote connections and one supervised child agent.

It reads each remote connection in arrival order and the child's frames, and puts the three
other modules together: `supervisor` (the child process), `translation` (ids per hop) and
`routing` (sessions per connection). What it promises is in the package docstring.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Self

import anyio
from pydantic import ValidationError

from acp_once.protocol import jsonrpc
from acp_once.protocol import methods as m
from acp_once.protocol import schema as s
from acp_once.protocol.errors import (
    AcpError,
    InternalError,
    InvalidRequest,
    SessionNotFound,
    invalid_params_from_validation,
)
from acp_once.protocol.framing import FrameEvent, OversizedFrame, sniff_request_id
from acp_once.protocol.initialization import PROTOCOL_VERSION, negotiate_version
from acp_once.protocol.jsonrpc import RequestId
from acp_once.rpc.connection import DEFAULT_MAX_BATCH, unwrap_single_exception
from acp_once.rpc.streams import FrameStream
from acp_once.support.backoff import Backoff
from acp_once.transports.websocket import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    ServerWebSocketFrames,
)

from .routing import ACTIVE_ONLY, BatchReply, Remote, Router
from .supervisor import DEFAULT_BACKOFF, Child, Supervisor, Unavailable
from .translation import Ask, Forward, Translator, session_id
from .v1 import PutBack, asks_for_v1, serve_v1

__all__ = ["Bridge"]

logger = logging.getLogger("acp_once.bridge")

_SHIELDED_WRITE = 5.0


def _error(id: RequestId | None, error: AcpError | dict[str, Any]) -> bytes:
    return jsonrpc.encode_error(id, error)


def _unavailable(id: RequestId) -> bytes:
    return _error(id, InternalError("The agent is not available; try again"))


class Bridge(anyio.AsyncContextManagerMixin):
    """Serves one stdio agent (`command`) to many remote connections (see `acp_once.bridge`).

    Use as `async with Bridge(command) as bridge:` and pass `bridge.serve` as the `handler` of
    `acp_once.server.create_app`. Entering starts the child and initializes it; leaving closes
    the remote connections and stops the child (stdin closed, then SIGTERM, then SIGKILL).

    Args:
        command: the agent's command line.
        env: the child's environment (default: ours without our secrets, `ACP_ONCE_TOKEN`).
        cwd: the child's working directory (default: ours).
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
        initialize = {
            "protocolVersion": PROTOCOL_VERSION,
            "info": dict(info or {"name": "acp-once-bridge", "version": _version()}),
            "capabilities": dict(client_capabilities or {}),
        }
        self._supervisor = Supervisor(
            command,
            self,
            env=env,
            cwd=cwd,
            initialize=initialize,
            backoff=backoff,
            stable_after=stable_after,
            ready_timeout=ready_timeout,
            send_timeout=send_timeout,
            stderr=stderr,
            shutdown_timeout=shutdown_timeout,
        )
        self._send_timeout = send_timeout
        self._queue = queue
        self._stall_timeout = stall_timeout
        self._close_timeout = close_timeout
        self._router = Router()
        self._hops = Translator()
        self._owners: dict[str, str] = {}
        """The tenant of each session created or forked through the bridge by a connection
        with one (memory only: sessions from before a restart belong to no tenant)."""

    @property
    def restarts(self) -> int:
        """How many times the child was started again."""
        return self._supervisor.restarts

    @property
    def pid(self) -> int | None:
        """The running child's process id (None while it restarts)."""
        return self._supervisor.pid

    async def wait_ready(self) -> int:
        """Wait until an initialized agent is running (bound it with a timeout); returns its
        process id."""
        return (await self._supervisor.wait_ready()).proc.pid

    @property
    def connections(self) -> int:
        """How many remote connections are being served."""
        return len(self._router.remotes)

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Self]:
        with unwrap_single_exception():
            async with anyio.create_task_group() as tg:
                await tg.start(self._supervisor.run)
                try:
                    yield self
                finally:
                    for remote in list(self._router.remotes):
                        remote.end(CLOSE_GOING_AWAY)
                    tg.cancel_scope.cancel()

    # -- the child's side (a `ChildListener`) ------------------------------------------------

    def child_exited(self, child: Child) -> None:
        """End the remote connections with state in the dead child (their clients reconnect
        and resume), forget its requests."""
        touched = self._hops.child_exited(child)
        for remote in list(self._router.remotes):
            if remote in touched or remote.sessions or remote.attaching:
                remote.end(CLOSE_GOING_AWAY)
        self._router.child_exited()

    async def child_oversized(self, child: Child, frame: OversizedFrame) -> None:
        id = sniff_request_id(frame.head)
        logger.warning("the agent sent a message of %d bytes, over the limit", frame.size)
        if id is None:
            return
        if b'"method"' in frame.head:
            child.send_soon(_error(id, InvalidRequest("Message too large")))
            return
        lost = self._hops.lost(child, id, InternalError("The agent's answer was too large"))
        if lost is not None:
            await lost[0].put(lost[1])

    async def child_message(self, child: Child, msg: jsonrpc.Message, frame: bytes) -> None:
        # Never blocks: anything for a remote connection is queued, anything for the child
        # is written by a task (writing inline could deadlock with a child that is itself
        # blocked writing to us).
        match msg:
            case jsonrpc.Response(id=id) | jsonrpc.ErrorResponse(id=id):
                if id is None:
                    logger.warning("the agent sent an error without an id")
                    return
                answered = self._hops.answered(child, msg)
                if answered is not None:
                    forward, out = answered
                    ok = isinstance(msg, jsonrpc.Response)
                    result = msg.result if isinstance(msg, jsonrpc.Response) else None
                    remote = forward.remote
                    self._router.track(
                        remote, forward.method, forward.session_id, forward.replay, ok, result
                    )
                    if remote.tenant is not None and ok:
                        out = self._tenant_answer(remote.tenant, forward, result) or out
                    await remote.put(out)
            case jsonrpc.Request() as request:
                ask = self._hops.ask(child, request)
                if ask is None:
                    child.send_soon(_error(None, InvalidRequest("Request id in use")))
                    return
                await self._route_ask(ask)
            case jsonrpc.Notification(method=method, params=params):
                await self._child_notified(child, method, params, frame)
            case jsonrpc.Invalid(code=code):
                logger.warning("the agent sent an invalid message (%d)", code)
            case jsonrpc.Batch():
                # D44: the bridge never sends the child a batch, and takes none from it
                logger.warning("the agent sent a batch; refused")
                child.send_soon(_error(None, InvalidRequest("The bridge takes no batches")))

    def _tenant_answer(self, tenant: str, forward: Forward, result: Any) -> bytes | None:
        """Record the tenant of a session its `session/new` or `session/fork` created; keep
        only the tenant's own sessions in a `session/list` (a new frame; None: `out` as is)."""
        method = forward.method
        if method in (m.SESSION_NEW, m.SESSION_FORK) and isinstance(result, dict):
            sid = result.get("sessionId")
            if isinstance(sid, str):
                self._owners[sid] = tenant
        elif method == m.SESSION_DELETE and forward.session_id is not None:
            self._owners.pop(forward.session_id, None)
        elif method == m.SESSION_LIST and isinstance(result, dict):
            sessions = result.get("sessions")
            if isinstance(sessions, list):
                own = [entry for entry in sessions if self._owned(entry, tenant)]
                return jsonrpc.encode_result(forward.remote_id, {**result, "sessions": own})
        return None

    def _owned(self, entry: Any, tenant: str) -> bool:
        sid = entry.get("sessionId") if isinstance(entry, dict) else None
        return isinstance(sid, str) and self._owners.get(sid) == tenant

    def _foreign(self, remote: Remote, sid: str | None) -> bool:
        """Whether `remote` carries a tenant and `sid` is not one of that tenant's sessions
        (another tenant's, or unknown to the bridge): answered as a missing session."""
        return (
            remote.tenant is not None and sid is not None and self._owners.get(sid) != remote.tenant
        )

    async def _child_notified(
        self, child: Child, method: str, params: dict[str, Any] | None, frame: bytes
    ) -> None:
        if method == m.CANCEL_REQUEST:
            cancel = self._hops.cancel_from_child(child, params)
            if cancel is not None:
                await cancel[0].put(cancel[1])
            return
        sid = session_id(params)
        for remote in self._router.notification_targets(sid):
            await remote.put(frame)
        if sid is not None:
            self._router.updated(sid, (params or {}).get("update"))

    async def _route_ask(self, ask: Ask, avoid: Remote | None = None) -> None:
        """Send the child's request to a remote connection its session is active on, or give
        the child the method's cancellation answer when there is none."""
        remote = self._router.asked(ask.session_id, avoid)
        if remote is None:
            ask.child.send_soon(self._hops.withdraw(ask))
            return
        await remote.put(self._hops.send_ask(ask, remote))

    # -- the remote side -------------------------------------------------------------------

    async def serve(self, frames: FrameStream, name: str, tenant: str | None = None) -> None:
        """Serve one remote connection until it ends (an `acp_once.server.ConnectionHandler`).

        `tenant`: the tenant whose token the connection carries (see the package docstring);
        None without tenants. Never raises for what the peer does; its frames are closed on
        return (1001 when the child it depended on died or the bridge stops, 1008 when it read
        too slowly). A connection whose first message is an `initialize` asking for v1 is
        served through the agent side's v1 face (`acp_once.bridge.v1`)."""
        try:
            first = await frames.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            with anyio.CancelScope(shield=True), anyio.move_on_after(_SHIELDED_WRITE):
                await frames.aclose()
            return
        if asks_for_v1(first):
            await serve_v1(self._serve_v2, first, frames, name, tenant)
        else:
            await self._serve_v2(frames, name, tenant, first)

    async def _serve_v2(
        self,
        frames: FrameStream,
        name: str,
        tenant: str | None = None,
        first: FrameEvent | None = None,
    ) -> None:
        """`serve` for a v2 connection; `first`: its first frame, read already."""
        reading = PutBack(first, frames) if first is not None else frames
        remote = Remote(reading, name, self._queue, self._stall_timeout, tenant)
        self._router.remotes[remote] = None
        try:
            with remote.scope:
                async with anyio.create_task_group() as tg:
                    remote.tg = tg
                    tg.start_soon(self._write_remote, remote)
                    await self._read_remote(remote)
                    tg.cancel_scope.cancel()
        finally:
            remote.ended = True
            self._router.remotes.pop(remote, None)
            with anyio.CancelScope(shield=True), anyio.move_on_after(_SHIELDED_WRITE):
                await self._release(remote)
                if isinstance(frames, ServerWebSocketFrames):
                    await frames.close(remote.close_code)
                else:
                    await frames.aclose()
            remote.out_send.close()
            remote.out_recv.close()

    async def _release(self, remote: Remote) -> None:
        """What a remote connection leaves behind when it ends (see the package docstring):
        the child's requests it left unanswered go to another connection, its own pending
        requests are cancelled at the child."""
        cancels, asks = self._hops.release(remote)
        for ask in asks:
            if self._hops.asking(ask):
                await self._route_ask(ask, avoid=remote)
        for child, frame in cancels:
            await child.send(frame)

    async def _write_remote(self, remote: Remote) -> None:
        async for frame in remote.out_recv:
            try:
                with anyio.fail_after(self._send_timeout):
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

    async def _read_remote(self, remote: Remote) -> None:
        while True:
            try:
                frame = await remote.frames.receive()
            except (
                anyio.EndOfStream,
                anyio.ClosedResourceError,
                anyio.BrokenResourceError,
                OSError,
            ):
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
                    answered = self._hops.answer_ask(remote, answer)
                    if answered is not None:
                        await answered[0].send(answered[1])
                case jsonrpc.Invalid(code=code, message=message, id=id, answer=answer):
                    if answer:
                        await remote.put(_error(id, {"code": code, "message": message}))
                case jsonrpc.Batch(entries=entries):
                    await self._remote_batch(remote, entries)

    async def _remote_batch(self, remote: Remote, entries: list[Any]) -> None:
        """Split a batch into lone messages for the child, and join their answers into one
        array for the client (D44); each entry meets every rule on its own (D40)."""
        if len(entries) > DEFAULT_MAX_BATCH:
            limit = f"A batch may hold at most {DEFAULT_MAX_BATCH} messages"
            await remote.put(_error(None, InvalidRequest(limit)))
            return
        reply = BatchReply()
        taken: set[RequestId] = set()
        try:
            for entry in entries:
                msg = jsonrpc.decode_entry(entry)
                match msg:
                    case jsonrpc.Request(id=id):
                        reply.expected += 1
                        if id in taken or id in remote.batched or self._hops.in_use(remote, id):
                            # D19, also for two entries of one batch with one id
                            in_use = InvalidRequest("Request id is already in use")
                            await remote.add_to_batch(reply, _error(None, in_use))
                            continue
                        taken.add(id)
                        remote.batched[id] = reply  # its answer, whoever makes it, goes there
                        await self._remote_request(remote, msg)
                    case jsonrpc.Notification(method=method, params=params):
                        frame = jsonrpc.encode_notification(method, params)
                        await self._remote_notification(remote, msg, frame)
                    case jsonrpc.Response() | jsonrpc.ErrorResponse() as answer:
                        answered = self._hops.answer_ask(remote, answer)
                        if answered is not None:
                            await answered[0].send(answered[1])
                    case jsonrpc.Invalid(code=code, message=message, id=id, answer=answer):
                        if answer:
                            reply.expected += 1
                            invalid = {"code": code, "message": message}
                            await remote.add_to_batch(reply, _error(id, invalid))
        finally:
            await remote.seal_batch(reply)

    async def _remote_request(self, remote: Remote, msg: jsonrpc.Request) -> None:
        if self._hops.in_use(remote, msg.id):
            # D19: echoing the id would look like the original's answer
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
        sid = session_id(msg.params)
        if self._foreign(remote, sid):
            assert sid is not None
            if msg.method in (m.SESSION_CLOSE, m.SESSION_DELETE):
                # what a missing session gets (both are idempotent); nothing is forwarded
                await remote.put(jsonrpc.encode_result(msg.id, {}))
            else:
                await remote.put(_error(msg.id, SessionNotFound(sid)))
            return
        if sid is not None and msg.method == m.SESSION_CLOSE:
            if not remote.active(sid):
                # D24: closing an inactive session succeeds
                await remote.put(jsonrpc.encode_result(msg.id, {}))
                return
            if self._router.active_elsewhere(remote, sid):
                # the child's only connection keeps the session for the others: stop its work
                # as a close would, and detach it from this connection alone
                child = self._supervisor.child
                if child is not None:
                    cancel = {"sessionId": sid}
                    await child.send(jsonrpc.encode_notification(m.SESSION_CANCEL, cancel))
                assert remote.tg is not None
                remote.tg.start_soon(self._close_here, remote, msg.id, sid)
                return
        elif sid is not None and msg.method in ACTIVE_ONLY and not remote.active(sid):
            await remote.put(_error(msg.id, SessionNotFound(sid)))
            return
        try:
            child = await self._supervisor.ready()
        except Unavailable:
            await remote.put(_unavailable(msg.id))
            return
        forward, frame = self._hops.forward(remote, msg, child)
        if msg.method == m.SESSION_RESUME and sid is not None:
            remote.resuming(sid, forward.replay, 1)
        await child.send(frame)

    async def _close_here(self, remote: Remote, id: RequestId, sid: str) -> None:
        """Answer a close that stays on this connection: like the agent's close, after the
        cancelled work's final updates and idle state (bounded), then detach."""
        await self._router.wait_idle(sid, self._close_timeout)
        remote.sessions.discard(sid)
        await remote.put(jsonrpc.encode_result(id, {}))

    async def _remote_initialize(self, remote: Remote, msg: jsonrpc.Request) -> None:
        ok = False
        try:
            request = s.InitializeRequest.model_validate(msg.params or {})
            child = await self._supervisor.ready()
            version = negotiate_version(request.protocol_version, [child.version])
            result = {**child.init_result, "protocolVersion": version}
            await remote.put(jsonrpc.encode_result(msg.id, result))
            ok = True
        except ValidationError as exc:
            await remote.put(_error(msg.id, invalid_params_from_validation(exc)))
        except AcpError as exc:
            await remote.put(_error(msg.id, exc))
        except Unavailable:
            await remote.put(_unavailable(msg.id))
        finally:
            remote.gate.initialize_done(ok)

    async def _remote_notification(
        self, remote: Remote, msg: jsonrpc.Notification, frame: bytes
    ) -> None:
        if not remote.gate.admit_notification(msg.method):
            return
        if msg.method == m.CANCEL_REQUEST:
            cancel = self._hops.cancel_from_remote(remote, msg.params)
            if cancel is not None:
                await cancel[0].send(cancel[1])
            return
        if msg.method == m.SESSION_CANCEL:
            sid = session_id(msg.params)
            if sid is None or not remote.active(sid):
                return
        child = self._supervisor.child
        if child is not None:
            await child.send(frame)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("acp-once")
    except PackageNotFoundError:
        return "0"
