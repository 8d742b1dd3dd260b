"""The cluster's NOTIFY format: what one side writes, the other reads, whether the payload was
built in Python or by PostgreSQL inside the insert that settles a queued prompt."""

from __future__ import annotations

import psycopg
import pytest

from acp_once.cluster import notify


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("row", "state", "message_id", "same"),
    [(7, "inserted", "m1", True), (8, "recorded", "m0", False), (9, "abandoned", None, None)],
)
def test_an_outcome_built_by_postgresql_reads_as_the_one_built_in_python(
    postgres_dsn: str, row: int, state: str, message_id: str | None, same: bool | None
) -> None:
    expression = notify.outcome_sql("%s::bigint", "%s::text", "%s::text", "%s::boolean")
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        found = conn.execute(f"SELECT {expression}", (row, state, message_id, same)).fetchone()
    assert found is not None
    built_by_server = notify.read(found[0])
    assert built_by_server == notify.read(notify.outcome(row, state, message_id, same))
    assert built_by_server == notify.Outcome(row, state, message_id, same)


def test_every_kind_reads_back() -> None:
    assert notify.read(notify.wake("s1", "a-1")) == notify.Wake("s1", "a-1")
    assert notify.read(notify.cancel("s1", "a-1")) == notify.Cancel("s1", "a-1")
    update = {"sessionUpdate": "agent_message_chunk"}
    assert notify.read(notify.update("s1", "a-1", update)) == notify.Update(
        "s1", "a-1", update, None
    )
    assert notify.read(notify.update("s1", "a-1", None, 42)) == notify.Update("s1", "a-1", None, 42)
    assert notify.read(notify.join("a-1")) == notify.Join("a-1")
    assert notify.read(notify.ack("b-2", "a-1")) == notify.Ack("b-2", "a-1")


@pytest.mark.parametrize(
    "payload", ["", "not json", "[]", '{"k": "o"}', '{"k": "o", "r": "x"}', '{"k": "z"}']
)
def test_a_payload_that_is_not_ours_reads_as_none(payload: str) -> None:
    assert notify.read(payload) is None


def test_the_channel_is_an_identifier_per_schema() -> None:
    assert notify.channel_for("a") != notify.channel_for("b")
    assert len(notify.channel_for("x" * 63)) < 63
