"""How a pending turn ends for `PromptHandle`: by the end that names its message (tagged,
against a scripted agent), and from a replayed history for a submission an earlier run made
(a caller-named key)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest

from acp_once.client import AcpClient, StdioLauncher

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 30
AGENT = Path(__file__).with_name("tagged_agent.py")
OLD_KEY = "11111111-1111-4111-8111-111111111111"


def launcher() -> StdioLauncher:
    return StdioLauncher([sys.executable, str(AGENT)], env=dict(os.environ))


async def test_tagged_ends_end_the_turn_they_name_not_the_first_open_one() -> None:
    """user A, user B, end(B), end(A): B ends "cancelled", A ends with its own "end_turn"."""
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(launcher()) as client:
            session = await client.new_session("/tmp/p")
            first = session.prompt("first")
            assert await first == "msg_A"
            second = session.prompt("second")
            b = await second.finished()
            a = await first.finished()
    assert (b.message_id, b.stop_reason) == ("msg_B", "cancelled")
    assert (a.message_id, a.stop_reason) == ("msg_A", "end_turn")
    # A's turn holds B's user message (it came during A's turn), never B's end
    assert [getattr(u, "message_id", None) for u in a.updates][:1] == ["msg_A"]
    assert all(getattr(u, "stop_reason", None) != "cancelled" for u in a.updates)


async def test_a_named_submission_of_an_earlier_run_ends_from_the_replayed_history() -> None:
    """The key was used before: the agent answers the recorded message, which the replay
    shows with its tagged end; the handle ends at once with that end and the turn's text."""
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(launcher()) as client:
            session = await client.resume_session("sess_1", "/tmp/p", history=True)
            turn = session.prompt("old", idempotency_key=OLD_KEY)
            result = await turn.finished()
    assert (result.message_id, result.stop_reason) == ("msg_old", "end_turn")
    assert turn.from_history
    assert result.text == "done before"


async def test_a_prompt_lost_before_insertion_is_followed_after_the_resend(
    tmp_path: Path,
) -> None:
    """The first POST of the prompt never reaches the server: the client reconnects and
    resumes (the idle snapshot comes before the resend), then the resend is inserted. The
    turn is the one that runs after the resend, not the idle the resume reported."""
    from acp_once.client import HttpLauncher
    from acp_once.faultproxy import FaultProxy, request_with_method
    from acp_once.support.backoff import Backoff
    from tests.remote.harness import ServeProcess

    with anyio.fail_after(TIMEOUT):
        async with (
            ServeProcess(tmp_path) as server,
            FaultProxy(("127.0.0.1", server.port)) as proxy,
        ):
            url = f"http://127.0.0.1:{proxy.port}/acp"
            backoff = Backoff(base=0.05, factor=2.0, cap=0.5)
            async with AcpClient(HttpLauncher(url), backoff=backoff) as client:
                session = await client.new_session("/tmp/p")
                rule = proxy.fail_post(request_with_method("session/prompt"))
                turn = session.prompt("fresh [work:1]")
                result = await turn.finished()
                await rule.wait()
                assert client.reconnects >= 1
            assert await server.count(session.session_id) == 1
    assert (result.stop_reason, result.text) == ("end_turn", "fresh [work:1]")
    assert not turn.from_history


async def test_an_update_made_while_the_client_was_away_reaches_it_once(tmp_path: Path) -> None:
    """The agent dies while a turn runs and runs it again after the restart
    (`--interrupted continue`): the turn's answer is stored while the client reconnects
    and replays the history (then it comes in the replay) or after (then it comes live).
    Either way `on_update` and the handle get it exactly once."""
    from acp_once.client import SessionUpdate
    from acp_once.support.backoff import Backoff

    command = [
        sys.executable, "-m", "acp_once", "agent", "--interrupted", "continue",
        "--store", f"sqlite:{tmp_path / 'agent.db'}", "--side-effects", str(tmp_path / "fx"),
    ]  # fmt: skip
    agent = StdioLauncher(command, env=dict(os.environ))
    seen: list[SessionUpdate] = []
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(agent, backoff=Backoff(base=0.05, factor=2.0, cap=0.5)) as client:
            session = await client.new_session("/tmp/p")
            session.on_update(seen.append)
            earlier = await session.prompt("earlier").finished()
            turn = session.prompt("again [work:1]")
            async for update in turn.updates():
                if getattr(update, "state", None) == "running":
                    break
            process = agent.current
            assert process is not None
            process.process.kill()
            result = await turn.finished()
    answers = [
        u
        for u in seen
        if getattr(u, "session_update", None) == "agent_message"
        and "again" in str(getattr(u, "content", ""))
    ]
    assert earlier.stop_reason == "end_turn"
    assert len(answers) == 1
    assert result.text == "again [work:1]"
    assert len([u for u in seen if getattr(u, "message_id", None) == earlier.message_id]) == 1
