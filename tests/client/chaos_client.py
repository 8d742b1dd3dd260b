"""A client process for the chaos tests: submits prompts and records their message ids.

    python chaos_client.py WORKDIR N SESSIONS

It keeps its state in WORKDIR as an application would: `run.json` (a random run id and the
session ids, written once), `results.jsonl` (prompt index -> message id), and an SQLite outbox.
Each prompt's key is made from the run id and the prompt's index, so a restarted process that
resubmits a prompt whose answer it never recorded reuses that prompt's key (the application
passes its own key, as the RFD allows). Killing it at any moment and starting it again must
end with every prompt inserted exactly once.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import anyio

from acp_once.client import AcpClient, StdioLauncher
from acp_once.support.backoff import Backoff


def prompt_text(i: int) -> str:
    text = f"prompt {i}"
    if i % 5 == 0:
        text += " [tool]"
    if i % 7 == 0:
        text += " [work:0.2]"
    return text


async def main(workdir: Path, n: int, n_sessions: int) -> None:
    run_file = workdir / "run.json"
    results_file = workdir / "results.jsonl"
    launcher = StdioLauncher(
        [
            sys.executable, "-m", "acp_once", "agent",
            "--store", f"sqlite:{workdir / 'agent.sqlite3'}",
            "--side-effects", str(workdir / "effects"),
            "--interrupted", "continue",
        ],
        env=dict(os.environ),
    )  # fmt: skip
    async with AcpClient(
        launcher,
        outbox=f"sqlite:{workdir / 'outbox.sqlite3'}",
        backoff=Backoff(base=0.05, factor=2.0, cap=0.5),
        on_unaware="refuse",
    ) as client:
        if run_file.exists():
            run = json.loads(run_file.read_text())
            sessions = [await client.resume_session(sid, "/tmp/chaos") for sid in run["sessions"]]
        else:
            sessions = [await client.new_session("/tmp/chaos") for _ in range(n_sessions)]
            run = {"run": uuid.uuid4().hex, "sessions": [x.session_id for x in sessions]}
            run_file.write_text(json.dumps(run))
        done: set[int] = set()
        if results_file.exists():
            done = {json.loads(line)["i"] for line in results_file.read_text().splitlines() if line}
        namespace = uuid.UUID(run["run"])

        async def submit_all(k: int) -> None:
            session = sessions[k]
            for i in range(k, n, n_sessions):
                if i in done:
                    continue
                key = str(uuid.uuid5(namespace, str(i)))
                message_id = await session.prompt(prompt_text(i), idempotency_key=key)
                with results_file.open("a") as out:
                    out.write(
                        json.dumps({"i": i, "session": session.session_id, "id": message_id}) + "\n"
                    )

        async with anyio.create_task_group() as tg:
            for k in range(n_sessions):
                tg.start_soon(submit_all, k)
        print("reconnects", client.reconnects, flush=True)


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
