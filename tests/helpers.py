"""Shared test helpers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
from collections.abc import Callable
from typing import Any

import anyio

from acp_once.agent.connection import AgentSideConnection
from acp_once.agent.interface import Agent
from acp_once.client import Client, ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.rpc.streams import memory_pair
from acp_once.support.busypoll import BusyPoll


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait (bounded) until process `pid`, not necessarily our child, has exited; False when
    it still runs after `timeout` seconds."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(fd)


async def loop_rounds(n: int) -> None:
    """Let the asyncio event loop turn `n` times (one round of its ready callbacks each)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def assert_stops_polling(poll: BusyPoll) -> None:
    """Assert that `poll` stops polling within two rounds of the loop, and stays stopped."""
    await loop_rounds(2)
    assert not poll.polling()
    stopped = poll.rounds
    await loop_rounds(5)
    assert poll.rounds == stopped


def initialize_request(name: str = "test-client") -> s.InitializeRequest:
    """An `initialize` request of a v2 client named `name`."""
    return s.InitializeRequest.model_validate(
        {"protocolVersion": 2, "info": {"name": name, "version": "1"}}
    )


def user_texts(updates: list[dict[str, object]]) -> list[str]:
    """The text of each `user_message` update among `updates`, in order."""
    out = []
    for u in updates:
        if u["sessionUpdate"] == "user_message":
            content = u["content"]
            assert isinstance(content, list)
            out.append(str(content[0]["text"]))
    return out


class UpdateRecorder(Client):
    """Keeps every `session/update` (as wire dicts, `{"sessionId", "update"}`) and lets a test
    wait for a condition on them without sleeping."""

    def __init__(self) -> None:
        self.notifications: list[dict[str, Any]] = []
        self._arrived = anyio.Event()

    async def session_update(self, params: s.UpdateSessionNotification) -> None:
        self.notifications.append(params.model_dump(by_alias=True, exclude_unset=True))
        self._arrived.set()
        self._arrived = anyio.Event()

    @property
    def updates(self) -> list[dict[str, Any]]:
        """The `update` objects, in arrival order."""
        return [n["update"] for n in self.notifications]

    def user_messages(self) -> list[str]:
        return [u["messageId"] for u in self.updates if u["sessionUpdate"] == "user_message"]

    async def wait_for(self, predicate: Callable[[list[dict[str, Any]]], bool]) -> None:
        """Wait until `predicate(self.updates)` holds; bound it with the caller's fail_after."""
        while not predicate(self.updates):
            await self._arrived.wait()

    async def turn_end(self, message_id: str) -> dict[str, Any]:
        """Wait for the end of the turn of `message_id` (the idle `state_update` naming it in
        `_meta.acpOnce.messageId`, A10) and return it; bound it with the caller's fail_after."""

        def ends(updates: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [
                u
                for u in updates
                if u["sessionUpdate"] == "state_update"
                and u.get("state") == "idle"
                and u.get("_meta", {}).get("acpOnce", {}).get("messageId") == message_id
            ]

        await self.wait_for(lambda updates: bool(ends(updates)))
        return ends(self.updates)[0]


class CutConnection:
    """A client connection to `agent`, in memory, that is cut when the block exits.

    `on_agent_closed` runs once the agent's end has seen the cut, when the engine has already
    cancelled that connection's handlers: a test holding a handler inside a step that must
    finish anyway (shielded) releases it there, so leaving the block does not wait forever::

        async with CutConnection(agent, release.set) as conn:
            await conn.rpc.start_request(...)
            await reached.wait()
        # the connection is gone; its handler finished its step
    """

    def __init__(self, agent: Agent, on_agent_closed: Callable[[], object]) -> None:
        self._agent = agent
        self._on_agent_closed = on_agent_closed
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> ClientSideConnection:
        agent_end, client_end = memory_pair(64)
        async with contextlib.AsyncExitStack() as stack:
            tg = await stack.enter_async_context(anyio.create_task_group())
            served = await stack.enter_async_context(AgentSideConnection(self._agent, agent_end))
            tg.start_soon(self._watch, served)
            conn = await stack.enter_async_context(ClientSideConnection(Client(), client_end))
            await conn.agent.initialize(initialize_request("cut"))
            self._stack = stack.pop_all()
        return conn

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._stack.__aexit__(*exc_info)

    async def _watch(self, served: AgentSideConnection) -> None:
        await served.wait_closed()
        self._on_agent_closed()
