"""Which remote connection a frame goes to: the bridge's view of the sessions per connection.

A session is active on a remote connection once its `session/new` or `session/fork` answer
names it, or its `session/resume` succeeds; while a resume is in flight the connection is
attaching and already receives the session's updates (the replay and the state snapshot).
`Router.track` keeps this from the child's answers; the rest of the bridge asks it where a
notification or a request of the child goes.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
from anyio.abc import TaskGroup

from acp_once.protocol import jsonrpc
from acp_once.protocol import methods as m
from acp_once.protocol.initialization import InitializeGate
from acp_once.protocol.jsonrpc import RequestId
from acp_once.rpc.streams import FrameStream
from acp_once.transports.websocket import CLOSE_NORMAL, CLOSE_POLICY

__all__ = ["ACTIVE_ONLY", "BatchReply", "Remote", "Router"]

logger = logging.getLogger("acp_once.bridge")

ACTIVE_ONLY = frozenset(
    {
        m.SESSION_PROMPT,
        m.SESSION_FORK,
        m.SESSION_SET_CONFIG_OPTION,
        m.TOOL_CALL_CANCEL,
        m.TERMINAL_CANCEL,
    }
)
"""Session-scoped requests that need the session active on the connection (else -32002)."""


# how every answer the bridge writes starts (the encoders write `jsonrpc` and `id` first)
_ANSWER_PREFIX = b'{"jsonrpc":"2.0","id":'


class BatchReply:
    """The answers to one batch of a remote connection, written to it as one array once the
    last is in (D44). `expected` counts the answers its entries get; `sealed` is set once
    every entry was taken."""

    __slots__ = ("expected", "frames", "sealed")

    def __init__(self) -> None:
        self.expected = 0
        self.frames: list[bytes] = []
        self.sealed = False


class Remote:
    """One remote connection (WebSocket or Streamable HTTP): its outgoing queue, its
    initialize rules and the sessions active on it.

    Attributes:
        ended: set once the connection is ending; nothing more is queued for it.
        close_code: the WebSocket close code it ends with.
    """

    def __init__(
        self, frames: FrameStream, name: str, queue: int, stall: float, tenant: str | None = None
    ) -> None:
        self.frames = frames
        self.name = name
        self.tenant = tenant
        """The tenant whose token the connection carries (None: no tenants)."""
        self.stall = stall
        self.gate = InitializeGate()
        self.sessions: set[str] = set()
        self.attaching: dict[str, int] = {}
        """Sessions with a `session/resume` in flight (they get its replay and snapshot)."""
        self.replaying: dict[str, int] = {}
        """Of those, the resumes that asked for replay."""
        self.out_send, self.out_recv = anyio.create_memory_object_stream[bytes](queue)
        self.scope = anyio.CancelScope()
        self.tg: TaskGroup | None = None
        self.ended = False
        self.close_code = CLOSE_NORMAL
        self.batched: dict[RequestId, BatchReply] = {}
        """Remote ids of batch entries awaiting their answer, with the batch it goes into."""

    def active(self, session_id: str) -> bool:
        return session_id in self.sessions or session_id in self.attaching

    def resuming(self, session_id: str, replay: bool, delta: int) -> None:
        """Count a `session/resume` of `session_id` in flight (`delta` 1) or done (-1)."""
        _count(self.attaching, session_id, delta)
        if replay:
            _count(self.replaying, session_id, delta)

    async def put(self, frame: bytes) -> None:
        """Queue a frame for this connection. A full queue holds the caller back for up to
        `stall` seconds (backpressure, so a burst such as a long replay gets through), then
        ends the connection: one slow client must not hold up the others for long.

        The answer to an entry of a pending batch goes into that batch's array instead."""
        if self.batched and frame.startswith(_ANSWER_PREFIX):
            msg = jsonrpc.decode(frame)
            if isinstance(msg, jsonrpc.Response | jsonrpc.ErrorResponse) and msg.id is not None:
                reply = self.batched.pop(msg.id, None)
                if reply is not None:
                    await self.add_to_batch(reply, frame)
                    return
        await self._put(frame)

    async def add_to_batch(self, reply: BatchReply, frame: bytes) -> None:
        """Keep one answer of `reply`'s batch; write the array if it was the last."""
        reply.frames.append(frame)
        await self._write_batch(reply)

    async def seal_batch(self, reply: BatchReply) -> None:
        """Every entry of `reply`'s batch was taken: write the array once all are answered
        (nothing for a batch of notifications and responses)."""
        reply.sealed = True
        await self._write_batch(reply)

    async def _write_batch(self, reply: BatchReply) -> None:
        if reply.sealed and reply.frames and len(reply.frames) >= reply.expected:
            frames, reply.frames = reply.frames, []
            await self._put(jsonrpc.encode_batch(frames))

    async def _put(self, frame: bytes) -> None:
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


