"""1,000 trials of 8 simultaneous requests with one new key, spread over three nodes.

The nodes are in-process (three `SessionAgent`s with a coordinator and a pool each, on one
schema); `test_multinode.py` does the same with fewer trials over real `acp-once serve`
processes.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from acp_once.client.connection import ClientSideConnection
from acp_once.testing import connected
from tests.cluster.harness import initialize, new_session, node, prompt, resume

pytestmark = [pytest.mark.anyio, pytest.mark.postgres, pytest.mark.slow]

TRIALS = int(os.environ.get("ACP_ONCE_CLUSTER_TRIALS", "1000"))
SESSIONS = 20
CONCURRENT = 8


async def test_one_insertion_per_key_over_three_nodes(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    fx = tmp_path / "fx"
    with anyio.fail_after(600):
        async with (
            node(postgres_dsn, schema, "n1", fx, max_size=6) as n1,
            node(postgres_dsn, schema, "n2", fx, max_size=6) as n2,
            node(postgres_dsn, schema, "n3", fx, max_size=6) as n3,
            connected(n1.agent, buffer=1024) as c1,
            connected(n2.agent, buffer=1024) as c2,
            connected(n3.agent, buffer=1024) as c3,
        ):
            conns: list[ClientSideConnection] = [c1, c2, c3]
            for conn in conns:
                await initialize(conn)
            sessions = [await new_session(c1) for _ in range(SESSIONS)]
            for sid in sessions:
                await resume(c2, sid)
                await resume(c3, sid)
            answers: dict[tuple[str, str], list[str]] = {}

            async def attempt(sid: str, key: str, i: int) -> None:
                mid = await prompt(conns[i % 3], sid, f"trial {key}", key)
                answers.setdefault((sid, key), []).append(mid)

            async def trials(slot: int) -> None:
                sid = sessions[slot]
                for t in range(slot, TRIALS, SESSIONS):
                    async with anyio.create_task_group() as tg:
                        for i in range(CONCURRENT):
                            tg.start_soon(attempt, sid, f"key-{t}", i + t)

            async with anyio.create_task_group() as tg:
                for slot in range(SESSIONS):
                    tg.start_soon(trials, slot)

            store = n1.store
            assert len(answers) == TRIALS
            inserted = 0
            for (sid, key), mids in answers.items():
                assert len(mids) == CONCURRENT
                found = await store.find_key(sid, key)
                assert found is not None
                assert set(mids) == {found.message_id}, key
                assert await store.count_user_messages(sid, idempotency_key=key) == 1
            for sid in sessions:
                inserted += await store.count_user_messages(sid)
            assert inserted == TRIALS
            # every node took part, and the requests that found the key recorded were counted
            hits = sum(n.coordinator.counters["dedup_hits"] for n in (n1, n2, n3))
            assert hits > 0
