"""A prompt turn leaves no reference cycles behind.

Objects in a cycle are freed only by the cyclic garbage collector; a few per prompt made the
collector run every ~20 turns and walk them all (a cost the echo benchmark showed as part of
the CPU per turn). The engine now drops a request's cancel callback once it is answered, which
was what closed the prompt handler's cycle (callback -> pending prompt -> request context).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.agent.reference import ReferenceAgent
from acp_once.protocol import schema as s
from acp_once.storage import MemoryStore
from acp_once.testing import connected
from tests.helpers import UpdateRecorder, initialize_request

pytestmark = pytest.mark.anyio

TURNS = 200


def _turns_ended(n: int, updates: list[dict[str, Any]]) -> bool:
    return sum(1 for u in updates if u.get("stopReason") == "end_turn") >= n


@contextmanager
def collector_off() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def our_cyclic_garbage() -> int:
    """Collect, and count the unreachable objects of acp-once's own classes.

    Only ours: under xdist, other tests' leftovers in this process (pool threads, closing
    connections) may make cyclic garbage of their own while the collector is off. A cycle a
    prompt leaves always holds one of ours (its pending prompt, request context, session...).
    """
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        ours = sum(1 for o in gc.garbage if type(o).__module__.startswith("acp_once"))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return ours


@pytest.mark.parametrize("keyed", [False, True], ids=["unkeyed", "keyed"])
async def test_echo_turns_leave_no_cyclic_garbage(tmp_path: Path, keyed: bool) -> None:
    recorder = UpdateRecorder()
    with anyio.fail_after(30):
        async with (
            MemoryStore() as store,
            ReferenceAgent(store, side_effects=tmp_path / "fx") as agent,
            connected(agent, recorder) as conn,
        ):
            await conn.agent.initialize(initialize_request())
            sid = (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id

            async def turns(n: int, first: int) -> None:
                for i in range(first, first + n):
                    params: dict[str, object] = {
                        "sessionId": sid,
                        "prompt": [{"type": "text", "text": f"hello {i}"}],
                    }
                    if keyed:
                        params["idempotencyKey"] = f"key-{i}"
                    await conn.rpc.request("session/prompt", params)
                    await recorder.wait_for(partial(_turns_ended, i + 1))

            await turns(10, 0)  # warm up: caches, pooled tasks
            with collector_off():
                await turns(TURNS, 10)
                found = our_cyclic_garbage()
            assert await store.count_user_messages(sid) == TURNS + 10
    # a cycle per prompt would leave at least TURNS of our objects; none are left today
    assert found < TURNS // 2, f"{found} of our objects in reference cycles after {TURNS} turns"
