"""The backend-agnostic `Outbox` contract, shipped so every backend runs the same suite.

Each check is a plain coroutine function taking an *outbox factory*: a zero-argument callable
returning an async context manager that opens an outbox on fresh, empty storage and closes it
(`MemoryOutbox`, `lambda: SqliteOutbox.open(new_file())`, ...). A check raises
`ContractViolation` (an AssertionError) when the backend breaks the contract.

With pytest (see tests/client/test_outbox.py)::

    @pytest.mark.anyio
    @pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
    async def test_contract(check: Check, outbox_factory: OutboxFactory) -> None:
        await check(outbox_factory)

Without pytest: `failures = await run_contract(factory)`; an empty list means it passed.

The checks assume that the outbox's clock is the real time.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import Final, TypeAlias

import anyio
import orjson

from acp_once.client.outbox.base import (
    KeyConflict,
    Outbox,
    OutboxError,
    Submission,
    SubmissionNotFound,
)
from acp_once.support.contract import ContractViolation, equal, expect, raises, run_checks

__all__ = ["CHECKS", "Check", "ContractViolation", "OutboxFactory", "run_contract"]

OutboxFactory: TypeAlias = Callable[[], AbstractAsyncContextManager[Outbox]]
"""Opens an outbox on fresh, empty storage for the duration of an `async with` block."""

Check: TypeAlias = Callable[[OutboxFactory], Awaitable[None]]


# -- helpers ------------------------------------------------------------------------------------


def _prompt(text: str) -> bytes:
    return orjson.dumps([{"type": "text", "text": text}])


def _ids(submissions: list[Submission]) -> list[str]:
    return [s.submission_id for s in submissions]


# -- adding -------------------------------------------------------------------------------------


async def check_add_then_read(factory: OutboxFactory) -> None:
    """`add` returns the stored record; `get` and `pending` return the same record."""
    async with factory() as outbox:
        prompt = _prompt("Run the database migration")
        added = await outbox.add("sess_a", prompt, idempotency_key="key-1", now=1234.5)
        equal(added.session_id, "sess_a", "session_id")
        equal(added.idempotency_key, "key-1", "idempotency_key")
        equal(added.prompt, prompt, "prompt")
        equal(added.created_at, 1234.5, "created_at")
        equal(added.attempts, 0, "attempts of a new submission")
        expect(len(added.submission_id) == 32, "submission_id must be uuid4 hex")
        equal(uuid.UUID(hex=added.submission_id).version, 4, "submission_id uuid version")
        equal(await outbox.get(added.submission_id), added, "get")
        equal(await outbox.pending(), [added], "pending()")
        equal(await outbox.pending("sess_a"), [added], "pending(session)")


async def check_add_makes_a_fresh_key_each_time(factory: OutboxFactory) -> None:
    """Without a key, each add gets a new UUIDv4 key, even for the same text (R8, R10, R12)."""
    async with factory() as outbox:
        first = await outbox.add("s", _prompt("again"))
        second = await outbox.add("s", _prompt("again"))
        expect(first.submission_id != second.submission_id, "two submissions share an id")
        expect(first.idempotency_key != second.idempotency_key, "two submissions share a key")
        for submission in (first, second):
            key = submission.idempotency_key
            equal(str(uuid.UUID(key)), key, "generated key must be a UUID string")
            equal(uuid.UUID(key).version, 4, "generated key UUID version")
        equal(_ids(await outbox.pending()), _ids([first, second]), "both pending")


async def check_created_at_defaults_to_now(factory: OutboxFactory) -> None:
    """Without `now`, `created_at` is the current time (seconds since the epoch)."""
    async with factory() as outbox:
        before = time.time()
        added = await outbox.add("s", _prompt("x"))
        after = time.time()
        expect(before <= added.created_at <= after, f"created_at {added.created_at} not now")


async def check_prompt_fidelity(factory: OutboxFactory) -> None:
    """The prompt comes back byte for byte, whatever it holds and however long."""
    async with factory() as outbox:
        prompts = [
            _prompt("héllo \u2603 \U0001f600 \x00 end"),
            b"\x00\xff\xfe not even JSON",
            _prompt("x" * (1 << 20)),
        ]
        added = [await outbox.add("s", p) for p in prompts]
        equal([s.prompt for s in await outbox.pending()], prompts, "prompts")
        equal([s.prompt for s in added], prompts, "returned prompts")


async def check_invalid_add_writes_nothing(factory: OutboxFactory) -> None:
    """An invalid key, session id, prompt or time is refused before anything is written."""
    async with factory() as outbox:
        long_key = "k" * 256
        for key in ("", long_key, "bad\ud800key"):
            exc = await raises(
                ValueError, outbox.add("s", _prompt("x"), idempotency_key=key), "invalid key"
            )
            expect(not key or key not in str(exc), "the error message contains the key")
        await raises(ValueError, outbox.add("", _prompt("x")), "empty session id")
        await raises(ValueError, outbox.add("s", _prompt("x"), now=float("nan")), "NaN now")
        not_bytes: object = "[]"
        await raises(TypeError, outbox.add("s", not_bytes), "str prompt")  # type: ignore[arg-type]
        equal(await outbox.pending(), [], "pending after refused adds")
        longest = await outbox.add("s", _prompt("x"), idempotency_key="k" * 255)
        equal(longest.idempotency_key, "k" * 255, "a 255-character key is valid")


# -- order --------------------------------------------------------------------------------------


async def check_seq_orders_across_sessions(factory: OutboxFactory) -> None:
    """`seq` increases strictly across sessions; `pending` lists in seq order."""
    async with factory() as outbox:
        added = [
            await outbox.add(session, _prompt(f"{session}{n}"))
            for n, session in enumerate(["b", "a", "b", "c", "a", "b"])
        ]
        seqs = [s.seq for s in added]
        expect(all(x < y for x, y in itertools.pairwise(seqs)), f"seq {seqs}")
        equal(_ids(await outbox.pending()), _ids(added), "pending() order")
        for session in ("a", "b", "c"):
            expected = [s for s in added if s.session_id == session]
            equal(await outbox.pending(session), expected, f"pending({session!r})")


async def check_seq_is_never_reused(factory: OutboxFactory) -> None:
    """Completing the newest submission does not let the next one reuse its `seq`."""
    async with factory() as outbox:
        first = await outbox.add("s", _prompt("1"))
        second = await outbox.add("s", _prompt("2"))
        await outbox.complete(second.submission_id)
        third = await outbox.add("s", _prompt("3"))
        expect(third.seq > second.seq > first.seq, "seq went back after a completion")
        equal(_ids(await outbox.pending()), _ids([first, third]), "pending")


async def check_concurrent_adds(factory: OutboxFactory) -> None:
    """Many tasks adding at once: every submission stored once, distinct seqs, in order."""
    async with factory() as outbox:
        added: list[Submission] = []

        async def add(n: int) -> None:
            added.append(await outbox.add(f"s{n % 4}", _prompt(f"p{n}")))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for n in range(40):
                    tg.start_soon(add, n)
        pending = await outbox.pending()
        equal(len(pending), 40, "pending count")
        equal({s.seq for s in pending}, {s.seq for s in added}, "seqs")
        equal(len({s.seq for s in pending}), 40, "distinct seqs")
        equal(pending, sorted(added, key=lambda s: s.seq), "pending order")
        equal(len(await outbox.pending("s3")), 10, "pending of one session")


# -- keys ---------------------------------------------------------------------------------------


async def check_same_key_and_prompt_is_one_submission(factory: OutboxFactory) -> None:
    """Adding a pending (session, key) again with the same prompt returns the pending one."""
    async with factory() as outbox:
        first = await outbox.add("s", _prompt("x"), idempotency_key="app-key", now=10.0)
        await outbox.record_attempt(first.submission_id)
        again = await outbox.add("s", _prompt("x"), idempotency_key="app-key", now=20.0)
        equal(again.submission_id, first.submission_id, "a replayed add made a new submission")
        equal(again.attempts, 1, "attempts of the returned submission")
        equal(again.created_at, 10.0, "created_at of the returned submission")
        equal(len(await outbox.pending()), 1, "pending count")


async def check_same_key_other_prompt_conflicts(factory: OutboxFactory) -> None:
    """One key never names two prompts (R13): KeyConflict, which never shows the key."""
    async with factory() as outbox:
        first = await outbox.add("s", _prompt("x"), idempotency_key="secret-key-42")
        exc = await raises(
            KeyConflict,
            outbox.add("s", _prompt("y"), idempotency_key="secret-key-42"),
            "same key, other prompt",
        )
        expect(isinstance(exc, ValueError), "KeyConflict must be a ValueError")
        expect("secret-key-42" not in str(exc), "KeyConflict message contains the key")
        expect(first.submission_id in str(exc), "KeyConflict should name the pending one")
        equal(await outbox.pending(), [first], "pending after the conflict")


async def check_key_is_scoped_to_the_session(factory: OutboxFactory) -> None:
    """The same key in another session is another submission (R32)."""
    async with factory() as outbox:
        in_a = await outbox.add("a", _prompt("x"), idempotency_key="k")
        in_b = await outbox.add("b", _prompt("y"), idempotency_key="k")
        expect(in_a.submission_id != in_b.submission_id, "one submission for two sessions")
        equal(await outbox.pending(), [in_a, in_b], "pending")


async def check_completed_key_can_be_added_again(factory: OutboxFactory) -> None:
    """The outbox forgets a completed submission's key: adding it again is a new one."""
    async with factory() as outbox:
        first = await outbox.add("s", _prompt("x"), idempotency_key="k")
        await outbox.complete(first.submission_id)
        second = await outbox.add("s", _prompt("other"), idempotency_key="k")
        expect(second.submission_id != first.submission_id, "the completed one came back")
        expect(second.seq > first.seq, "seq went back")
        equal(await outbox.pending(), [second], "pending")


