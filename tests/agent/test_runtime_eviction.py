"""The runtime's maps are back to size after connections come and go (issue 20, finding 10).

`cancel_marks` kept an entry per connection that ever sent `session/cancel` or
`session/close`, and `_sessions` every session ever created or resumed: memory grew with
every client. A session nothing holds is dropped and reloads from the store on resume.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from acp_once.agent import Extension, StopReason
from acp_once.agent.reference import ReferenceAgent
from acp_once.agent.runtime import Turn, TurnContext
from acp_once.storage import MemoryStore
from acp_once.testing import connected
from tests.helpers import UpdateRecorder, initialize_request

pytestmark = pytest.mark.anyio

N = 25


def prompt_params(sid: str, text: str, key: str) -> dict[str, object]:
    return {"sessionId": sid, "prompt": [{"type": "text", "text": text}], "idempotencyKey": key}


async def test_cancel_marks_of_closed_connections_are_evicted(tmp_path: Path) -> None:
    with anyio.fail_after(20):
        async with (
            MemoryStore() as store,
            ReferenceAgent(store, side_effects=tmp_path) as agent,
            connected(agent) as first,
        ):
            await first.agent.initialize(initialize_request("t"))
            sid = (await first.rpc.request("session/new", {"cwd": "/w"}))["sessionId"]
            for _ in range(N):
                async with connected(agent) as conn:
                    await conn.agent.initialize(initialize_request("t"))
                    await conn.rpc.request("session/resume", {"sessionId": sid, "cwd": "/w"})
                    await conn.rpc.notify("session/cancel", {"sessionId": sid})
                    await conn.rpc.request("session/close", {"sessionId": sid})
            # the first connection keeps the session in memory; the others left no mark
            assert agent._sessions[sid].inbox.cancel_marks == {}


async def test_sessions_nothing_holds_are_dropped_and_reload_on_resume(tmp_path: Path) -> None:
    with anyio.fail_after(20):
        async with MemoryStore() as store, ReferenceAgent(store, side_effects=tmp_path) as agent:
            answers: dict[str, str] = {}
            for i in range(N):
                recorder = UpdateRecorder()
                async with connected(agent, recorder) as conn:
                    await conn.agent.initialize(initialize_request("t"))
                    sid = (await conn.rpc.request("session/new", {"cwd": "/w"}))["sessionId"]
                    result = await conn.rpc.request("session/prompt", prompt_params(sid, "hi", "k"))
                    answers[sid] = result["messageId"]
                    if i % 2:  # half of them also close the session before leaving
                        await conn.rpc.request("session/close", {"sessionId": sid})
            # the memory store runs no threads: once every task waits, every turn has ended
            await anyio.wait_all_tasks_blocked()
            assert agent._sessions == {}
            # dropped from memory, not from the store: a retry after resume is still a retry
            async with connected(agent) as conn:
                await conn.agent.initialize(initialize_request("t"))
                for sid, message_id in answers.items():
                    await conn.rpc.request("session/resume", {"sessionId": sid, "cwd": "/w"})
                    again = await conn.rpc.request("session/prompt", prompt_params(sid, "hi", "k"))
                    assert again["messageId"] == message_id
                    assert await store.count_user_messages(sid) == 1
            await anyio.wait_all_tasks_blocked()
            assert agent._sessions == {}


class GatedAgent(ReferenceAgent):
    """Each turn waits for `release`: a turn that outlives its connection."""

    release: anyio.Event

    async def run_turn(self, turn: Turn, emit: TurnContext) -> StopReason | Extension:
        await self.release.wait()
        return await super().run_turn(turn, emit)


async def test_a_session_whose_turn_outlives_its_connection_is_dropped_when_it_ends(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(20):
        async with MemoryStore() as store, GatedAgent(store, side_effects=tmp_path) as agent:
            agent.release = anyio.Event()
            async with connected(agent) as conn:
                await conn.agent.initialize(initialize_request("t"))
                sid = (await conn.rpc.request("session/new", {"cwd": "/w"}))["sessionId"]
                await conn.rpc.request("session/prompt", prompt_params(sid, "slow", "k"))
            await anyio.wait_all_tasks_blocked()
            assert sid in agent._sessions  # its turn still runs: it must stay
            agent.release.set()
            await anyio.wait_all_tasks_blocked()
            assert agent._sessions == {}
            assert await store.count_user_messages(sid) == 1
