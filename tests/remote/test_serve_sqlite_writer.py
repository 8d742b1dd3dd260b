"""`acp-once serve` on SQLite writes through its writer process (`acp_once.storage.sqlite.
writer`): the writer SIGKILLed again and again under keyed load from several sessions loses and
duplicates nothing, and it leaves with serve, even a SIGKILLed serve."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import pytest

from acp_once.client import AcpClient, WebSocketLauncher
from acp_once.protocol.errors import AcpError
from acp_once.protocol.keys import new_key
from acp_once.storage import open_store
from acp_once.support.backoff import Backoff
from tests.helpers import wait_gone
from tests.remote.harness import ServeProcess

if TYPE_CHECKING:
    from collections.abc import Callable

    from acp_once.client import ClientSession

pytestmark = pytest.mark.anyio

TIMEOUT = 25.0  # seconds: bounds every wait, sized for a loaded machine
SESSIONS = 4
PROMPTS = 25  # per session
KILLS = 3
FAST = Backoff(base=0.02, factor=2.0, cap=0.2)


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (listed by the thread that started each)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            children += [int(child) for child in (task / "children").read_text().split()]
    return children


def _fresh(pid: int, killed: list[int]) -> list[int]:
    """The child processes of `pid` not killed yet."""
    return [child for child in _children(pid) if child not in killed]


def _wait_gone(pid: int) -> bool:
    return wait_gone(pid, TIMEOUT)


async def _until(predicate: Callable[[], bool], interval: float = 0.01) -> None:
    """Poll `predicate` (the client's progress, or another process) until it holds; bounded
    by the caller's fail_after."""
    while not predicate():  # noqa: ASYNC110
        await anyio.sleep(interval)


async def test_a_writer_killed_under_keyed_load_loses_and_duplicates_nothing(
    tmp_path: Path,
) -> None:
    """Trace: 4 sessions send 25 keyed prompts each, one after the other; the serve node's
    writer is SIGKILLed 3 times while they do. A prompt whose write died with the writer is
    answered with an error (nothing of it was stored: the runtime looked its key up), and the
    application sends it again with the same key. Property: every key is stored exactly once,
    with the message id its prompt was answered with; serve started a new writer after each
    kill, and its log names no key."""
    answered: dict[str, tuple[str, str]] = {}  # key -> (session, message id)
    errors = 0
    async with ServeProcess(tmp_path) as srv:
        url = f"ws://127.0.0.1:{srv.port}/acp"

        async def drive(session: ClientSession) -> None:
            nonlocal errors
            for n in range(PROMPTS):
                key = new_key()
                while True:
                    try:
                        message_id = await session.prompt(f"p{n}", idempotency_key=key)
                    except AcpError:
                        errors += 1  # not stored (the runtime looked): the same key again
                        continue
                    answered[key] = (session.session_id, message_id)
                    break

        writers: list[int] = []
        with anyio.fail_after(3 * TIMEOUT):
            async with AcpClient(WebSocketLauncher(url), backoff=FAST) as client:
                sessions = [await client.new_session("/w") for _ in range(SESSIONS)]
                async with anyio.create_task_group() as tg:
                    for session in sessions:
                        tg.start_soon(drive, session)
                    for kill in range(KILLS):
                        enough = (kill + 1) * 15
                        await _until(lambda: len(answered) >= enough)  # noqa: B023
                        # a new writer after each kill (the one killed last may still be
                        # listed, until serve notices its end and reaps it)
                        await _until(lambda: bool(_fresh(srv.pid, writers)))
                        (writer,) = _fresh(srv.pid, writers)
                        writers.append(writer)
                        os.kill(writer, signal.SIGKILL)
                        assert _wait_gone(writer)
        assert len(answered) == SESSIONS * PROMPTS
        async with open_store(f"sqlite:{srv.db}") as store:
            for key, (session_id, message_id) in answered.items():
                assert await store.count_user_messages(session_id, idempotency_key=key) == 1
                found = await store.find_key(session_id, key)
                assert found is not None and found.message_id == message_id
            for session in sessions:
                assert await store.count_user_messages(session.session_id) == PROMPTS
        last = _children(srv.pid)
        assert len(last) == 1 and last[0] not in writers
        await srv.kill()
    assert _wait_gone(last[0])  # the writer left with its SIGKILLed serve
    log = (tmp_path / "serve.stderr").read_text()
    assert not [key for key in answered if key in log]  # the failures logged no key
