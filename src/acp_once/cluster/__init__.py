"""Several agent nodes on one PostgreSQL store: the `PostgresCoordinator` and its SQL.

    async with PostgresStore.open(dsn) as store:
        coordinator = PostgresCoordinator(store, node_id="node-a")
        async with ReferenceAgent(store, coordinator=coordinator) as agent:
            ...

`coordinator.py` holds the strategy (leases with fencing tokens, prompts queued in the
database, updates by NOTIFY; see its docstring), `sql.py` the statements it runs, and
`fenced.py` the store view whose writes carry the node's fencing token. Requires the
`psycopg` driver.
"""

from acp_once.cluster.coordinator import PostgresCoordinator, default_node_id

__all__ = ["PostgresCoordinator", "default_node_id"]
