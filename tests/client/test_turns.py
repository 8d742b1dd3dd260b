"""`PromptHandle`: waiting for a prompt's turn against the reference agent over real stdio, and
`on_update` with plain and async callbacks."""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path

import anyio
import pytest

from acp_once.client import (
    AcpClient,
    HttpLauncher,
    OutcomeUnknown,
    PromptHandle,
    SessionUpdate,
    StdioLauncher,
    WebSocketLauncher,
)
from acp_once.protocol import schema as s
from acp_once.protocol.errors import INVALID_PARAMS, AcpError
from acp_once.support.backoff import Backoff
from tests.remote.harness import ServeProcess

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 30
FAST = Backoff(base=0.05, factor=2.0, cap=0.5)


def launcher(tmp: Path, **env: str) -> StdioLauncher:
    command = [
        sys.executable, "-m", "acp_once", "agent",
        "--store", f"sqlite:{tmp / 'agent.sqlite3'}", "--side-effects", str(tmp / "fx"),
    ]  # fmt: skip
    return StdioLauncher(command, env={**os.environ, **env})


def kinds(updates: tuple[SessionUpdate, ...] | list[SessionUpdate]) -> list[str]:
    return [str(getattr(u, "session_update", "")) for u in updates]


async def test_a_handle_gives_the_message_id_the_turn_updates_and_its_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plain: list[SessionUpdate] = []
    awaited: list[SessionUpdate] = []

    async def async_callback(update: SessionUpdate) -> None:
        awaited.append(update)

    with anyio.fail_after(TIMEOUT):
        async with AcpClient(launcher(tmp_path), backoff=FAST) as client:
            session = await client.new_session("/tmp/project")
            session.on_update(plain.append)  # a plain function: called, nothing awaited
            session.on_update(async_callback)
            turn = session.prompt("build it [tool]")
            before = turn.message_id  # sent in the background: not inserted yet
            assert isinstance(turn, PromptHandle) and before is None
            streamed = [u async for u in turn.updates()]
            result = await turn.finished()
            assert turn.done and turn.message_id == result.message_id == await turn
    assert result.stop_reason == "end_turn" and result.error is None
    first = streamed[0]
    assert isinstance(first, s.SessionUpdateUserMessage)
    assert first.message_id == result.message_id
    assert list(result.updates) == streamed
    assert kinds(streamed)[1:] == [
        "state_update",  # running
        "tool_call_update",
        "tool_call_update",
        "agent_message",
        "state_update",  # idle, end_turn
    ]
    assert result.text == "build it [tool]"
    assert [type(m) for m in result.messages] == [s.SessionUpdateAgentMessage]
    # both callbacks got the same typed updates, and no callback failed
    assert plain == awaited and streamed[0] in plain and streamed[-1] in plain
    assert "callback failed" not in caplog.text


