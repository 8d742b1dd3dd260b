"""Several agent nodes on one PostgreSQL store: the `PostgresCoordinator` and its SQL.

    async with PostgresStore.open(dsn) as store:
        coordinator = PostgresCoordinator(store, node_id="node-a")
        async with ReferenceAgent(store, coordinator=coordinator) as agent:
            ...

`coordinator.py` holds the strategy (leases with fencing tokens, prompts queued in the
database, updates by NOTIFY; see its docstring), `sql.py` the statements it runs, and
`fenced.py` the store view whose writes carry the node's fencing token, and `sharded.py` a
node of a store sharded over several databases (one coordinator per shard). Requires the
`psycopg` driver.
"""

from acp_once.cluster.coordinator import PostgresCoordinator, default_node_id
from acp_once.cluster.sharded import ShardedCoordinator

__all__ = ["PostgresCoordinator", "ShardedCoordinator", "default_node_id"]
