"""Request ids per hop: the bridge's two id spaces and `$/cancel_request` across them.

A remote request gets a fresh child-side id (a `Forward`); the child's answer goes back under
the remote id. A request of the child gets an id of the remote connection it is sent on (an
`Ask`, ids `bridge-N`), and the answer goes back to the child under the child's id. A
`$/cancel_request` is translated likewise, each way; one for an unknown or answered id is
dropped. Every frame is re-encoded by `jsonrpc`'s encoders, which write whatever `decode` read:
params and results travel untouched, a lone surrogate in an `idempotencyKey` included, for the
agent to judge.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from acp_once.protocol import jsonrpc
from acp_once.protocol import methods as m
from acp_once.protocol.errors import AcpError, RequestCancelled
from acp_once.protocol.jsonrpc import RequestId
from acp_once.transports.http import message_session_id

from .routing import Remote
from .supervisor import Child

__all__ = ["Ask", "Forward", "Translator", "session_id"]


def session_id(params: Mapping[str, Any] | None) -> str | None:
    """The `sessionId` of a message's params, if it names one."""
    return message_session_id({"params": params}) if params is not None else None


def _cancel(id: RequestId) -> bytes:
    return jsonrpc.encode_notification(m.CANCEL_REQUEST, {"requestId": id})


def _cancelled_id(params: Mapping[str, Any] | None) -> RequestId | None:
    value = (params or {}).get("requestId")
    return value if jsonrpc.is_request_id(value) else None


def _answer(id: RequestId, msg: jsonrpc.Response | jsonrpc.ErrorResponse) -> bytes:
    if isinstance(msg, jsonrpc.Response):
        return jsonrpc.encode_result(id, msg.result)
    return jsonrpc.encode_error(id, msg.error)


class Forward:
    """A remote request forwarded to the child (by its child-side id)."""

    __slots__ = (
        "child",
        "child_id",
        "key",
        "method",
        "remote",
        "remote_id",
        "replay",
        "session_id",
    )

    def __init__(
        self, remote: Remote, request: jsonrpc.Request, child: Child, child_id: RequestId
    ) -> None:
        params = request.params
        key = (
            params.get("idempotencyKey") if params and request.method == m.SESSION_PROMPT else None
        )
        self.remote = remote
        self.remote_id = request.id
        self.child = child
        self.child_id = child_id
        self.method = request.method
        self.session_id = session_id(params)
        self.key = key if isinstance(key, str) else None
        """Only to keep a held prompt another connection awaits (never shown)."""
        self.replay = bool(
            params and request.method == m.SESSION_RESUME and params.get("replayFrom")
        )


class Ask:
    """A request the child sent toward the clients (by the child's id)."""

    __slots__ = ("child", "child_id", "method", "params", "remote", "remote_id", "session_id")

    def __init__(self, child: Child, request: jsonrpc.Request) -> None:
        self.child = child
        self.child_id = request.id
        self.method = request.method
        self.params = request.params
        self.session_id = session_id(request.params)
        self.remote: Remote | None = None
        self.remote_id: RequestId | None = None


class _Hop:
    """One remote connection's side of the translation."""

    __slots__ = ("asks", "forwards", "ids")

    def __init__(self) -> None:
        self.forwards: dict[RequestId, Forward] = {}
        """Its requests pending at the child, by its id."""
        self.asks: dict[RequestId, Ask] = {}
        """Requests of the child sent on it, by the id used on it."""
        self.ids = itertools.count(1)