async def test_held_prompts_each_wait_for_their_own_turn(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(launcher(tmp_path), backoff=FAST) as client:
            session = await client.new_session("/tmp/project")
            first = session.prompt("first [work:0.3]")
            second = session.prompt("second")  # held behind the first turn
            one, two = await first.finished(), await second.finished()
    assert one.message_id != two.message_id
    assert one.text == "first [work:0.3]" and two.text == "second"
    # only the last of back-to-back turns has an idle update of its own (None: not reported)
    assert one.stop_reason in (None, "end_turn") and two.stop_reason == "end_turn"
    assert isinstance(two.updates[0], s.SessionUpdateUserMessage)
    assert two.updates[0].message_id == two.message_id


async def test_a_turn_interrupted_by_an_agent_restart_ends_with_error(tmp_path: Path) -> None:
    agent = launcher(tmp_path)
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(agent, backoff=FAST) as client:
            session = await client.new_session("/tmp/project")
            turn = session.prompt("long [work:60]")
            async for update in turn.updates():
                if getattr(update, "state", None) == "running":
                    break  # the turn runs: now the agent dies
            process = agent.current
            assert process is not None
            process.process.kill()
            result = await turn.finished()  # reported after the client reconnected and resumed
            assert client.reconnects == 1 and agent.connects == 2
    assert result.stop_reason == "error"
    assert result.error is not None and "restarted" in result.error["message"]
    assert isinstance(result.updates[0], s.SessionUpdateUserMessage)


async def test_a_lost_answer_is_resent_and_the_turn_still_ends(tmp_path: Path) -> None:
    """The agent commits the message and dies before answering (and before the user message
    reaches the client): the resend is answered from the store after the resume, and the
    interrupted turn ends with error."""
    agent = launcher(
        tmp_path, ACP_ONCE_CRASH="after-insert", ACP_ONCE_CRASH_MARKER=str(tmp_path / "crashed")
    )
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(agent, backoff=FAST) as client:
            session = await client.new_session("/tmp/project")
            turn = session.prompt("migrate")
            result = await turn.finished()
            assert agent.connects == 2
            after = await session.prompt("after the restart").finished()
    assert result.stop_reason == "error"
    assert after.stop_reason == "end_turn" and after.text == "after the restart"


async def test_a_failing_callback_is_logged_and_the_next_update_still_comes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[SessionUpdate] = []

    def broken(update: SessionUpdate) -> None:
        seen.append(update)
        raise RuntimeError("callback bug")

    with caplog.at_level(logging.ERROR, logger="acp_once.client"), anyio.fail_after(TIMEOUT):
        async with AcpClient(launcher(tmp_path), backoff=FAST) as client:
            session = await client.new_session("/tmp/project")
            session.on_update(broken)
            result = await session.prompt("hello").finished()
    assert len(seen) == len(result.updates) >= 3
    assert caplog.text.count("an update callback failed") == len(seen)
    assert "TypeError" not in caplog.text


async def test_a_refused_prompt_fails_its_handle(tmp_path: Path) -> None:
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(launcher(tmp_path), backoff=FAST) as client:
            session = await client.new_session("/tmp/project")
            turn = session.prompt([{"type": "_acp_once_unknown", "data": "aGk="}])
            with pytest.raises(AcpError) as info:
                await turn.finished()
            assert info.value.code == INVALID_PARAMS
            assert turn.done and turn.message_id is None
        with pytest.raises(RuntimeError):
            session.prompt("after the client closed")


async def test_a_turn_still_running_when_the_client_closes_is_unknown(tmp_path: Path) -> None:
    agent = launcher(tmp_path)
    agent.shutdown_timeout = 1.0  # the agent's running turn does not hold up the test
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(agent, backoff=FAST) as client:
            session = await client.new_session("/tmp/project")
            turn = session.prompt("long [work:60]")
            message_id = await turn
        assert await turn == message_id  # the insertion stands
        with pytest.raises(OutcomeUnknown):
            await turn.finished()
        with pytest.raises(OutcomeUnknown):
            async for _ in turn.updates():
                pass


async def test_a_client_that_gives_up_reconnecting_ends_its_turns_unknown(tmp_path: Path) -> None:
    once = tmp_path / "started"
    command = (
        f"test -e {once} && exit 1; touch {once}; exec {shlex.join(launcher(tmp_path).command)}"
    )
    agent = StdioLauncher(["sh", "-c", command])  # a restart of the agent fails
    with anyio.fail_after(TIMEOUT):
        async with AcpClient(agent, backoff=Backoff(base=0.05, max_attempts=2)) as client:
            session = await client.new_session("/tmp/project")
            turn = session.prompt("long [work:60]")
            message_id = await turn
            assert agent.current is not None
            agent.current.process.kill()
            with pytest.raises(OutcomeUnknown, match="gave up"):
                await turn.finished()
            assert await turn == message_id


@pytest.mark.parametrize("scheme", ["ws", "http"])
async def test_over_the_network_a_server_restart_ends_the_turn_with_error(
    tmp_path: Path, scheme: str
) -> None:
    """`acp-once serve` killed mid-turn and started again: the handle's turn ends after the
    client reconnected and resumed, and the next prompt's turn ends normally."""
    async with ServeProcess(tmp_path) as server:
        url = f"{scheme}://127.0.0.1:{server.port}/acp"
        agent = WebSocketLauncher(url) if scheme == "ws" else HttpLauncher(url)
        with anyio.fail_after(TIMEOUT):
            async with AcpClient(agent, backoff=FAST) as client:
                session = await client.new_session("/tmp/project")
                turn = session.prompt("long [work:60]")
                async for update in turn.updates():
                    if getattr(update, "state", None) == "running":
                        break
                await server.restart()
                result = await turn.finished()
                after = await session.prompt("after [tool]").finished()
    assert result.stop_reason == "error" and client.reconnects >= 1
    assert after.stop_reason == "end_turn" and after.text == "after [tool]"
