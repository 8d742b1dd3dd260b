"""How `AcpClient` speaks to the agent it met: a face chosen at `initialize`, the client's
mirror of the agent's v1 face (`acp_once.agent.v1face`).

The agent's answer to `initialize` says which protocol it speaks
(`acp_once.protocol.v1_to_v2.answer_version`), and the client opens the face of that version
on the connection (`FACES`). From then on `AcpClient` asks its face wherever ACP v1 and v2
differ, and holds no version branch of its own:

- `V2Face`: prompts carry their idempotency key and are answered at insertion; a lost answer
  is resent with the same key after the reconnect; sessions are re-attached with
  `session/resume`.
- `V1Face`: v1 has no keys. Prompts are sent without one and answered at the end of their
  turn, under a local message id; the turn's user message and its running and idle states
  are reported as a v2 agent reports them. What the agent sends is translated into v2
  (`acp_once.protocol.v1_to_v2.V1ToV2Messages`). A lost answer is resent only under
  `on_unaware="trust"`, and pending submissions of an earlier run are handed to the
  application otherwise. Sessions are re-attached with `session/load` when the agent offers
  it; the history it replays is not passed on (the application saw it live).

A face is made for one connection; the client keeps the last one opened.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson

from acp_once.client._state import Job, SessionState
from acp_once.client.connection import ClientSideConnection
from acp_once.client.errors import AgentRefused, OutcomeUnknown, PromptCancelled
from acp_once.client.outbox import Outbox
from acp_once.protocol import schema as s
from acp_once.protocol.errors import AcpError, MethodNotFound, RequestCancelled, SessionNotFound
from acp_once.protocol.v1_to_v2 import V1ToV2Messages, idle_update, running_update, user_message
from acp_once.rpc.errors import TransportError

if TYPE_CHECKING:
    from acp_once.protocol import v1

__all__ = ["FACES", "KEYS_META", "V1_NO_KEYS", "Face", "FaceHost", "V1Face", "V2Face"]

logger = logging.getLogger("acp_once.client")

KEYS_META = "acpOnce"
"""`_meta` member in which acp-once agents say they honour idempotency keys."""

V1_NO_KEYS = (
    "the agent speaks ACP v1: v1 has no idempotency keys, so a resend after a lost answer "
    "may run the work twice"
)
"""Why a v1 agent falls under the unaware-agent policy (`on_unaware`)."""


class FaceHost(Protocol):
    """What a face uses of its `AcpClient`."""

    outbox: Outbox
    on_unaware: Literal["trust", "warn", "refuse"]
    use_keys: bool
    _face: Face | None
    _sessions: dict[str, SessionState]
    _warned_v1: bool

    async def _ready(self) -> ClientSideConnection: ...

    async def _call(self, method: str, params: dict[str, Any]) -> Any: ...

    def _track(self, session_id: str, cwd: str) -> SessionState: ...

    async def _dispatch_update(self, params: s.UpdateSessionNotification) -> None: ...

    async def _deliver_missed(self, params: s.UpdateSessionNotification) -> None: ...


class Face(Protocol):
    """What differs between the protocol versions, for one connection."""

    version: int
    """The protocol version the agent speaks."""
    agent_info: s.InitializeResponse | None
    """A v2 agent's `initialize` answer (None from a v1 agent)."""
    agent_info_v1: v1.InitializeResponse | None
    """A v1 agent's `initialize` answer (None from a v2 agent)."""
    keys_trusted: bool
    """Whether a prompt whose answer was lost may be resent on its own."""
    keyed: bool
    """Whether prompts carry idempotency keys and are answered at insertion (else at the end
    of their turn, under a local message id)."""
    hands_over_pending: bool
    """Whether pending submissions of an earlier run go to the application (`on_stale`)
    instead of being resent."""

    def new_session_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The `session/new` params for the caller's `params`."""
        ...

    async def resume(
        self, host: FaceHost, session_id: str, cwd: str, *, history: bool = False
    ) -> SessionState:
        """Attach an existing session to the client (raises the agent's `AcpError`); with
        `history`, learn its turns from a replay (`SessionState.resume`)."""
        ...

    async def send(self, host: FaceHost, job: Job) -> str | None:
        """Send the submission of `job`: its message id once the answer is definite, or None
        to send it again on the next connection (a lost answer that may be resent). Raises
        what makes the answer definite (`PromptCancelled`, `AcpError`) or `OutcomeUnknown`."""
        ...


