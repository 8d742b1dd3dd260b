"""`PromptKeys`, the key table for agents with their own storage."""

from __future__ import annotations

import itertools

import anyio
import pytest

from acp_once.agent.keys import PromptKeys
from acp_once.protocol.errors import AuthRequired

pytestmark = pytest.mark.anyio


class FakeStore:
    def __init__(self) -> None:
        self.messages: dict[tuple[str, str | None], list[str]] = {}
        self.keys: dict[tuple[str, str], str] = {}
        self.ids = itertools.count(1)
        self.gate = anyio.Event()
        self.gate.set()

    async def insert(self, session_id: str, key: str | None) -> str:
        await self.gate.wait()
        message_id = f"m{next(self.ids)}"
        self.messages.setdefault((session_id, key), []).append(message_id)
        if key is not None:
            self.keys[(session_id, key)] = message_id
        return message_id

    async def lookup(self, session_id: str, key: str) -> str | None:
        return self.keys.get((session_id, key))


async def test_recorded_key_answers_without_inserting() -> None:
    store = FakeStore()
    keys = PromptKeys(lookup=store.lookup)
    first = await keys.submit("s", "k", lambda: store.insert("s", "k"))
    assert await keys.submit("s", "k", lambda: store.insert("s", "k")) == first
    assert await keys.submit("other", "k", lambda: store.insert("other", "k")) != first
    assert await keys.submit("s", None, lambda: store.insert("s", None)) != first
    assert store.messages[("s", "k")] == [first]


async def test_restart_finds_the_key_through_lookup() -> None:
    store = FakeStore()
    first = await PromptKeys(lookup=store.lookup).submit("s", "k", lambda: store.insert("s", "k"))
    again = await PromptKeys(lookup=store.lookup).submit("s", "k", lambda: store.insert("s", "k"))
    assert again == first
    assert len(store.messages[("s", "k")]) == 1


async def test_concurrent_requests_share_one_insert_and_its_error() -> None:
    store = FakeStore()
    store.gate = anyio.Event()
    keys = PromptKeys(lookup=store.lookup)
    calls = 0
    outcomes: list[object] = []

    async def failing() -> str:
        nonlocal calls
        calls += 1
        await store.gate.wait()
        raise AuthRequired()

    async def one() -> None:
        try:
            outcomes.append(await keys.submit("s", "k", failing))
        except AuthRequired as exc:
            outcomes.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(one)
            await anyio.wait_all_tasks_blocked()
            store.gate.set()
    assert calls == 1
    assert len(outcomes) == 10 and all(isinstance(o, AuthRequired) for o in outcomes)
    # the error left the key unused: the next attempt inserts
    message_id = await keys.submit("s", "k", lambda: store.insert("s", "k"))
    assert store.keys[("s", "k")] == message_id


async def test_cache_is_bounded_and_lookup_stays_the_record() -> None:
    store = FakeStore()
    keys = PromptKeys(lookup=store.lookup, cache_size=2)
    ids = []
    for i in range(5):
        key = f"k{i}"

        async def insert(key: str = key) -> str:
            return await store.insert("s", key)

        ids.append(await keys.submit("s", key, insert))
    assert len(keys._recorded) == 2
    assert await keys.submit("s", "k0", lambda: store.insert("s", "k0")) == ids[0]
    assert len(store.messages[("s", "k0")]) == 1


async def test_one_key_in_two_sessions_inserts_in_each() -> None:
    """Keys are scoped per session (RFD). Trace: session a's first request with key k is
    pending (its insert waits at the gate) when session b's first request with the same key
    arrives; then both again, one after the other. Property: b does not join a's pending
    insert nor get its answer: two inserts, two different message ids, one per session, and
    each retry answers its own session's id."""
    store = FakeStore()
    store.gate = anyio.Event()
    keys = PromptKeys(lookup=store.lookup)
    answers: dict[str, str] = {}

    async def first(session_id: str) -> None:
        answers[session_id] = await keys.submit(
            session_id, "k", lambda: store.insert(session_id, "k")
        )

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first, "a")
            await anyio.wait_all_tasks_blocked()  # a's insert waits at the gate
            tg.start_soon(first, "b")
            await anyio.wait_all_tasks_blocked()
            store.gate.set()
        assert store.messages == {("a", "k"): [answers["a"]], ("b", "k"): [answers["b"]]}
        assert answers["a"] != answers["b"]
        for sid in ("a", "b"):  # retries: each session's own id, nothing inserted
            assert await keys.submit(sid, "k", lambda: store.insert("x", "k")) == answers[sid]
        # a third session, sequentially, gets a message of its own too
        third = await keys.submit("c", "k", lambda: store.insert("c", "k"))
    assert third not in answers.values()
    assert store.messages[("c", "k")] == [third] and ("x", "k") not in store.messages