class Translator:
    """The pending requests of every hop, both ways, and their ids."""

    def __init__(self) -> None:
        self._forwards: dict[Child, dict[RequestId, Forward]] = {}
        self._asks: dict[Child, dict[RequestId, Ask]] = {}
        self._hops: dict[Remote, _Hop] = {}

    def _hop(self, remote: Remote) -> _Hop:
        hop = self._hops.get(remote)
        if hop is None:
            hop = self._hops[remote] = _Hop()
        return hop

    # -- remote requests at the child -------------------------------------------------------

    def in_use(self, remote: Remote, id: RequestId) -> bool:
        """Whether `remote` has a request `id` pending at the child."""
        hop = self._hops.get(remote)
        return hop is not None and id in hop.forwards

    def forward(
        self, remote: Remote, request: jsonrpc.Request, child: Child
    ) -> tuple[Forward, bytes]:
        """Give `remote`'s request a child-side id; returns it and the frame for the child."""
        forward = Forward(remote, request, child, next(child.ids))
        self._forwards.setdefault(child, {})[forward.child_id] = forward
        self._hop(remote).forwards[request.id] = forward
        frame = jsonrpc.encode_request(forward.child_id, request.method, request.params)
        return forward, frame

    def answered(
        self, child: Child, msg: jsonrpc.Response | jsonrpc.ErrorResponse
    ) -> tuple[Forward, bytes] | None:
        """The child's answer `msg`: its forward and the frame for its remote connection
        (None: a request whose remote connection gave up on it)."""
        assert msg.id is not None
        forward = self._take(child, msg.id)
        return None if forward is None else (forward, _answer(forward.remote_id, msg))

    def lost(self, child: Child, id: RequestId, error: AcpError) -> tuple[Remote, bytes] | None:
        """The child's answer to `id` could not be read: `error` for the remote instead."""
        forward = self._take(child, id)
        if forward is None:
            return None
        return forward.remote, jsonrpc.encode_error(forward.remote_id, error)

    def _take(self, child: Child, id: RequestId) -> Forward | None:
        forward = self._forwards.get(child, {}).pop(id, None)
        if forward is not None:
            hop = self._hops.get(forward.remote)
            if hop is not None:
                hop.forwards.pop(forward.remote_id, None)
        return forward

    def cancel_from_remote(
        self, remote: Remote, params: Mapping[str, Any] | None
    ) -> tuple[Child, bytes] | None:
        """`remote`'s `$/cancel_request`, for the child (None: unknown or answered: drop it)."""
        request_id = _cancelled_id(params)
        hop = self._hops.get(remote)
        forward = hop.forwards.get(request_id) if hop and request_id is not None else None
        return None if forward is None else (forward.child, _cancel(forward.child_id))

    # -- the child's requests at the remote connections -------------------------------------

    def ask(self, child: Child, request: jsonrpc.Request) -> Ask | None:
        """Record the child's request (None: its id is already in use)."""
        asks = self._asks.setdefault(child, {})
        if request.id in asks:
            return None
        ask = asks[request.id] = Ask(child, request)
        return ask

    def asking(self, ask: Ask) -> bool:
        """Whether the child still waits for an answer to `ask`."""
        return ask.child.alive and ask.child_id in self._asks.get(ask.child, {})

    def send_ask(self, ask: Ask, remote: Remote) -> bytes:
        """Send `ask` on `remote`: the frame with an id of that connection."""
        hop = self._hop(remote)
        ask.remote, ask.remote_id = remote, f"bridge-{next(hop.ids)}"
        hop.asks[ask.remote_id] = ask
        return jsonrpc.encode_request(ask.remote_id, ask.method, ask.params)

    def withdraw(self, ask: Ask) -> bytes:
        """No client can answer `ask`: the method's cancellation answer for the child."""
        self._asks.get(ask.child, {}).pop(ask.child_id, None)
        if ask.method == m.SESSION_REQUEST_PERMISSION:
            outcome = {"outcome": {"outcome": "cancelled"}}
            return jsonrpc.encode_result(ask.child_id, outcome)
        error = RequestCancelled("No client can answer it")
        return jsonrpc.encode_error(ask.child_id, error)

    def answer_ask(
        self, remote: Remote, msg: jsonrpc.Response | jsonrpc.ErrorResponse
    ) -> tuple[Child, bytes] | None:
        """`remote`'s answer to a request of the child, for the child (None: not one the
        child still waits for)."""
        hop = self._hops.get(remote)
        ask = hop.asks.pop(msg.id, None) if hop is not None and msg.id is not None else None
        if ask is None or self._asks.get(ask.child, {}).pop(ask.child_id, None) is None:
            return None
        return ask.child, _answer(ask.child_id, msg)

    def cancel_from_child(
        self, child: Child, params: Mapping[str, Any] | None
    ) -> tuple[Remote, bytes] | None:
        """The child's `$/cancel_request`, for the remote connection its request went to."""
        request_id = _cancelled_id(params)
        ask = self._asks.get(child, {}).get(request_id) if request_id is not None else None
        if ask is None or ask.remote is None or ask.remote_id is None:
            return None
        return ask.remote, _cancel(ask.remote_id)

    # -- ends -------------------------------------------------------------------------------

    def release(self, remote: Remote) -> tuple[list[tuple[Child, bytes]], list[Ask]]:
        """`remote` ended: the cancels its pending requests need at the child, and the
        child's requests it leaves unanswered (to send elsewhere). A keyed `session/prompt`
        another live connection awaits with the same key is not cancelled (a retry)."""
        hop = self._hops.pop(remote, None)
        if hop is None:
            return [], []
        cancels: list[tuple[Child, bytes]] = []
        for forward in hop.forwards.values():
            child = forward.child
            if not child.alive or forward.child_id not in self._forwards.get(child, {}):
                continue
            if forward.method == m.SESSION_PROMPT and self._awaited_elsewhere(forward):
                continue
            cancels.append((child, _cancel(forward.child_id)))
        asks = list(hop.asks.values())
        for ask in asks:
            ask.remote = ask.remote_id = None
        return cancels, asks

    def _awaited_elsewhere(self, forward: Forward) -> bool:
        if forward.key is None:
            return False
        return any(
            other is not forward
            and not other.remote.ended
            and other.method == m.SESSION_PROMPT
            and other.session_id == forward.session_id
            and other.key == forward.key
            for other in self._forwards.get(forward.child, {}).values()
        )

    def child_exited(self, child: Child) -> set[Remote]:
        """Forget `child`'s requests either way; returns the remote connections that had
        some pending with it."""
        touched: set[Remote] = set()
        for forward in self._forwards.pop(child, {}).values():
            touched.add(forward.remote)
            hop = self._hops.get(forward.remote)
            if hop is not None:
                hop.forwards.pop(forward.remote_id, None)
        for ask in self._asks.pop(child, {}).values():
            if ask.remote is not None:
                touched.add(ask.remote)
                hop = self._hops.get(ask.remote)
                if hop is not None and ask.remote_id is not None:
                    hop.asks.pop(ask.remote_id, None)
        return touched
