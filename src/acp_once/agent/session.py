"""One session in this process: its broadcast, its inbox and its turn runner; the event sink.

`Session` ties together what `SessionAgent` keeps per loaded session: the `SessionBroadcast`
(the connections it is active on, the one way updates go out), the `SessionInbox` (keyed
prompts until the store commits them, `acp_once.agent.inbox`) and the `TurnRunner` (its worker,
`acp_once.agent.turns`).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from acp_once.agent.inbox import InboxRules, SessionInbox
from acp_once.agent.turns import TurnRunner, TurnSetup
from acp_once.protocol.errors import RequestCancelled
from acp_once.protocol.jsonrpc import encode_notification
from acp_once.protocol.methods import SESSION_UPDATE
from acp_once.rpc.errors import ConnectionClosed

if TYPE_CHECKING:
    from acp_once.agent.calls import AgentConnection
    from acp_once.agent.state import PendingPrompt
    from acp_once.protocol.errors import AcpError
    from acp_once.storage.base import SessionRecord

__all__ = ["Remote", "Session", "SessionBroadcast", "SessionEvents"]

Remote = Callable[[str, dict[str, Any]], None]
"""`(session_id, update)`: hand an update to the other processes of a cluster (never blocks)."""
TurnEndedListener = Callable[[str, str, dict[str, Any]], None]


class SessionBroadcast:
    """How a session's updates go out: one path for what this process sends (`send`: its own
    connections and, in a cluster, the other nodes) and for what another node sent
    (`send(update, share=False)`: this process's connections only). A v1 connection's face
    subscribes to "turn ended" (`turn_ended`) when it attaches."""

    __slots__ = ("_ended", "_remote", "conns", "last_end", "session_id")

    def __init__(self, session_id: str, remote: Remote | None) -> None:
        self.session_id = session_id
        self.conns: dict[str, AgentConnection] = {}
        self._remote = remote
        self._ended: dict[str, TurnEndedListener] = {}
        self.last_end: dict[str, Any] | None = None
        """The last turn end record (`state.turn_end`) sent, here or by another node: what a
        resume's idle snapshot repeats, so it agrees with the live stream (A10)."""

    def attach(self, conn: AgentConnection) -> None:
        """The session is active on `conn` from now on."""
        self.conns[conn.id] = conn
        face = conn.v1_face
        if face is not None:  # a v1 client: its prompt is answered when its turn ends
            self._ended[conn.id] = face.turn_ended

    def detach(self, conn_id: str) -> bool:
        """The session is no longer active on `conn_id`; False when it was not."""
        self._ended.pop(conn_id, None)
        return self.conns.pop(conn_id, None) is not None

    async def send(self, update: dict[str, Any], *, share: bool = True) -> None:
        """Send one update to every connection the session is active on: this process's and,
        with `share` (an update of this process, not one another node sent), the other
        nodes'."""
        if share and self._remote is not None:
            self._remote(self.session_id, update)
        if update.get("sessionUpdate") == "state_update" and update.get("state") == "idle":
            self.last_end = update if "_meta" in update else None
        conns = self.conns
        if not conns:
            return
        # encoded once, whatever the number of connections
        sid = self.session_id
        frame = encode_notification(SESSION_UPDATE, {"sessionId": sid, "update": update})
        for conn in list(conns.values()):
            try:
                face = conn.v1_face
                if face is not None:  # a v1 client: its face translates (v1face.py)
                    await face.session_update(sid, update)
                # no coroutine when the frame can be queued at once (the common case)
                elif not conn.rpc.send_encoded_nowait(frame):
                    await conn.rpc.send_encoded(frame)
            except ConnectionClosed:
                self.detach(conn.id)

    def turn_ended(self, message_id: str, idle: dict[str, Any]) -> None:
        """Tell the "turn ended" subscribers how the turn of `message_id` ended (its idle
        update; the idle update itself is sent only after the last queued turn)."""
        if not self._ended:
            return
        for listener in list(self._ended.values()):
            listener(self.session_id, message_id, idle)


class Session:
    """One session's state in this process."""

    __slots__ = ("broadcast", "id", "inbox", "record", "runner", "users")

    def __init__(
        self,
        record: SessionRecord,
        rules: InboxRules,
        setup: TurnSetup,
        *,
        remote: Remote | None,
        on_stop: Callable[[Session], None],
    ) -> None:
        self.record = record
        self.id = record.session_id
        """The session id (an attribute: read ~10 times per prompt turn)."""
        self.broadcast = SessionBroadcast(self.id, remote)
        self.runner = TurnRunner(
            self.id,
            setup,
            publish=self.broadcast.send,
            turn_ended=self.broadcast.turn_ended,
            conns=self.broadcast.conns,
            on_stop=functools.partial(on_stop, self),
        )
        self.inbox = SessionInbox(self.id, rules, self.runner)
        self.runner.source = self.inbox
        self.users = 0
        """Requests using the session while it is active on no connection (a `session/resume`
        between loading it and attaching): it must not be dropped from memory meanwhile."""

    @property
    def conns(self) -> dict[str, AgentConnection]:
        """The connections the session is active on, by id."""
        return self.broadcast.conns

    @property
    def pending_by_key(self) -> dict[str, PendingPrompt]:
        return self.inbox.pending_by_key

    @property
    def held(self) -> list[PendingPrompt]:
        return self.inbox.held

    @property
    def running(self) -> bool:
        return self.runner.running

    worker = running

    def idle(self) -> bool:
        """Nothing holds this session in memory: no connection, request, worker, prompt,
        turn, lock holder or cancel mark. Such a session
        can be dropped from memory; it reloads from the store when resumed."""
        runner = self.runner
        return (
            not (
                self.broadcast.conns
                or self.users
                or runner.running
                or runner.turns
                or runner.turn_scope is not None
            )
            and self.inbox.empty()
        )


class SessionEvents:
    """The `PlacementEvents` sink the runtime wires for a shared placement: each event goes to
    the session's inbox, runner or broadcast (a session not loaded here has nothing to do).

    Args:
        sessions: the agent's registry of loaded sessions, by id.
        spawn: runs a step in the agent's task group (a failure is logged, never raised).
        steer: the steer policy (a wake-up during a turn inserts what waits at once).
        cancel_work: what `session/cancel` does to a session.
        recover: finds and deals with a session's unfinished turns; how many there were.
    """

    __slots__ = ("_cancel_work", "_recover", "_sessions", "_spawn", "_steer")

    def __init__(
        self,
        sessions: dict[str, Session],
        *,
        spawn: Callable[..., None],
        steer: bool,
        cancel_work: Callable[[Session], Awaitable[None]],
        recover: Callable[[Session], Awaitable[int]],
    ) -> None:
        self._sessions = sessions
        self._spawn = spawn
        self._steer = steer
        self._cancel_work = cancel_work
        self._recover = recover

    def settle(
        self,
        pending: PendingPrompt,
        *,
        message_id: str | None = None,
        error: AcpError | None = None,
        same_prompt: bool | None = None,
    ) -> None:
        session = self._sessions.get(pending.session_id)
        if session is None:
            pending.finish(message_id=message_id, error=error)
        elif error is None:
            session.inbox.answer(pending, message_id, same_prompt)
        else:
            session.inbox.settle(pending, error=error)

    def resubmit(self, pending: PendingPrompt) -> None:
        session = self._sessions.get(pending.session_id)
        if session is None:
            pending.finish(error=RequestCancelled("The connection closed"))
            return
        session.inbox.forget(pending)
        self._spawn(session.inbox.resubmit, pending)

    def wake(self, session_id: str) -> None:
        session = self._sessions.get(session_id)
        if session is None:
            return
        if not session.runner.running:
            session.runner.start()
        elif self._steer:
            self._spawn(session.inbox.steer)

    def cancelled(self, session_id: str) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            self._spawn(self._cancel_work, session)

    def update(self, session_id: str, update: dict[str, Any]) -> None:
        session = self._sessions.get(session_id)
        if session is not None and session.conns:
            self._spawn(functools.partial(session.broadcast.send, share=False), update)

    def lost(self, session_id: str) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            # its turns can no longer write; the next owner reports them interrupted
            session.runner.stop_turns()

    async def recover(self, session_id: str, *, locked: bool) -> int:
        session = self._sessions.get(session_id)
        if session is None:
            return 0
        if locked:
            return await self._recover(session)
        async with session.inbox.lock:
            found = await self._recover(session)
        session.runner.start()
        return found