async def check_key_stays_private(factory: OutboxFactory) -> None:
    """Neither the key nor the prompt appears in a record's repr or an error message."""
    async with factory() as outbox:
        key = "private-key-7f3a"
        added = await outbox.add("s", _prompt("private text"), idempotency_key=key)
        shown = repr(added) + str(added)
        expect(key not in shown, "the repr of a submission shows its key")
        expect("private text" not in shown, "the repr of a submission shows its prompt")
        expect(added.submission_id in shown, "the repr should name the submission")
        conflict = await raises(
            KeyConflict, outbox.add("s", _prompt("y"), idempotency_key=key), "conflict"
        )
        missing = await raises(SubmissionNotFound, outbox.record_attempt("nope"), "missing")
        for exc in (conflict, missing):
            expect(key not in str(exc) and key not in repr(exc), "an error shows the key")


# -- attempts and completion --------------------------------------------------------------------


async def check_record_attempt_counts(factory: OutboxFactory) -> None:
    """`record_attempt` adds one to `attempts` and changes nothing else."""
    async with factory() as outbox:
        added = await outbox.add("s", _prompt("x"))
        other = await outbox.add("s", _prompt("y"))
        for _ in range(3):
            await outbox.record_attempt(added.submission_id)
        got = await outbox.get(added.submission_id)
        expect(got is not None, "the submission vanished")
        assert got is not None
        equal(got.attempts, 3, "attempts")
        equal(got, replace(added, attempts=3), "the submission after three attempts")
        equal(await outbox.pending(), [got, other], "pending after attempts")


