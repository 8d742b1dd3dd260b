"""The LangGraph adapter: what the key cache costs for a short and a long thread.

    python3 dev.py run python benchmarks/bench_langgraph.py [--sizes 10,10000] [--rounds R]
                                                         [--later K] [--no-stdio]

For each size, a LangGraph SQLite checkpointer file holds one session whose thread has SIZE
messages (half keyed user messages with their derived ids, half answers), written in one
checkpoint. Then:

1. Store level (`LangGraphStore`, in this process), R rounds, each on a new store object (a
   restart: the key cache is empty):
   - the first keyed prompt after the restart (`insert_user_message` with a fresh key: reads
     the thread's user-message ids once, then stores the message);
   - K later keyed prompts with fresh keys (the cache is filled: a set lookup, then the write);
   - K retries of a key stored before the restart (answered from the cache, nothing written);
   - K unkeyed prompts (the write alone), and one read of the thread (what the fill reads).
2. Over stdio (`python -m acp_once agent --runtime langgraph`), one round: resume the session,
   then the first keyed prompt, K later keyed prompts and K retries, each awaited to its answer
   (and each new prompt's turn to its idle state before the next is sent).

Figures are medians (the first-prompt figure: the median over rounds). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import orjson
from langchain_core.messages import AIMessage, HumanMessage
from rich.console import Console
from rich.table import Table

from acp_once.adapters.langgraph import LangGraphStore
from acp_once.agent.adapter import derive_message_id
from acp_once.client import Client, ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.storage.base import SessionRecord
from acp_once.transports.stdio import spawn

SESSION = "sess_bench"
OLD_KEY = "key-0"


def _update(text: str) -> bytes:
    content = [{"type": "text", "text": text}]
    return orjson.dumps({"sessionUpdate": "user_message", "messageId": "m", "content": content})


async def build(path: Path, size: int) -> None:
    """One session whose thread holds `size` messages, in one checkpoint."""
    async with LangGraphStore.open(f"sqlite:{path}") as store:
        now = time.time()
        await store.create_session(SessionRecord(SESSION, "/tmp/bench", (), None, now, now))
        messages: list[Any] = []
        events: list[dict[str, Any]] = []
        for i in range(size // 2):
            text: list[str | dict[Any, Any]] = [{"type": "text", "text": f"prompt {i}"}]
            message_id = derive_message_id(SESSION, f"key-{i}")
            messages.append(HumanMessage(id=message_id, content=text))
            messages.append(AIMessage(id=f"msg_agent_{i}", content=f"prompt {i}"))
            # the runtime's "turn finished" marker, as the adapter stores it after each turn
            marker = {"sessionUpdate": "_acp_once_turn", "state": "idle", "messageId": message_id}
            events.append({"at": len(messages), "update": marker, "messageId": message_id})
        config: Any = {"configurable": {"thread_id": SESSION}}
        values = {"messages": messages, "events": events}
        await store.graph.aupdate_state(config, values, as_node="respond")


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await fn()
    return time.perf_counter() - started


async def store_round(path: Path, later: int) -> dict[str, float]:
    async with LangGraphStore.open(f"sqlite:{path}") as store:  # a restart: empty cache

        def insert(key: str | None) -> Callable[[], Awaitable[Any]]:
            return lambda: store.insert_user_message(
                SESSION,
                message_id=f"msg_user_{uuid.uuid4().hex}",
                update=_update("bench"),
                idempotency_key=key,
                prompt_digest=None,
            )

        first = await timed(insert(f"fresh-{uuid.uuid4()}"))
        reads = store.history_reads[SESSION]
        keyed = [await timed(insert(f"fresh-{uuid.uuid4()}")) for _ in range(later)]
        retries = [await timed(insert(OLD_KEY)) for _ in range(later)]
        unkeyed = [await timed(insert(None)) for _ in range(later)]
        read = await timed(lambda: store.thread_messages(SESSION))
        assert store.history_reads[SESSION] == reads == 1, "the cache was filled more than once"
        return {
            "first": first,
            "later": statistics.median(keyed),
            "retry": statistics.median(retries),
            "unkeyed": statistics.median(unkeyed),
            "read": read,
        }


class Recorder(Client):
    """Counts finished turns (idle state updates with `stopReason: "end_turn"`)."""

    def __init__(self) -> None:
        self.ended = 0
        self._changed = anyio.Event()

    async def session_update(self, params: s.UpdateSessionNotification) -> None:
        update = params.model_dump(by_alias=True, exclude_unset=True)["update"]
        if update.get("stopReason") == "end_turn":
            self.ended += 1
            self._changed.set()
            self._changed = anyio.Event()

    async def wait_ended(self, count: int) -> None:
        while self.ended < count:
            await self._changed.wait()


async def stdio_round(path: Path, later: int, tmp: Path) -> dict[str, float]:
    command = [
        sys.executable,
        "-m",
        "acp_once",
        "agent",
        "--runtime",
        "langgraph",
        "--store",
        f"sqlite:{path}",
        "--side-effects",
        str(tmp / "effects"),
    ]
    recorder = Recorder()
    async with (
        spawn(command) as proc,
        ClientSideConnection(recorder, proc.frames) as conn,
    ):
        await conn.agent.initialize(
            s.InitializeRequest.model_validate(
                {"protocolVersion": 2, "info": {"name": "bench", "version": "1"}}
            )
        )
        resume = await timed(
            lambda: conn.agent.resume_session(
                s.ResumeSessionRequest(session_id=SESSION, cwd="/tmp/bench")
            )
        )

        def prompt(key: str) -> Callable[[], Awaitable[Any]]:
            params = {
                "sessionId": SESSION,
                "prompt": [{"type": "text", "text": "bench"}],
                "idempotencyKey": key,
            }
            return lambda: conn.rpc.request("session/prompt", params)

        first = await timed(prompt(f"fresh-{uuid.uuid4()}"))
        await recorder.wait_ended(1)
        keyed: list[float] = []
        for i in range(later):
            keyed.append(await timed(prompt(f"fresh-{uuid.uuid4()}")))
            await recorder.wait_ended(i + 2)  # its turn ended: the next prompt is not held
        retries = [await timed(prompt(OLD_KEY)) for _ in range(later)]
        return {
            "resume": resume,
            "first": first,
            "later": statistics.median(keyed),
            "retry": statistics.median(retries),
        }


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.2f}"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default="10,10000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--later", type=int, default=10)
    parser.add_argument("--no-stdio", action="store_true")
    args = parser.parse_args()
    console = Console()
    console.print(f"load average at start: {os.getloadavg()}")
    store_table = Table(title="store level (ms, medians)")
    for column in (
        "messages",
        "first keyed after restart",
        "later keyed",
        "retry",
        "unkeyed",
        "thread read",
    ):
        store_table.add_column(column, justify="right")
    stdio_table = Table(title="over stdio (ms)")
    for column in ("messages", "resume", "first keyed after restart", "later keyed", "retry"):
        stdio_table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for size in (int(x) for x in args.sizes.split(",")):
            path = tmp / f"threads-{size}.sqlite3"
            await build(path, size)
            rounds = [await store_round(path, args.later) for _ in range(args.rounds)]

            def med(name: str, rounds: list[dict[str, float]] = rounds) -> str:
                return ms(statistics.median(r[name] for r in rounds))

            store_table.add_row(
                f"{size:,}", med("first"), med("later"), med("retry"), med("unkeyed"), med("read")
            )
            if not args.no_stdio:
                # a fresh copy: the store rounds left messages without turns, which a resume
                # would close one by one
                fresh = tmp / f"threads-{size}-stdio.sqlite3"
                await build(fresh, size)
                with anyio.fail_after(600):
                    row = await stdio_round(fresh, args.later, tmp)
                stdio_table.add_row(
                    f"{size:,}",
                    ms(row["resume"]),
                    ms(row["first"]),
                    ms(row["later"]),
                    ms(row["retry"]),
                )
    console.print(store_table)
    if not args.no_stdio:
        console.print(stdio_table)
    console.print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    anyio.run(main)
