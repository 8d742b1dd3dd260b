"""Issue acceptance: the agent killed with SIGKILL at random moments, and the client process
itself killed and restarted, while prompts are submitted. Every submission must end with exactly
one user message and one side-effect line per `[tool]` prompt.

The kills come at random moments (a seeded generator picks the delays): that randomness is the
fault injection, not synchronisation; what the test waits for, it waits for with events or
process exits.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from acp_once.client import AcpClient, StdioLauncher
from acp_once.demo import drain
from acp_once.storage import open_store
from acp_once.support.backoff import Backoff
from tests.client.chaos_client import prompt_text

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

CHAOS_CLIENT = Path(__file__).parent / "chaos_client.py"


def agent_command(workdir: Path) -> list[str]:
    return [
        sys.executable, "-m", "acp_once", "agent",
        "--store", f"sqlite:{workdir / 'agent.sqlite3'}",
        "--side-effects", str(workdir / "effects"),
        "--interrupted", "continue",
    ]  # fmt: skip


async def check_invariant(
    workdir: Path, expected: dict[str, list[int]], ids: dict[int, str]
) -> None:
    """Each session holds exactly one user message per submitted prompt (plus the drain
    prompt), the id reported for each prompt is the stored message with its text, and the
    side-effect log has one line per `[tool]` prompt."""
    async with open_store(f"sqlite:{workdir / 'agent.sqlite3'}") as store:
        for sid, indexes in expected.items():
            assert await store.count_user_messages(sid) == len(indexes) + 1  # + the drain prompt
            texts: dict[str, str] = {}
            after = 0
            while page := await store.read_timeline(sid, after_seq=after):
                for entry in page:
                    update = json.loads(entry.update)
                    text = update.get("content", [{}])[0].get("text", "")
                    if update["sessionUpdate"] == "user_message" and not text.startswith("drain"):
                        assert entry.message_id is not None
                        texts[entry.message_id] = text
                after = page[-1].seq
            assert sorted(texts.values()) == sorted(prompt_text(i) for i in indexes)
            for i in indexes:
                assert texts[ids[i]] == prompt_text(i)
            log = workdir / "effects" / f"{sid}.log"
            lines = log.read_text().split() if log.exists() else []
            assert sorted(lines) == sorted(ids[i] for i in indexes if "[tool]" in prompt_text(i))


async def test_agent_killed_at_random_while_200_prompts_are_submitted(tmp_path: Path) -> None:
    rng = random.Random(20261202)
    n, n_sessions = 200, 4
    launcher = StdioLauncher(agent_command(tmp_path), env=dict(os.environ))
    ids: dict[int, str] = {}
    kills = 0
    with anyio.fail_after(240):
        async with AcpClient(
            launcher,
            outbox=f"sqlite:{tmp_path / 'outbox.sqlite3'}",
            backoff=Backoff(base=0.05, factor=2.0, cap=0.5),
            on_unaware="refuse",
        ) as client:
            sessions = [await client.new_session("/tmp/chaos") for _ in range(n_sessions)]
            finished = anyio.Event()

            async def submit_all(k: int) -> None:
                for i in range(k, n, n_sessions):
                    ids[i] = await sessions[k].prompt(prompt_text(i))

            async def killer() -> None:
                # kill at a random moment of each connection's life, ten times at most
                nonlocal kills
                while kills < 10 and not finished.is_set():
                    await client.wait_connected()
                    with anyio.move_on_after(rng.uniform(0.05, 0.8)):
                        await finished.wait()
                    proc = launcher.current
                    if proc is not None and not finished.is_set():
                        proc.process.kill()
                        kills += 1
                        await proc.process.wait()

            async with anyio.create_task_group() as tg:
                tg.start_soon(killer)
                async with anyio.create_task_group() as submitters:
                    for k in range(n_sessions):
                        submitters.start_soon(submit_all, k)
                finished.set()
            await drain(client, [x.session_id for x in sessions])
            assert not await client.outbox.pending()
    assert kills >= 3, "the agent was not killed often enough to test anything"
    assert len(ids) == n and len(set(ids.values())) == n
    expected = {x.session_id: list(range(k, n, n_sessions)) for k, x in enumerate(sessions)}
    await check_invariant(tmp_path, expected, ids)


async def test_client_process_killed_and_restarted_mid_run(tmp_path: Path) -> None:
    n, n_sessions = 60, 3
    rng = random.Random(7)
    results = tmp_path / "results.jsonl"
    command = [sys.executable, str(CHAOS_CLIENT), str(tmp_path), str(n), str(n_sessions)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    restarts = 0

    def recorded() -> int:
        return len(results.read_text().splitlines()) if results.exists() else 0

    with anyio.fail_after(240):
        for _ in range(3):
            # killed once it has recorded a few more answers (a fast machine finished all 60
            # before a timed kill came), at a random point among the next ones
            target = recorded() + rng.randint(3, 8)
            async with await anyio.open_process(
                command, env=env, stderr=subprocess.DEVNULL
            ) as proc:
                while proc.returncode is None and recorded() < target:
                    with anyio.move_on_after(0.01):  # polls another process's file
                        await proc.wait()
                if proc.returncode is None:
                    proc.kill()  # SIGKILL: the outbox and the results file are all that remain
                    await proc.wait()
                    restarts += 1
        final = await anyio.run_process(command, env=env, check=False)
        assert final.returncode == 0, final.stderr.decode()[-3000:]
    assert restarts >= 1
    records = [json.loads(line) for line in results.read_text().splitlines()]
    ids: dict[int, str] = {}
    for record in records:
        # a prompt answered twice (its result recorded, then resubmitted) must get one id
        assert ids.setdefault(record["i"], record["id"]) == record["id"]
    assert sorted(ids) == list(range(n))
    run = json.loads((tmp_path / "run.json").read_text())
    expected = {sid: list(range(k, n, n_sessions)) for k, sid in enumerate(run["sessions"])}
    async with AcpClient(StdioLauncher(agent_command(tmp_path), env=dict(os.environ))) as client:
        for sid in run["sessions"]:
            await client.resume_session(sid, "/tmp/chaos")
        await drain(client, run["sessions"])
    await check_invariant(tmp_path, expected, ids)
