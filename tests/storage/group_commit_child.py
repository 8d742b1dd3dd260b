"""The process `test_group_commit_crash.py` kills: writes to a SQLite store with group commit,
and stalls (forever) inside its third batch of several writes, after the batch's statements
and before its COMMIT, once it has said so on stdout.

    python tests/storage/group_commit_child.py DB_PATH SESSIONS

Lines on stdout, each flushed: `queued SID KEY` before a caller's insert, `answered SID KEY MID`
when the caller has its outcome, `writing N` when the stalled batch of N writes is ready to
commit.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

import anyio

from acp_once.storage import SessionRecord, SqliteStore
from acp_once.storage.sqlite import store as sqlite_store
from acp_once.storage.sqlite import writes as sqlite_writes

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from acp_once.support.sqlite import Connection

STALL_AT = 3
"""The batch of several writes that never commits (the earlier ones do)."""


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def stall_before_commit() -> None:
    """Wrap the store's batch writer: its STALL_AT-th batch blocks after its last write."""
    write_together = sqlite_writes.write_together
    calls = 0

    def stalling(
        conn: Connection,
        works: Sequence[Callable[[Connection], object]],
        path: str,
        tails: Any,  # the store's remembered session tails
    ) -> list[tuple[bool, object]]:
        nonlocal calls
        calls += 1
        if calls != STALL_AT:
            return write_together(conn, works, path, tails)
        *first, last = works

        def last_then_stall(conn: Connection) -> object:
            result = last(conn)
            say(f"writing {len(works)}")
            threading.Event().wait()  # until SIGKILL: the COMMIT is never sent
            return result

        return write_together(conn, [*first, last_then_stall], path, tails)

    vars(sqlite_store)["write_together"] = stalling  # what the store calls


async def main(path: str, sessions: int) -> None:
    stall_before_commit()
    async with SqliteStore.open(path) as store:
        for n in range(sessions):
            await store.create_session(SessionRecord(f"s{n}", "/w", (), None, 1.0, 1.0))

        async def insert(sid: str, key: str) -> None:
            say(f"queued {sid} {key}")
            outcome = await store.insert_user_message(
                sid,
                message_id=f"m-{sid}-{key}",
                update=b'{"sessionUpdate": "user_message"}',
                idempotency_key=key,
                prompt_digest=None,
            )
            say(f"answered {sid} {key} {outcome.message_id}")

        for n in range(3):  # alone, one at a time
            await insert("s0", f"alone{n}")

        async def client(sid: str) -> None:
            for n in range(4):
                await insert(sid, f"k{n}")

        async with anyio.create_task_group() as tg:
            for n in range(sessions):
                tg.start_soon(client, f"s{n}")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], int(sys.argv[2]))
