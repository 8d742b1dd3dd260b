"""`acp-once prompt`: prints the turn, and a killed command rerun with its outbox finishes the
same submission without inserting it twice."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from rich.console import Console

from acp_once.cli.prompt import Renderer
from acp_once.client import SessionUpdate
from acp_once.client.outbox import open_outbox
from acp_once.storage import open_store
from tests.remote.harness import ServeProcess

pytestmark = pytest.mark.slow

_PROMPT = [sys.executable, "-m", "acp_once", "prompt"]


def agent_command(tmp: Path, *extra: str) -> str:
    return (
        f"{sys.executable} -m acp_once agent --store sqlite:{tmp / 'agent.db'}"
        f" --side-effects {tmp / 'fx'} " + " ".join(extra)
    )


def test_prompt_prints_the_turn(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "acp_once", "prompt", "--agent", agent_command(tmp_path)]
    done = subprocess.run(
        [*command, "hi [tool]"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "inserted as msg_user_" in out
    assert "hi [tool]" in out  # user text is shown as typed, not as markup
    # the completing update names only the id: the title of the call is shown again
    assert "tool append to the side-effect log: completed" in out
    assert "tool_" not in out  # never a raw toolCallId
    assert out.rstrip().endswith("stop reason: end_turn")


def test_unreachable_agents_fail_in_one_line(tmp_path: Path) -> None:
    for agent in ("ws://127.0.0.1:1/acp", str(tmp_path / "no-such-agent")):
        done = subprocess.run(
            [sys.executable, "-m", "acp_once", "prompt", "--agent", agent, "hi"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 1
        assert done.stdout.strip().startswith("could not reach the agent:")
        assert len(done.stdout.strip().splitlines()) == 1
        assert "Traceback" not in done.stdout + done.stderr


def test_chunks_are_joined_and_a_missing_title_shows_the_kind() -> None:
    from acp_once.protocol.updates import validate_update_notification

    def update(**fields: object) -> SessionUpdate:
        return validate_update_notification({"sessionId": "s", "update": fields}).update

    out = io.StringIO()
    renderer = Renderer(Console(file=out, width=40, highlight=False, color_system=None))
    chunk = {"sessionUpdate": "agent_message_chunk", "messageId": "m1"}
    for text in ("The answer ", "is [42]", ", and it is long enough to pass forty columns."):
        renderer.update(update(**chunk, content={"type": "text", "text": text}))
    renderer.update(update(sessionUpdate="tool_call_update", toolCallId="tool_1", kind="read"))
    renderer.update(update(sessionUpdate="tool_call_update", toolCallId="tool_1", status="done"))
    renderer.update(update(sessionUpdate="state_update", state="idle", stopReason="end_turn"))
    renderer.finish()
    assert out.getvalue().splitlines() == [
        "agent The answer is [42], and it is long enough to pass forty columns.",
        "tool read",
        "tool read: done",
    ]


async def _prompt(agent: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    done = await anyio.run_process(
        [sys.executable, "-m", "acp_once", "prompt", "--agent", agent, *args],
        check=False,
        env={**os.environ, **(env or {})},
    )
    out = done.stdout.decode() + done.stderr.decode()
    assert "Traceback" not in out
    return done.returncode or 0, done.stdout.decode()


@pytest.mark.anyio
@pytest.mark.parametrize("token", [None, "s3cret-token"])
async def test_prompt_over_websocket_and_http_against_serve(
    tmp_path: Path, token: str | None
) -> None:
    """A real `acp-once serve`, reached over ws:// and http://: the token by flag (ws) and by
    ACP_ONCE_TOKEN (http); a wrong token fails with a clear line."""
    extra = ("--token", token) if token else ()
    results: dict[str, tuple[int, str]] = {}
    with anyio.fail_after(60):
        async with ServeProcess(tmp_path, *extra) as server:
            ws, http = f"ws://127.0.0.1:{server.port}/acp", f"http://127.0.0.1:{server.port}/acp"
            by_flag = ("--token", token) if token else ()
            by_env = {"ACP_ONCE_TOKEN": token} if token else {}

            async def run(
                name: str, agent: str, args: tuple[str, ...], env: dict[str, str]
            ) -> None:
                results[name] = await _prompt(agent, *args, env=env)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "ws", ws, (*by_flag, "over ws [tool]"), {})
                tg.start_soon(run, "http", http, ("over http [tool]",), by_env)
                if token:
                    tg.start_soon(run, "ws wrong", ws, ("--token", "wrong", "x"), {})
                    tg.start_soon(run, "http wrong", http, ("x",), {"ACP_ONCE_TOKEN": "wrong"})
    for name in ("ws", "http"):
        status, out = results[name]
        assert status == 0, out
        assert f"agent over {name} [tool]" in out
        assert "tool append to the side-effect log: completed" in out
        assert out.rstrip().endswith("stop reason: end_turn")
    for name in ("ws wrong", "http wrong") if token else ():
        status, out = results[name]
        assert status == 1
        assert out.strip() == (
            "could not reach the agent: the server refused the token (HTTP 401): "
            "check --token or ACP_ONCE_TOKEN"
        )


def test_killed_prompt_rerun_with_outbox_inserts_once(tmp_path: Path) -> None:
    outbox = tmp_path / "outbox.db"
    once = tmp_path / "launched"
    # First launch: the agent commits the message and dies before answering. Every later
    # launch fails at once, so the command is stuck reconnecting when we kill it.
    flaky_agent = f"sh -c 'test -e {once} && exit 1; touch {once}; exec {agent_command(tmp_path)}'"
    env = {**os.environ, "ACP_ONCE_CRASH": "after-insert"}
    args = ["--outbox", str(outbox), "--wait", "0", "deploy [tool]"]
    first = [sys.executable, "-m", "acp_once", "prompt", "--agent", flaky_agent, *args]
    with subprocess.Popen(
        first, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:  # blocks until the client reports the lost agent
            if b"connection to the agent failed" in line:
                break
        else:
            raise AssertionError("the command ended without losing its agent")
        proc.kill()
        proc.wait()

    async def pending() -> int:
        async with open_outbox(f"sqlite:{outbox}") as box:
            return len(await box.pending())

    assert anyio.run(pending) == 1  # the submission and its key survived the kill
    again = [sys.executable, "-m", "acp_once", "prompt", "--agent", agent_command(tmp_path), *args]
    rerun = subprocess.run(again, capture_output=True, text=True, timeout=60, check=False)
    assert rerun.returncode == 0, rerun.stderr
    assert "finished a pending submission" in rerun.stdout
    assert anyio.run(pending) == 0

    async def count() -> int:
        async with open_store(f"sqlite:{tmp_path / 'agent.db'}") as store:
            sessions, _ = await store.list_sessions()
            assert len(sessions) == 1
            return await store.count_user_messages(sessions[0].session_id)

    assert anyio.run(count) == 1


def test_a_streamed_message_is_printed_once() -> None:
    """The agent guide's streaming pattern: chunks live, then the whole message (same
    messageId) retained. The whole message is not printed again; one that replaces what its
    chunks said is."""
    from acp_once.protocol.updates import validate_update_notification

    def update(**fields: object) -> SessionUpdate:
        return validate_update_notification({"sessionId": "s", "update": fields}).update

    out = io.StringIO()
    renderer = Renderer(Console(file=out, width=80, highlight=False, color_system=None))
    for text in ("Let me ", "look."):
        renderer.update(
            update(
                sessionUpdate="agent_message_chunk",
                messageId="m1",
                content={"type": "text", "text": text},
            )
        )
    whole = {"sessionUpdate": "agent_message", "messageId": "m1"}
    renderer.update(update(**whole, content=[{"type": "text", "text": "Let me look."}]))
    renderer.update(update(**{**whole, "messageId": "m2"}, content=[{"type": "text", "text": "x"}]))
    renderer.update(
        update(
            sessionUpdate="agent_message_chunk",
            messageId="m3",
            content={"type": "text", "text": "a"},
        )
    )
    renderer.update(update(**{**whole, "messageId": "m3"}, content=[{"type": "text", "text": "b"}]))
    renderer.finish()
    assert out.getvalue().splitlines() == ["agent Let me look.", "agent x", "agent a", "agent b"]


STREAMING_AGENT = Path(__file__).parents[2] / "examples" / "streaming_agent.py"


@pytest.mark.parametrize("allow", ["once", "deny", None])
def test_streamed_answer_printed_once_and_permission_answered(allow: str | None) -> None:
    """The example streaming agent: its chunked message is printed once; its permission
    request is answered by --allow, or denied (said on stderr) when stdin is no terminal."""
    flags = ["--allow", allow] if allow else []
    done = subprocess.run(
        [*_PROMPT, "--agent", f"{sys.executable} {STREAMING_AGENT}", *flags, "read it"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.count("Let me look at that file.") == 1
    assert "permission requested: Read notes.txt?" in out
    if allow == "once":
        assert "permission: Allow (--allow once)" in out
        assert "tool Read notes.txt: completed" in out
        assert "denied" not in done.stderr
    else:
        assert "tool Read notes.txt: cancelled" in out
        if allow is None:
            assert "denied: stdin is not a terminal" in done.stderr


def test_permission_asked_on_a_terminal() -> None:
    """stdin a terminal (a pty): the request's options are listed and the typed number
    chosen."""
    import pty

    leader, follower = pty.openpty()
    try:
        os.write(leader, b"1\n")  # waits in the terminal until the question reads it
        done = subprocess.run(
            [*_PROMPT, "--agent", f"{sys.executable} {STREAMING_AGENT}", "read it"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            stdin=follower,
        )
    finally:
        os.close(leader)
        os.close(follower)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "  1. Allow" in done.stdout
    assert "permission: Allow (on the terminal)" in done.stdout
    assert "tool Read notes.txt: completed" in done.stdout
