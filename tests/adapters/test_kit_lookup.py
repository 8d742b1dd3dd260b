"""`AdapterKeys.lookup`: the same once-per-session cache as `submit`, without submitting."""

from __future__ import annotations

import pytest

from acp_once.agent.adapter import AdapterKeys, derive_message_id

pytestmark = pytest.mark.anyio


async def test_lookup_shares_the_cache_with_submit_and_submits_nothing() -> None:
    stored = {"s1": [derive_message_id("s1", "old")]}
    reads: list[str] = []

    async def history(session_id: str) -> list[str]:
        reads.append(session_id)
        return list(stored.get(session_id, []))

    async def submit(message_id: str) -> None:
        stored.setdefault("s1", []).append(message_id)

    keys = AdapterKeys()
    old = derive_message_id("s1", "old")
    assert await keys.lookup("s1", "old", load_history_ids=history) == old
    assert await keys.lookup("s1", "new", load_history_ids=history) is None
    assert len(stored["s1"]) == 1  # a lookup never submits
    new = await keys.submit("s1", "new", submit, load_history_ids=history)
    assert await keys.lookup("s1", "new", load_history_ids=history) == new  # added on submit
    assert reads == ["s1"]  # one history read for all of it
    assert await keys.lookup("s2", "old", load_history_ids=history) is None  # scoped per session
    assert reads == ["s1", "s2"]
    with pytest.raises(ValueError):
        await keys.lookup("s1", "", load_history_ids=history)