class V2Face:
    """An ACP v2 agent (see the module docstring)."""

    version = 2
    agent_info_v1: v1.InitializeResponse | None = None
    keyed = True
    hands_over_pending = False

    def __init__(self, conn: ClientSideConnection, init: s.InitializeResponse, trusted: bool):
        self.agent_info: s.InitializeResponse | None = init
        self.keys_trusted = trusted
        self._conn = conn

    @classmethod
    async def open(cls, host: FaceHost, conn: ClientSideConnection, raw: Any) -> V2Face:
        """The face for a v2 `initialize` answer `raw`, with every session of the client
        resumed on `conn` before anything is resent (R15, R33)."""
        init = s.InitializeResponse.model_validate(raw)
        meta = init.field_meta or {}
        advertised = isinstance(meta.get(KEYS_META), dict) and meta[KEYS_META].get(
            "idempotencyKeys"
        )
        face = cls(conn, init, bool(advertised) or host.on_unaware != "refuse")
        if not advertised and host.on_unaware == "warn":
            logger.warning(
                "agent %s does not say it honours idempotency keys; resends may duplicate",
                init.info.name,
            )
        for state in list(host._sessions.values()):
            try:
                await state.resume(
                    conn.rpc.request, replay=state.needs_history(), deliver=host._deliver_missed
                )
            except SessionNotFound:
                logger.warning("session %s is gone from the agent", state.session_id)
        return face

    def new_session_params(self, params: dict[str, Any]) -> dict[str, Any]:
        return params

    async def resume(
        self, host: FaceHost, session_id: str, cwd: str, *, history: bool = False
    ) -> SessionState:
        state = host._track(session_id, cwd)
        while True:
            conn = await host._ready()
            try:
                await state.resume(conn.rpc.request, replay=history, deliver=host._deliver_missed)
            except TransportError:
                continue  # Idempotent: sent again on the next connection
            return state

    async def send(self, host: FaceHost, job: Job) -> str | None:
        submission = job.submission
        params: dict[str, Any] = {
            "sessionId": submission.session_id,
            "prompt": orjson.loads(submission.prompt),
        }
        if host.use_keys:
            params["idempotencyKey"] = submission.idempotency_key
        await host.outbox.record_attempt(submission.submission_id)
        job.attempts += 1
        try:
            result = await self._conn.rpc.request("session/prompt", params)
        except TransportError:
            # Keyed resends are safe unless the agent is not trusted with keys. Without keys
            # (the demo's "no keys" run) a resend is a new submission: shown, not prevented.
            if host.use_keys and not self.keys_trusted:
                await host.outbox.complete(submission.submission_id)
                raise OutcomeUnknown(
                    "The answer to session/prompt was lost; not resent on its own"
                ) from None
            return None  # same key, fresh JSON-RPC id, after the reconnect and resume
        except RequestCancelled as exc:
            await host.outbox.complete(submission.submission_id)
            raise PromptCancelled(exc.message, exc.data) from None
        except AcpError:
            await host.outbox.complete(submission.submission_id)
            raise
        await host.outbox.complete(submission.submission_id)
        return str(result["messageId"])