async def check_record_attempt_of_a_settled_submission(factory: OutboxFactory) -> None:
    """`record_attempt` on an unknown or completed submission raises SubmissionNotFound."""
    async with factory() as outbox:
        await raises(SubmissionNotFound, outbox.record_attempt("f" * 32), "unknown id")
        added = await outbox.add("s", _prompt("x"))
        await outbox.complete(added.submission_id)
        exc = await raises(
            SubmissionNotFound, outbox.record_attempt(added.submission_id), "completed id"
        )
        expect(isinstance(exc, OutboxError), "SubmissionNotFound must be an OutboxError")
        equal(getattr(exc, "submission_id", None), added.submission_id, "exc.submission_id")
        equal(await outbox.pending(), [], "pending")


async def check_complete_removes_once(factory: OutboxFactory) -> None:
    """`complete` removes the submission; completing again or an unknown id is a no-op."""
    async with factory() as outbox:
        first = await outbox.add("a", _prompt("1"))
        second = await outbox.add("b", _prompt("2"))
        third = await outbox.add("a", _prompt("3"))
        await outbox.complete(first.submission_id)
        await outbox.complete(first.submission_id)
        await outbox.complete("0" * 32)
        equal(await outbox.get(first.submission_id), None, "get of a completed submission")
        equal(await outbox.pending(), [second, third], "pending()")
        equal(await outbox.pending("a"), [third], "pending('a')")


