"""What only the in-memory store must get right (the shared behaviour is in test_contract.py)."""

from __future__ import annotations

import tracemalloc

import orjson
import pytest

from acp_once.storage import MemoryStore, SessionRecord

pytestmark = pytest.mark.anyio


async def test_retained_updates_cost_their_size_not_orjsons_buffer() -> None:
    # orjson's output keeps the capacity it was built in (~4 KiB for a small update); a store
    # that keeps every update must keep a copy of the update's own size.
    store = MemoryStore()
    await store.create_session(SessionRecord("s", "/w", (), None, 1.0, 1.0))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(2_000):
            update = orjson.dumps({"sessionUpdate": "agent_message", "messageId": f"m{i}"})
            if i % 2:
                await store.append_updates("s", [(update, None)])
            else:
                await store.insert_user_message(
                    "s",
                    message_id=f"m{i}",
                    update=update,
                    idempotency_key=None,
                    prompt_digest=None,
                )
        del update  # only what the store keeps is left
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    per_update = grown / 2_000
    assert per_update < 1_000, f"{per_update:.0f} bytes kept per ~50-byte update"
    timeline = await store.read_timeline("s", limit=2_000)
    assert len(timeline) == 2_000
    assert orjson.loads(timeline[5].update)["messageId"] == "m5"