class V1Face:
    """An ACP v1 agent (see the module docstring)."""

    version = 1
    agent_info: s.InitializeResponse | None = None
    keyed = False

    def __init__(
        self, conn: ClientSideConnection, init: v1.InitializeResponse, trusted: bool
    ) -> None:
        self.agent_info_v1: v1.InitializeResponse | None = init
        self.keys_trusted = trusted
        self.hands_over_pending = not trusted
        self._conn = conn
        self._messages = V1ToV2Messages()

    @classmethod
    async def open(cls, host: FaceHost, conn: ClientSideConnection, raw: Any) -> V1Face:
        """The face for a v1 `initialize` answer `raw`, with every session of the client
        loaded on `conn` where the agent can load sessions.

        Raises:
            AgentRefused: the unaware-agent policy is "refuse".
        """
        from acp_once.protocol import v1  # on first use: the v1 models take ~0.2 s to build

        init = v1.InitializeResponse.model_validate(raw)
        if host.on_unaware == "refuse":
            raise AgentRefused(f"{V1_NO_KEYS} (on_unaware='refuse')")
        if host.on_unaware == "warn" and not host._warned_v1:
            host._warned_v1 = True
            logger.warning("%s; a prompt whose answer is lost is not resent", V1_NO_KEYS)
        face = cls(conn, init, host.on_unaware == "trust")
        conn.use_v1(face._messages)
        for state in list(host._sessions.values()):
            if not face._can_load():
                logger.warning(
                    "session %s cannot be re-attached: the v1 agent does not offer session/load",
                    state.session_id,
                )
                continue
            state.replaying = True
            try:
                await conn.rpc.request("session/load", _load_params(state.session_id, state.cwd))
            except AcpError as exc:
                logger.warning("session %s could not be loaded: %s", state.session_id, exc.code)
            finally:
                state.replaying = False
            # the replay's message ids belong to the history: the next turn starts afresh
            face._messages.translator(state.session_id).begin_turn()
        return face

    def _can_load(self) -> bool:
        info = self.agent_info_v1
        caps = info.agent_capabilities if info is not None else None
        return bool(caps is not None and caps.load_session)

    def new_session_params(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"mcpServers": [], **params}  # v1 requires `mcpServers`

    async def resume(
        self, host: FaceHost, session_id: str, cwd: str, *, history: bool = False
    ) -> SessionState:
        """v1's `session/load`; the history it replays is not passed on (`history` changes
        nothing: v1 prompts are answered at the end of their turn).

        Raises:
            MethodNotFound: the agent does not advertise `loadSession`.
        """
        if not self._can_load():
            raise MethodNotFound(
                "The agent speaks ACP v1 and does not offer session/load: "
                "a session cannot be resumed"
            )
        state = host._track(session_id, cwd)
        state.replaying = True
        try:
            await host._call("session/load", _load_params(session_id, cwd))
        finally:
            state.replaying = False
        self._messages.translator(session_id).begin_turn()
        return state

    async def send(self, host: FaceHost, job: Job) -> str | None:
        """One v1 turn: no key; the answer comes at the end of the turn. A lost answer is
        resent (as a new turn) only under `on_unaware="trust"`, and only to a v1 agent."""
        submission = job.submission
        session_id = submission.session_id
        prompt = orjson.loads(submission.prompt)
        # a local id: v1 agents give none; never derived from the key, which stays private
        message_id = job.local_id = job.local_id or f"v1_{uuid.uuid4().hex}"
        if job.handle is not None:
            job.handle._expect(message_id)
        face = self
        while True:
            await host.outbox.record_attempt(submission.submission_id)
            job.attempts += 1
            face._messages.translator(session_id).begin_turn(message_id)
            await host._dispatch_update(user_message(session_id, message_id, prompt))
            await host._dispatch_update(running_update(session_id))
            try:
                result = await face._conn.rpc.request(
                    "session/prompt", {"sessionId": session_id, "prompt": prompt}
                )
            except TransportError:
                if not face.keys_trusted:
                    await host.outbox.complete(submission.submission_id)
                    raise OutcomeUnknown(
                        f"The answer to session/prompt was lost and it was not resent: {V1_NO_KEYS}"
                    ) from None
                await host._ready()
                if not isinstance(host._face, V1Face):
                    raise OutcomeUnknown(
                        "The answer to session/prompt was lost and the agent no longer "
                        "speaks ACP v1"
                    ) from None
                face = host._face
                logger.info("resending a v1 prompt after a lost answer (on_unaware='trust')")
                continue
            except RequestCancelled as exc:
                await host.outbox.complete(submission.submission_id)
                raise PromptCancelled(exc.message, exc.data) from None
            except AcpError:
                await host.outbox.complete(submission.submission_id)
                raise
            reason = result.get("stopReason") if isinstance(result, dict) else None
            await host.outbox.complete(submission.submission_id)
            await host._dispatch_update(
                idle_update(session_id, reason if isinstance(reason, str) else None)
            )
            return message_id


FACES: dict[int, Callable[[FaceHost, ClientSideConnection, Any], Awaitable[Face]]] = {
    1: V1Face.open,
    2: V2Face.open,
}
"""The face to open for each protocol version `answer_version` names."""


def _load_params(session_id: str, cwd: str) -> dict[str, Any]:
    """v1 `session/load` params (v1 requires `mcpServers`)."""
    return {"sessionId": session_id, "cwd": cwd, "mcpServers": []}
