"""`Coordinator`: a placement shared by several processes, and what it needs to run.

`SessionAgent(store, coordinator=...)` takes one; without it, sessions stay in this process
(`acp_once.agent.placement.LocalPlacement`). A coordinator is a `Placement` (called only by the
sessions' inboxes, downward) with a lifecycle: the runtime starts it with the one event sink
through which its asynchronous news comes in (`PlacementEvents`: queued prompts' outcomes,
wake-ups, cancels and updates from other processes), hands it the updates this process sends
(`publish`), and stops it. `acp_once.cluster.PostgresCoordinator` is the one we ship.

`LocalCoordinator` is kept for compatibility only: passing it is the same as passing none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from acp_once.agent.placement import LocalPlacement, Placement

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from acp_once.agent.placement import PlacementEvents
    from acp_once.storage.base import SessionStore

__all__ = ["Coordinator", "LocalCoordinator"]


class Coordinator(Protocol):
    """A placement shared with other processes (see the module docstring)."""

    def placement(self, store: SessionStore) -> Placement:
        """The placement of an agent on `store` (before the agent is entered); its `store` is
        the view every write of the agent goes through."""
        ...

    async def start(self, events: PlacementEvents, tg: TaskGroup) -> None:
        """Start background work in the agent's task group `tg`; news goes to `events`."""
        ...

    async def stop(self) -> None:
        """The agent is leaving: release what this process holds. Bounded; never raises."""
        ...

    async def status(self, local: dict[str, Any]) -> dict[str, Any]:
        """What `/ops/status` shows (`local`: this process's figures, as one node would)."""
        ...

    def publish(self, session_id: str, update: dict[str, Any]) -> None:
        """An update for the session's connections in other processes. Never blocks."""
        ...

    def running_elsewhere(self, session_id: str) -> bool:
        """Another process reported the session running (the resume snapshot)."""
        ...


class LocalCoordinator:
    """Deprecated: one process alone, the default; passing it is the same as passing none.
    Kept because `acp_once.agent` exports the name."""

    def placement(self, store: SessionStore) -> Placement:
        return LocalPlacement(store)

    async def start(self, events: PlacementEvents, tg: TaskGroup) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def status(self, local: dict[str, Any]) -> dict[str, Any]:
        return {"node": local["node"], "nodes": [local]}

    def publish(self, session_id: str, update: dict[str, Any]) -> None:
        return None

    def running_elsewhere(self, session_id: str) -> bool:
        return False
