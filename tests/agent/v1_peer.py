"""A raw JSON-RPC peer for the v1 face's in-process tests: it writes frames as given (so a test
can send what a typed client never would: a batch, a bad id, a v1 prompt with an
`idempotencyKey`) and keeps everything it receives."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson

from acp_once.agent.connection import AgentSideConnection
from acp_once.agent.interface import Agent
from acp_once.rpc.streams import MemoryFrameStream, memory_pair

TIMEOUT = 10.0

V1_INIT = {
    "protocolVersion": 1,
    "clientCapabilities": {},
    "clientInfo": {"name": "raw", "version": "1"},
}


class RawPeer:
    """One end of an in-memory connection to an `AgentSideConnection`."""

    def __init__(self, stream: MemoryFrameStream, served: AgentSideConnection) -> None:
        self._stream = stream
        self.served = served
        self.received: list[dict[str, Any]] = []  # every frame, in order
        self._next_id = 100
        self._seen = anyio.Event()

    async def send(self, message: Any) -> None:
        await self._stream.send(orjson.dumps(message))

    async def send_raw(self, frame: bytes) -> None:
        """Send `frame` as it is (JSON orjson would not write: an escaped lone surrogate)."""
        await self._stream.send(frame)

    async def _read(self) -> None:
        while True:
            frame = await self._stream.receive()
            assert isinstance(frame, bytes)
            try:
                self.received.append(orjson.loads(frame))
            except orjson.JSONDecodeError:  # an escaped lone surrogate, which the stdlib reads
                self.received.append(json.loads(frame))
            self._seen.set()
            self._seen = anyio.Event()

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The first received frame that satisfies `predicate` (waiting for it, bounded)."""
        with anyio.fail_after(TIMEOUT):
            checked = 0
            while True:
                for message in self.received[checked:]:
                    if predicate(message):
                        return message
                checked = len(self.received)
                await self._seen.wait()

    async def answer(self, id: Any) -> dict[str, Any]:
        """The response (result or error) to request `id`."""
        return await self.wait_for(lambda msg: msg.get("id") == id and "method" not in msg)

    async def call(self, method: str, params: Any = None, *, id: Any = None) -> dict[str, Any]:
        """Send a request and return its whole response."""
        if id is None:
            self._next_id += 1
            id = self._next_id
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
        if params is not None:
            message["params"] = params
        await self.send(message)
        return await self.answer(id)

    async def notify(self, method: str, params: Any) -> None:
        await self.send({"jsonrpc": "2.0", "method": method, "params": params})

    async def reply(self, id: Any, result: Any) -> None:
        await self.send({"jsonrpc": "2.0", "id": id, "result": result})

    def updates(self, session_id: str | None = None) -> list[dict[str, Any]]:
        """The `update` objects of every `session/update` received (of one session)."""
        return [
            msg["params"]["update"]
            for msg in self.received
            if msg.get("method") == "session/update"
            and (session_id is None or msg["params"]["sessionId"] == session_id)
        ]


@asynccontextmanager
async def raw_peer(agent: Agent) -> AsyncIterator[RawPeer]:
    """A `RawPeer` connected to `agent` in memory; the connection ends with the block."""
    agent_end, peer_end = memory_pair(64)
    async with AgentSideConnection(agent, agent_end) as served, anyio.create_task_group() as tg:
        peer = RawPeer(peer_end, served)
        tg.start_soon(peer._read)
        try:
            yield peer
        finally:
            tg.cancel_scope.cancel()
            await peer_end.aclose()
