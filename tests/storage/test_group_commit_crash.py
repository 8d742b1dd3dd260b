"""A crash between enqueue and commit: a real process writing to a real SQLite file with group
commit is killed (SIGKILL) while a batch of several writes has run its statements but not its
COMMIT (the callers of that batch queued and waiting for it, others waiting for their turn).
Afterwards every caller that was answered finds its message, no caller that was not answered
does (the stalled batch never committed, and nothing after it was written), and no write is
half there.

The child says where it is on a pipe (`group_commit_child.py`); no sleeps.
"""

from __future__ import annotations

import signal
import sqlite3
import sys
from pathlib import Path

import anyio
import pytest
from anyio.streams.text import TextReceiveStream

from acp_once.storage import KeyRecord, SqliteStore

pytestmark = pytest.mark.anyio

CHILD = Path(__file__).with_name("group_commit_child.py")
ROOT = Path(__file__).parents[2]
SESSIONS = 12


async def test_a_kill_between_enqueue_and_commit_loses_only_unanswered_writes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "crash.db"
    queued: set[tuple[str, str]] = set()
    answered: dict[tuple[str, str], str] = {}
    stalled = 0
    with anyio.fail_after(30):
        async with await anyio.open_process(
            [sys.executable, str(CHILD), str(path), str(SESSIONS)], cwd=ROOT
        ) as child:
            assert child.stdout is not None
            buffer = ""
            async for chunk in TextReceiveStream(child.stdout):
                buffer += chunk
                *lines, buffer = buffer.split("\n")
                for line in lines:
                    kind, *rest = line.split()
                    if kind == "queued":
                        queued.add((rest[0], rest[1]))
                    elif kind == "answered":
                        answered[rest[0], rest[1]] = rest[2]
                    else:
                        assert kind == "writing"
                        stalled = int(rest[0])
                if stalled:
                    break
            child.send_signal(signal.SIGKILL)
            assert await child.wait() == -signal.SIGKILL

    assert stalled > 1  # the killed transaction held several writes
    unanswered = queued - answered.keys()
    assert len(unanswered) >= stalled  # the stalled batch, and whatever queued behind it
    assert len(answered) > 3  # batches committed before it, not only the lone writes

    async with SqliteStore.open(path) as store:
        for (sid, key), message_id in answered.items():
            assert message_id == f"m-{sid}-{key}"
            assert await store.find_key(sid, key) == KeyRecord(message_id, None)
        for sid, key in unanswered:
            assert await store.find_key(sid, key) is None
        for n in range(SESSIONS):
            sid = f"s{n}"
            entries = await store.read_timeline(sid)
            # exactly the answered messages, at seq 1..k
            mine = sorted(message_id for (s, _), message_id in answered.items() if s == sid)
            assert sorted(e.message_id or "" for e in entries) == mine
            assert [e.seq for e in entries] == list(range(1, len(entries) + 1))
    with sqlite3.connect(path) as raw:  # no message without its key, no key without message
        rows = raw.execute(
            "SELECT s.session_id, t.message_id, t.idempotency_key"
            " FROM timeline AS t JOIN sessions AS s ON s.number = t.session"
        ).fetchall()
    assert {(sid, key) for sid, _, key in rows} == set(answered)
    assert all(mid == f"m-{sid}-{key}" for sid, mid, key in rows)
