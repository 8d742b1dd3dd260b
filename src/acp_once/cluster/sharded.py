"""`ShardedCoordinator`: one node of a cluster whose sessions are sharded over several
PostgreSQL databases (`acp_once.storage.ShardedStore` over `PostgresStore`s).

Every node serves every shard. A session lives whole in one shard (its row, timeline, keys,
lease and queued prompts), so the cluster's protocol runs per shard unchanged: this node is one
`PostgresCoordinator` per shard, each with its own leases, prompt queue, LISTEN connection,
renewal and polling on its own database, and every call naming a session goes to the
coordinator of that session's shard (`shard_of`, the store's own placement). What is not about
one session is the union: the agent's store view is a `ShardedStore` over the coordinators'
fenced views, `/ops/status` lists the node instances of every shard, and starting and stopping
start and stop each coordinator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

import anyio

from acp_once.cluster.coordinator import PostgresCoordinator
from acp_once.storage.postgres import PostgresStore
from acp_once.storage.sharded import ShardedStore, shard_of

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from acp_once.agent.placement import Insert, Placed, PlacementEvents
    from acp_once.agent.state import PendingPrompt
    from acp_once.storage.base import SessionStore

__all__ = ["ShardedCoordinator"]


class ShardedCoordinator:
    """Coordinates the nodes that share a sharded PostgreSQL store (see the module docstring).

    Args:
        store: the node's open `ShardedStore`, every shard a `PostgresStore`.
        node_id: as `PostgresCoordinator` takes it, for every shard's coordinator.
        lease_ttl: likewise.
        lease_grace: likewise.
        poll_interval: likewise.

    Raises:
        TypeError: a shard is not a `PostgresStore`.
    """

    def __init__(
        self,
        store: ShardedStore,
        *,
        node_id: str | None = None,
        lease_ttl: float = 10.0,
        lease_grace: float | None = None,
        poll_interval: float = 1.0,
    ) -> None:
        shards: list[PostgresStore] = []
        for shard in store.shards:
            if not isinstance(shard, PostgresStore):
                raise TypeError("every shard of a clustered store must be a PostgresStore")
            shards.append(shard)
        self.coordinators: tuple[PostgresCoordinator, ...] = tuple(
            PostgresCoordinator(
                shard,
                node_id=node_id,
                lease_ttl=lease_ttl,
                lease_grace=lease_grace,
                poll_interval=poll_interval,
            )
            for shard in shards
        )
        """One per shard, in the store's order."""
        self.node_id = self.coordinators[0].node_id
        self.lease_ttl = lease_ttl
        self.store = ShardedStore([c.store for c in self.coordinators])
        """The agent's view: each session's writes carry its shard's fencing token."""

    def of(self, session_id: str) -> PostgresCoordinator:
        """The coordinator of the shard that keeps `session_id`."""
        return self.coordinators[shard_of(session_id, len(self.coordinators))]

    @property
    def instance(self) -> str:
        """This node's instances, one per shard (each shard's tables name its own)."""
        return ",".join(c.instance for c in self.coordinators)

    # -- lifecycle ----------------------------------------------------------------------

    def placement(self, store: SessionStore) -> Self:
        """The agent's placement: this coordinator (`store` is ignored: the view is
        `self.store`)."""
        return self

    async def start(self, events: PlacementEvents, tg: TaskGroup) -> None:
        """Start every shard's coordinator in the agent's task group."""
        for coordinator in self.coordinators:
            await coordinator.start(events, tg)

    async def stop(self) -> None:
        """Stop every shard's coordinator, together (each is bounded and shielded)."""
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for coordinator in self.coordinators:
                    tg.start_soon(coordinator.stop)

    async def status(self, local: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every node instance of every shard (each row names its `shard`, from 1)."""
        nodes: list[dict[str, Any]] = []
        for index, coordinator in enumerate(self.coordinators, start=1):
            shard = await coordinator.status(local)
            nodes.extend({**row, "shard": index} for row in shard["nodes"])
        return {"node": self.node_id, "instance": self.instance, "nodes": nodes}

    def publish(self, session_id: str, update: dict[str, Any]) -> None:
        self.of(session_id).publish(session_id, update)

    def running_elsewhere(self, session_id: str) -> bool:
        return self.of(session_id).running_elsewhere(session_id)

    # -- the placement ------------------------------------------------------------------

    async def place(
        self, pending: PendingPrompt, insert: Insert, *, hold: bool, busy: bool
    ) -> Placed:
        return await self.of(pending.session_id).place(pending, insert, hold=hold, busy=busy)

    async def next(
        self,
        session_id: str,
        oldest: PendingPrompt | None,
        insert: Insert,
        *,
        release: bool = True,
    ) -> bool:
        return await self.of(session_id).next(session_id, oldest, insert, release=release)

    async def cancel(self, session_id: str) -> None:
        await self.of(session_id).cancel(session_id)

    async def claim(self, session_id: str) -> bool:
        return await self.of(session_id).claim(session_id)

    def holds(self, session_id: str) -> bool:
        return self.of(session_id).holds(session_id)
