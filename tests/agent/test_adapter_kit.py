"""`AdapterKeys` and `derive_message_id`, over a fake runtime that owns the session store."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

import anyio
import pytest

from acp_once.agent.adapter import MESSAGE_ID_NAMESPACE, AdapterKeys, derive_message_id

pytestmark = pytest.mark.anyio


class RuntimeDown(Exception):
    pass


class FakeRuntime:
    """A runtime storing user-message ids per session. It outlives any `AdapterKeys`, so a new
    `AdapterKeys` over the same runtime is an adapter restart."""

    def __init__(self) -> None:
        self.sessions: dict[str, list[str]] = {}
        self.submits: list[tuple[str, str]] = []
        self.loads: list[str] = []
        self.gate = anyio.Event()
        self.gate.set()
        self.history_gate = anyio.Event()
        self.history_gate.set()
        self.fail: Exception | None = None
        self.fail_history: Exception | None = None

    def submitter(self, session_id: str) -> Callable[[str], Awaitable[None]]:
        async def submit(message_id: str) -> None:
            self.submits.append((session_id, message_id))
            await self.gate.wait()
            if self.fail is not None:
                raise self.fail
            self.sessions.setdefault(session_id, []).append(message_id)

        return submit

    async def history(self, session_id: str) -> list[str]:
        self.loads.append(session_id)
        snapshot = list(self.sessions.get(session_id, []))  # read now, answered at the gate
        await self.history_gate.wait()
        if self.fail_history is not None:
            raise self.fail_history
        return snapshot

    def fork(self, source: str, target: str) -> None:
        self.sessions[target] = list(self.sessions.get(source, []))


async def prompt(keys: AdapterKeys, runtime: FakeRuntime, session_id: str, key: str | None) -> str:
    return await keys.submit(
        session_id, key, runtime.submitter(session_id), load_history_ids=runtime.history
    )


def test_derivation_is_stable_and_scoped_to_session_and_exact_key() -> None:
    recipe = uuid.uuid5(uuid.NAMESPACE_URL, "urn:acp-once:adapter-message-id")
    assert recipe == MESSAGE_ID_NAMESPACE
    # a fixed vector: adapters in other languages can check they derive the same ids
    assert derive_message_id("sess_1", "k-1") == "1702506a-a8fa-5cf3-b23c-bc3374f2fa95"
    derived = derive_message_id("sess_1", "k-1")
    assert uuid.UUID(derived).version == 5
    assert derive_message_id("sess_1", "k-1") == derived
    assert derive_message_id("sess_2", "k-1") != derived
    assert derive_message_id("sess_1", "K-1") != derived
    assert derive_message_id("sess_1", "k-1 ") != derived
    # the parts are separated: moving characters between session id and key changes the id
    assert derive_message_id("ab", "c") != derive_message_id("a", "bc")


def test_derivation_refuses_no_key_and_ambiguous_session_ids() -> None:
    with pytest.raises(ValueError):
        derive_message_id("sess_1", "")
    with pytest.raises(ValueError):
        derive_message_id("a\0b", "c")  # would collide with ("a", "b\0c")
    assert derive_message_id("a", "b\0c")  # a key may contain anything


async def test_retry_in_the_same_process_does_not_call_the_runtime() -> None:
    runtime = FakeRuntime()
    keys = AdapterKeys()
    first = await prompt(keys, runtime, "s", "k")
    assert first == derive_message_id("s", "k")
    assert await prompt(keys, runtime, "s", "k") == first
    assert runtime.submits == [("s", first)]
    assert runtime.sessions["s"] == [first]


async def test_prompts_without_a_key_get_random_ids_and_no_lookup() -> None:
    runtime = FakeRuntime()
    keys = AdapterKeys()
    a = await prompt(keys, runtime, "s", None)
    b = await prompt(keys, runtime, "s", None)
    assert a != b and uuid.UUID(a).version == 4 and uuid.UUID(b).version == 4
    assert runtime.sessions["s"] == [a, b]
    assert runtime.loads == []
    # a later keyed prompt still reads the history: the key-less inserts did not fake a cache
    await prompt(keys, runtime, "s", "k")
    assert runtime.loads == ["s"]


async def test_the_same_key_in_another_session_or_a_fork_is_a_new_prompt() -> None:
    runtime = FakeRuntime()
    keys = AdapterKeys()
    original = await prompt(keys, runtime, "s", "k")
    runtime.fork("s", "fork")  # the fork copies the history, with the derived id
    in_fork = await prompt(keys, runtime, "fork", "k")
    elsewhere = await prompt(keys, runtime, "other", "k")
    assert len({original, in_fork, elsewhere}) == 3
    assert runtime.sessions["fork"] == [original, in_fork]
    assert len(runtime.submits) == 3


async def test_after_a_restart_the_cache_is_filled_once_and_the_retry_answered() -> None:
    runtime = FakeRuntime()
    first = await prompt(AdapterKeys(), runtime, "s", "k")
    runtime.loads.clear()
    restarted = AdapterKeys()
    assert await prompt(restarted, runtime, "s", "k") == first
    assert runtime.loads == ["s"]
    assert runtime.submits == [("s", first)]
    assert runtime.sessions["s"] == [first]
    assert await prompt(restarted, runtime, "s", "k") == first
    assert runtime.loads == ["s"]


async def test_one_history_read_per_session_however_many_keyed_prompts() -> None:
    runtime = FakeRuntime()
    for i in range(3):
        await prompt(AdapterKeys(), runtime, "s", f"old{i}")
    runtime.loads.clear()
    keys = AdapterKeys()
    ids = [await prompt(keys, runtime, "s", f"new{i}") for i in range(20)]
    ids += [await prompt(keys, runtime, "s", f"old{i}") for i in range(3)]
    ids += [await prompt(keys, runtime, "s", f"new{i}") for i in range(20)]
    await prompt(keys, runtime, "t", "k")
    await prompt(keys, runtime, "t", "k2")
    assert runtime.loads == ["s", "t"]
    assert len(runtime.sessions["s"]) == 23  # 3 old, 20 new, no retry submitted
    assert ids[23:] == ids[:20]


async def test_concurrent_first_prompts_share_one_history_read() -> None:
    runtime = FakeRuntime()
    runtime.history_gate = anyio.Event()
    keys = AdapterKeys()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(prompt, keys, runtime, "s", f"k{i}")
            await anyio.wait_all_tasks_blocked()
            assert runtime.loads == ["s"]
            runtime.history_gate.set()
    assert runtime.loads == ["s"]
    assert len(runtime.sessions["s"]) == 5


async def test_a_client_replay_fills_the_cache() -> None:
    runtime = FakeRuntime()
    first = await prompt(AdapterKeys(), runtime, "s", "k")
    runtime.loads.clear()
    restarted = AdapterKeys()
    restarted.note_history("s", runtime.sessions["s"])  # read for session/resume's replay
    assert await prompt(restarted, runtime, "s", "k") == first
    assert runtime.loads == []
    assert runtime.submits == [("s", first)]


async def test_concurrent_requests_with_one_new_key_submit_once() -> None:
    runtime = FakeRuntime()
    runtime.gate = anyio.Event()
    keys = AdapterKeys()
    outcomes: list[str] = []

    async def one() -> None:
        outcomes.append(await prompt(keys, runtime, "s", "k"))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(one)
            await anyio.wait_all_tasks_blocked()
            runtime.gate.set()
    assert len(runtime.submits) == 1
    assert outcomes == [derive_message_id("s", "k")] * 10
    assert runtime.sessions["s"] == [outcomes[0]]


async def test_an_error_is_shared_by_waiting_requests_and_leaves_the_key_unused() -> None:
    runtime = FakeRuntime()
    runtime.gate = anyio.Event()
    runtime.fail = RuntimeDown()
    keys = AdapterKeys()
    outcomes: list[object] = []

    async def one() -> None:
        try:
            outcomes.append(await prompt(keys, runtime, "s", "k"))
        except RuntimeDown as exc:
            outcomes.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(one)
            await anyio.wait_all_tasks_blocked()
            runtime.gate.set()
    assert len(runtime.submits) == 1
    assert outcomes == [runtime.fail] * 5
    assert "s" not in runtime.sessions
    runtime.fail = None
    message_id = await prompt(keys, runtime, "s", "k")
    assert runtime.sessions["s"] == [message_id]
    assert len(runtime.submits) == 2


async def test_a_failed_history_read_is_read_again_next_time() -> None:
    runtime = FakeRuntime()
    runtime.fail_history = RuntimeDown()
    keys = AdapterKeys()
    with pytest.raises(RuntimeDown):
        await prompt(keys, runtime, "s", "k")
    assert runtime.submits == []
    runtime.fail_history = None
    await prompt(keys, runtime, "s", "k")
    assert runtime.loads == ["s", "s"]
    assert len(runtime.submits) == 1


async def test_a_cancelled_submit_is_looked_up_again_in_the_history() -> None:
    runtime = FakeRuntime()
    keys = AdapterKeys()
    await prompt(keys, runtime, "s", "before")
    stored = anyio.Event()

    async def stores_then_hangs(message_id: str) -> None:
        runtime.sessions["s"].append(message_id)  # the runtime took it; the answer is lost
        stored.set()
        await anyio.sleep_forever()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def cut_short() -> None:
                await keys.submit("s", "k", stores_then_hangs, load_history_ids=runtime.history)

            tg.start_soon(cut_short)
            await stored.wait()
            tg.cancel_scope.cancel()
    assert await prompt(keys, runtime, "s", "k") == derive_message_id("s", "k")
    assert runtime.loads == ["s", "s"]  # the uncertain outcome dropped the cache
    assert runtime.sessions["s"].count(derive_message_id("s", "k")) == 1


async def test_a_prompt_submitted_while_the_history_is_read_is_in_the_cache() -> None:
    runtime = FakeRuntime()
    keys = AdapterKeys()
    await prompt(keys, runtime, "s", "first")
    runtime.gate = anyio.Event()
    runtime.history_gate = anyio.Event()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(prompt, keys, runtime, "s", "c")  # taken, not yet stored
            await anyio.wait_all_tasks_blocked()
            keys.forget_session("s")
            tg.start_soon(prompt, keys, runtime, "s", "d")  # its read misses "c"
            await anyio.wait_all_tasks_blocked()
            assert runtime.loads == ["s", "s"]
            runtime.gate.set()  # "c" is stored and answered while the read is out
            await anyio.wait_all_tasks_blocked()
            runtime.history_gate.set()
    submitted = len(runtime.submits)
    assert await prompt(keys, runtime, "s", "c") == derive_message_id("s", "c")
    assert len(runtime.submits) == submitted
    assert runtime.sessions["s"].count(derive_message_id("s", "c")) == 1


async def test_forget_session_reads_the_history_again() -> None:
    runtime = FakeRuntime()
    keys = AdapterKeys()
    first = await prompt(keys, runtime, "s", "k")
    keys.forget_session("s")
    assert await prompt(keys, runtime, "s", "k") == first
    assert runtime.loads == ["s", "s"]
    assert len(runtime.submits) == 1


async def test_live_keys_are_remembered_while_the_session_is_active() -> None:
    runtime = FakeRuntime()
    keys = AdapterKeys()
    runs: list[tuple[str, str]] = []

    def command(session_id: str) -> Callable[[str], Awaitable[None]]:
        async def run(message_id: str) -> None:
            runs.append((session_id, message_id))

        return run

    first = await keys.submit_live("s", "k", command("s"))
    assert await keys.submit_live("s", "k", command("s")) == first
    other = await keys.submit_live("t", "k", command("t"))
    assert runs == [("s", first), ("t", other)]
    # never stored by the runtime, never looked up there
    assert runtime.sessions == {} and runtime.loads == []

    keys.session_inactive("s")
    again = await keys.submit_live("s", "k", command("s"))
    assert again != first and runs[-1] == ("s", again)
    assert await keys.submit_live("t", "k", command("t")) == other  # t is still active
    assert len(runs) == 3


async def test_live_commands_without_a_key_always_run_and_errors_leave_the_key_unused() -> None:
    keys = AdapterKeys()
    runs: list[str] = []
    failing = True

    async def run(message_id: str) -> None:
        if failing:
            raise RuntimeDown()
        runs.append(message_id)

    with pytest.raises(RuntimeDown):
        await keys.submit_live("s", "k", run)
    failing = False
    first = await keys.submit_live("s", "k", run)
    assert runs == [first]
    a = await keys.submit_live("s", None, run)
    b = await keys.submit_live("s", None, run)
    assert a != b and runs == [first, a, b]


async def test_one_key_pending_in_two_sessions_submits_in_each() -> None:
    """Keys are scoped per session (RFD). Trace: session a's first prompt with key k is being
    submitted (the runtime holds it at the gate) when session b's first prompt with the same
    key arrives. Property: b does not join a's pending submit nor get a's id: the runtime gets
    one submit per session, each with its session's derived id."""
    runtime = FakeRuntime()
    runtime.gate = anyio.Event()
    keys = AdapterKeys()
    answers: dict[str, str] = {}

    async def one(session_id: str) -> None:
        answers[session_id] = await prompt(keys, runtime, session_id, "k")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "a")
            await anyio.wait_all_tasks_blocked()
            assert runtime.submits == [("a", derive_message_id("a", "k"))]
            tg.start_soon(one, "b")
            await anyio.wait_all_tasks_blocked()
            runtime.gate.set()
    assert answers == {sid: derive_message_id(sid, "k") for sid in ("a", "b")}
    assert sorted(runtime.submits) == sorted(answers.items())
    assert runtime.sessions == {sid: [answers[sid]] for sid in ("a", "b")}
