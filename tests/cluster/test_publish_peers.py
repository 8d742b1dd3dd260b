"""Updates are published to other nodes only while another instance is alive, and a node that
joins receives every update sent after its start returned (the join and its answers)."""

from __future__ import annotations

from pathlib import Path

import anyio
import psycopg
import pytest

from acp_once.cluster import notify
from acp_once.testing import connected
from tests.cluster.harness import Node, initialize, new_session, node, prompt, resume
from tests.helpers import UpdateRecorder, user_texts

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT = 30


def publishing(n: Node) -> bool:
    """Whether the node publishes its updates to other nodes."""
    return n.coordinator._others


async def test_a_node_alone_publishes_no_update(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    marker = "end-of-test-marker"
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx") as a,
            a.coordinator.pg.listen(postgres_dsn) as notifies,
            connected(a.agent) as conn,
        ):
            assert publishing(a) is False
            await initialize(conn)
            sid = await new_session(conn)
            await prompt(conn, sid, "alone", "k1")
            with psycopg.connect(postgres_dsn, autocommit=True) as raw:
                raw.execute("SELECT pg_notify(%s, %s)", (a.coordinator.pg.channel, marker))
            payloads: list[str] = []
            while marker not in payloads:
                async for payload in notifies(TIMEOUT):
                    payloads.append(payload)
                    if payload == marker:
                        break
            kinds = [note for p in payloads if (note := notify.read(p)) is not None]
            assert not any(isinstance(k, notify.Update) for k in kinds)


async def test_a_joining_node_gets_every_update_after_its_start_and_a_leaving_one_stops_them(
    postgres_dsn: str, schema: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recorder_b = UpdateRecorder()
    with anyio.fail_after(TIMEOUT):
        async with (
            node(postgres_dsn, schema, "a", tmp_path / "fx") as a,
            connected(a.agent) as conn_a,
        ):
            await initialize(conn_a)
            sid = await new_session(conn_a)
            await prompt(conn_a, sid, "before", "k1")  # alone: not published
            assert publishing(a) is False
            async with (
                node(postgres_dsn, schema, "b", tmp_path / "fx") as b,
                connected(b.agent, recorder_b) as conn_b,
            ):
                # b's start returned only after a answered its join: a publishes already
                assert "did not answer the join" not in caplog.text
                assert publishing(a) is True
                assert publishing(b) is True
                await initialize(conn_b)
                await resume(conn_b, sid)
                await prompt(conn_a, sid, "after", "k2")
                await recorder_b.wait_for(lambda ups: "after" in user_texts(ups))
            # b deregistered: a's next heartbeat stops publishing
            await a.coordinator._beat()
            assert publishing(a) is False


async def test_a_join_during_a_heartbeat_keeps_publishing_on(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with node(postgres_dsn, schema, "a", tmp_path / "fx") as a:
            c = a.coordinator
            assert publishing(a) is False
            real = c.pg.heartbeat

            async def beat_with_a_join(stats: dict[str, object]) -> set[str]:
                answer = await real(stats)  # began before the join: names no one
                await c._on_notify(notify.join("someone-else"))
                return answer

            c.pg.heartbeat = beat_with_a_join  # type: ignore[method-assign]
            await c._beat()
            assert publishing(a) is True


async def test_a_restarted_node_does_not_wait_for_its_dead_process_but_for_the_others(
    postgres_dsn: str, schema: str, tmp_path: Path
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with node(postgres_dsn, schema, "b", tmp_path / "fx") as b:
            # "a" crashed a moment ago: its row is fresh and it will never answer a join
            with psycopg.connect(postgres_dsn, autocommit=True) as raw:
                raw.execute(
                    f'INSERT INTO "{schema}".cluster_nodes (instance, node_id, stats)'
                    " VALUES ('a-crashed', 'a', '{}')"
                )
            started = anyio.current_time()
            # with a lease TTL of 60 s, waiting for the crashed process would fail this test
            async with node(postgres_dsn, schema, "a", tmp_path / "fx", lease_ttl=60) as a:
                assert anyio.current_time() - started < TIMEOUT / 2
                assert publishing(a) is True
                assert publishing(b) is True
