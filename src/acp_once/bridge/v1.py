"""ACP v1 clients of the bridge.

The bridge proxies v2 (its child speaks v2: an acp-once agent, or a v1 agent behind
`acp-once agent --runtime v1`). A remote connection whose first message is an `initialize`
asking for `protocolVersion: 1` is served by the agent side's v1 face (`acp_once.agent.v1face`,
the same one every acp-once agent has) on top of a v2 connection to the bridge itself, made in
memory for it:

    v1 client <-> AgentSideConnection(v1 face, `BridgedAgent`) <-> ClientSideConnection (v2)
              <-> the bridge, as one more remote connection <-> the child

so the v1 client gets what a v1 client of the child would get (its prompts answered at the end
of their turns, updates translated, `session/load` as a resume with the history replayed), and
the bridge's rules (sessions per connection, tenants, the child's restarts) apply to it as to
any remote connection. A v1 client sends no idempotency keys: v1 has none.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import orjson

from acp_once.agent.calls import CallContext
from acp_once.agent.connection import AgentSideConnection
from acp_once.agent.interface import Agent
from acp_once.client.connection import ClientSideConnection
from acp_once.client.interface import Client
from acp_once.protocol import methods as m
from acp_once.protocol import schema as s
from acp_once.protocol.framing import FrameEvent
from acp_once.rpc.errors import ConnectionClosed
from acp_once.rpc.streams import FrameStream, memory_pair

__all__ = ["BridgedAgent", "PutBack", "asks_for_v1", "serve_v1"]

RemoteHandler = Callable[[FrameStream, str, str | None], Coroutine[Any, Any, None]]


def asks_for_v1(frame: FrameEvent) -> bool:
    """Whether `frame` is an `initialize` request asking for protocol version 1."""
    if not isinstance(frame, bytes):
        return False
    try:
        message = orjson.loads(frame)
    except orjson.JSONDecodeError:
        try:
            message = json.loads(frame)  # an escaped lone surrogate: valid JSON orjson refuses
        except ValueError:
            return False
    if not isinstance(message, dict) or message.get("method") != m.INITIALIZE:
        return False
    params = message.get("params")
    version = params.get("protocolVersion") if isinstance(params, dict) else None
    return isinstance(version, int) and not isinstance(version, bool) and version == 1


class PutBack:
    """A `FrameStream` whose first frame, read already, is handed out again first."""

    def __init__(self, first: FrameEvent, inner: FrameStream) -> None:
        self._first: FrameEvent | None = first
        self._inner = inner

    async def receive(self) -> FrameEvent:
        first, self._first = self._first, None
        return first if first is not None else await self._inner.receive()

    async def send(self, frame: bytes) -> None:
        await self._inner.send(frame)

    async def aclose(self) -> None:
        await self._inner.aclose()


class BridgedAgent(Agent):
    """A v2 `Agent` whose every call is the same request on the v2 connection `upstream` (to
    the bridge), for the v1 face of one remote connection."""

    def __init__(self, upstream: ClientSideConnection) -> None:
        self.upstream = upstream

    async def initialize(
        self, params: s.InitializeRequest, ctx: CallContext
    ) -> s.InitializeResponse:
        return await self.upstream.agent.initialize(params)

    async def new_session(
        self, params: s.NewSessionRequest, ctx: CallContext
    ) -> s.NewSessionResponse:
        return await self.upstream.agent.new_session(params)

    async def list_sessions(
        self, params: s.ListSessionsRequest, ctx: CallContext
    ) -> s.ListSessionsResponse:
        return await self.upstream.agent.list_sessions(params)

    async def resume_session(
        self, params: s.ResumeSessionRequest, ctx: CallContext
    ) -> s.ResumeSessionResponse:
        return await self.upstream.agent.resume_session(params)

    async def close_session(
        self, params: s.CloseSessionRequest, ctx: CallContext
    ) -> s.CloseSessionResponse:
        return await self.upstream.agent.close_session(params)

    async def delete_session(
        self, params: s.DeleteSessionRequest, ctx: CallContext
    ) -> s.DeleteSessionResponse:
        return await self.upstream.agent.delete_session(params)

    async def prompt(self, params: s.PromptRequest, ctx: CallContext) -> s.PromptResponse:
        return await self.upstream.agent.prompt(params)

    async def cancel(self, params: s.CancelSessionNotification, ctx: CallContext) -> None:
        await self.upstream.agent.cancel(params)


class _Downstream(Client):
    """What the bridge sends the v2 connection, passed on to the v1 client (translated by its
    face)."""

    def __init__(self) -> None:
        self.served: AgentSideConnection | None = None

    async def session_update(self, params: s.UpdateSessionNotification) -> None:
        if self.served is not None:
            await self.served.client.session_update(params)

    async def request_permission(
        self, params: s.RequestPermissionRequest, connection: ClientSideConnection
    ) -> s.RequestPermissionResponse:
        if self.served is None:
            return await super().request_permission(params, connection)
        return await self.served.client.request_permission(params)


async def serve_v1(
    serve_v2: RemoteHandler,
    first: FrameEvent,
    frames: FrameStream,
    name: str,
    tenant: str | None,
) -> None:
    """Serve the remote connection `frames`, whose first frame `first` (read already) asks for
    v1, through a v2 connection that `serve_v2` (the bridge's own handler) serves (see the
    module docstring). Returns when either end is gone."""
    upstream_end, bridge_end = memory_pair(64)
    downstream = _Downstream()
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve_v2, bridge_end, name, tenant)
        async with ClientSideConnection(downstream, upstream_end) as upstream:
            async with AgentSideConnection(
                BridgedAgent(upstream), PutBack(first, frames)
            ) as served:
                downstream.served = served
                async with anyio.create_task_group() as either:

                    async def until(wait: Callable[[], Awaitable[None]]) -> None:
                        with contextlib.suppress(ConnectionClosed):
                            await wait()
                        either.cancel_scope.cancel()

                    either.start_soon(until, served.wait_closed)
                    either.start_soon(until, upstream.wait_closed)
            await frames.aclose()
        await upstream_end.aclose()
        tg.cancel_scope.cancel()
