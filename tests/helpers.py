"""Shared test helpers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from acp_once.client import Client
from acp_once.protocol import schema as s


def initialize_request(name: str = "test-client") -> s.InitializeRequest:
    """An `initialize` request of a v2 client named `name`."""
    return s.InitializeRequest.model_validate(
        {"protocolVersion": 2, "info": {"name": name, "version": "1"}}
    )


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