async def check_reads_of_nothing(factory: OutboxFactory) -> None:
    """An empty outbox, an unknown session and an unknown id read as empty."""
    async with factory() as outbox:
        equal(await outbox.pending(), [], "pending() of an empty outbox")
        await outbox.add("s", _prompt("x"))
        equal(await outbox.pending("other"), [], "pending of an unknown session")
        equal(await outbox.get("0" * 32), None, "get of an unknown id")


# -- lifecycle ----------------------------------------------------------------------------------


async def check_is_an_outbox(factory: OutboxFactory) -> None:
    """The opened object satisfies the runtime-checkable `Outbox` protocol."""
    async with factory() as outbox:
        expect(isinstance(outbox, Outbox), f"{outbox!r} is not an Outbox")


async def check_cancelled_calls_do_nothing(factory: OutboxFactory) -> None:
    """A call made in an already-cancelled scope is cancelled before it changes anything."""
    async with factory() as outbox:
        kept = await outbox.add("s", _prompt("kept"))
        with anyio.CancelScope() as scope:
            scope.cancel()
            await outbox.add("s", _prompt("never"))
        expect(scope.cancelled_caught, "add in a cancelled scope was not cancelled")
        with anyio.CancelScope() as scope:
            scope.cancel()
            await outbox.record_attempt(kept.submission_id)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await outbox.complete(kept.submission_id)
        equal(await outbox.pending(), [kept], "pending after cancelled calls")


async def check_closed_outbox_refuses(factory: OutboxFactory) -> None:
    """After `aclose` (idempotent) every call raises OutboxError."""
    async with factory() as outbox:
        added = await outbox.add("s", _prompt("x"))
        await outbox.aclose()
        await outbox.aclose()
        sid = added.submission_id
        calls: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("add", lambda: outbox.add("s", _prompt("y"))),
            ("record_attempt", lambda: outbox.record_attempt(sid)),
            ("complete", lambda: outbox.complete(sid)),
            ("pending", lambda: outbox.pending()),
            ("get", lambda: outbox.get(sid)),
        ]
        for name, call in calls:
            await raises(OutboxError, call(), f"{name} after aclose")


CHECKS: Final[tuple[Check, ...]] = (
    check_add_then_read,
    check_add_makes_a_fresh_key_each_time,
    check_created_at_defaults_to_now,
    check_prompt_fidelity,
    check_invalid_add_writes_nothing,
    check_seq_orders_across_sessions,
    check_seq_is_never_reused,
    check_concurrent_adds,
    check_same_key_and_prompt_is_one_submission,
    check_same_key_other_prompt_conflicts,
    check_key_is_scoped_to_the_session,
    check_completed_key_can_be_added_again,
    check_key_stays_private,
    check_record_attempt_counts,
    check_record_attempt_of_a_settled_submission,
    check_complete_removes_once,
    check_reads_of_nothing,
    check_is_an_outbox,
    check_cancelled_calls_do_nothing,
    check_closed_outbox_refuses,
)
"""Every check of the contract, in a stable order."""


async def run_contract(factory: OutboxFactory) -> list[tuple[str, Exception]]:
    """Run every check against outboxes from `factory`; return the failures (name, error)."""
    return await run_checks(CHECKS, factory)