class Router:
    """The remote connections being served (oldest first) and the sessions' state as the
    child's updates tell it."""

    def __init__(self) -> None:
        self.remotes: dict[Remote, None] = {}  # an ordered set: oldest first
        self._busy: set[str] = set()
        """Sessions whose latest state_update from the child was not idle."""
        self._idle: dict[str, anyio.Event] = {}

    def track(
        self, remote: Remote, method: str, sid: str | None, replay: bool, ok: bool, result: Any
    ) -> None:
        """Which sessions are active on which remote connection, from the child's answer to
        `remote`'s request `method` about session `sid`."""
        if method == m.SESSION_RESUME and sid is not None:
            remote.resuming(sid, replay, -1)
            if ok:
                remote.sessions.add(sid)
        elif method in (m.SESSION_NEW, m.SESSION_FORK) and ok and isinstance(result, dict):
            new = result.get("sessionId")
            if isinstance(new, str):
                remote.sessions.add(new)
        elif method == m.SESSION_CLOSE and sid is not None:
            remote.sessions.discard(sid)
        elif method == m.SESSION_DELETE and sid is not None and ok:
            for other in self.remotes:
                other.sessions.discard(sid)
            remote.sessions.discard(sid)

    def active_elsewhere(self, remote: Remote, sid: str) -> bool:
        return any(r is not remote and r.active(sid) for r in self.remotes)

    def notification_targets(self, sid: str | None) -> list[Remote]:
        """Where the child's notification about session `sid` goes: every initialized remote
        connection without a session; with one, the connections it is active on, or only
        those resuming it with replay while there are some (so others do not see the history
        twice)."""
        if sid is None:
            return [r for r in self.remotes if r.gate.initialized]
        targets = [r for r in self.remotes if r.active(sid)]
        return [r for r in targets if sid in r.replaying] or targets

    def asked(self, sid: str | None, avoid: Remote | None = None) -> Remote | None:
        """The remote connection a request of the child about `sid` goes to, if any."""
        if sid is None:
            return None
        return next(
            (r for r in self.remotes if r is not avoid and not r.ended and r.active(sid)),
            None,
        )

    def updated(self, sid: str, update: Any) -> None:
        """Follow the session's `state_update`s: a close kept on one connection waits for
        idle."""
        if not isinstance(update, dict) or update.get("sessionUpdate") != "state_update":
            return
        if update.get("state") == "idle":
            self._busy.discard(sid)
            idle = self._idle.pop(sid, None)
            if idle is not None:
                idle.set()
        else:
            self._busy.add(sid)

    async def wait_idle(self, sid: str, timeout: float) -> None:
        """Wait up to `timeout` until the child says `sid` is idle (at once if it is)."""
        if sid in self._busy:
            event = self._idle.setdefault(sid, anyio.Event())
            with anyio.move_on_after(timeout):
                await event.wait()

    def child_exited(self) -> None:
        """The child died: no session is busy any more; wake whoever waits for idle."""
        self._busy.clear()
        for idle in self._idle.values():
            idle.set()
        self._idle.clear()
