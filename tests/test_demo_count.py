"""How the demo counts side effects: work neither done nor reported as failed is told apart
from a turn that was reported (`stopReason: "error"`), as A3 reports a turn interrupted twice."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from acp_once.agent.state import turn_end
from acp_once.demo import _count, _Demo, prompt_text
from acp_once.storage import SessionRecord, open_store

pytestmark = pytest.mark.anyio


async def _insert(store_url: str, sid: str, i: int, message_id: str, stop: str) -> None:
    """Submission `i` inserted as `message_id`, its turn ended with `stop` and no answer."""
    async with open_store(store_url) as store:
        if await store.get_session(sid) is None:
            await store.create_session(SessionRecord(sid, "/tmp/demo", (), None, 0.0, 0.0))
        user = {
            "sessionUpdate": "user_message",
            "content": [{"type": "text", "text": prompt_text(i)}],
        }
        await store.insert_user_message(
            sid,
            message_id=message_id,
            update=orjson.dumps(user),
            idempotency_key=None,
            prompt_digest=None,
        )
        end = turn_end(message_id, stop, {"code": -32603, "message": "interrupted"})
        await store.append_update(sid, orjson.dumps(end))


async def test_a_missing_side_effect_is_unreported_unless_its_turn_ended_with_an_error(
    tmp_path: Path,
) -> None:
    demo = _Demo(tmp_path, True, 8, 0, None, 0.0)
    demo.session_ids = ["sess_count"]
    (tmp_path / "effects").mkdir()
    # submissions 0 and 4 call the tool (`prompt_text`); neither left a side effect
    assert "[tool]" in prompt_text(0) and "[tool]" in prompt_text(4)
    await _insert(demo.store, "sess_count", 0, "msg_reported", "error")
    await _insert(demo.store, "sess_count", 4, "msg_silent", "end_turn")
    result = await _count(demo, 0.0, 0)
    assert result.inserted_once == 2
    assert result.missing_side_effects == 2
    assert result.unreported_missing_side_effects == 1  # the turn that ended "end_turn"
    assert result.interrupted_turns == 2
    # the silent one's tool did run: only the reported one is missing, and it was told
    (tmp_path / "effects" / "run.log").write_text("msg_silent\n", encoding="utf-8")
    result = await _count(demo, 0.0, 0)
    assert result.missing_side_effects == 1
    assert result.unreported_missing_side_effects == 0
    assert result.duplicate_side_effects == 0
