"""The backend-agnostic `SessionStore` contract, shipped so every backend runs the same suite.

Each check is a plain coroutine function taking a *store factory*: a zero-argument callable
returning an async context manager that opens a store on fresh, empty storage and closes it
(`MemoryStore`, `lambda: SqliteStore.open(new_file())`, ...). A check raises
`ContractViolation` (an AssertionError) when the backend breaks the contract.

With pytest (see tests/storage/test_contract.py)::

    @pytest.mark.anyio
    @pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
    async def test_contract(check: Check, store_factory: StoreFactory) -> None:
        await check(store_factory)

Without pytest: `failures = await run_contract(factory)`; an empty list means it passed.

A durable backend also runs `DURABLE_CHECKS` with a *shared-storage factory*: each call opens a
store on one and the same storage (empty at the first call), so that a check can close a store
and open the storage again, or hold two stores on it at once (two processes on one file, two
nodes on one database). `run_durable_contract(new_storage)` runs them without pytest.

The checks assume that the store's clock is the real time (stores bump `updated_at` to "now"
on timeline writes); the records they create use small `updated_at` values.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Final, TypeAlias

import anyio
import anyio.lowlevel
import orjson

from acp_once.storage.base import (
    ANY_TENANT,
    UNCHANGED,
    AnyTenant,
    InsertOutcome,
    InvalidCursor,
    KeyRecord,
    SessionExists,
    SessionMissing,
    SessionRecord,
    SessionStore,
    StorageError,
    TimelineEntry,
    encode_cursor,
)
from acp_once.support.contract import ContractViolation, equal, expect, raises, run_checks

__all__ = [
    "CHECKS",
    "DURABLE_CHECKS",
    "Check",
    "ContractViolation",
    "StoreFactory",
    "run_contract",
    "run_durable_contract",
]

StoreFactory: TypeAlias = Callable[[], AbstractAsyncContextManager[SessionStore]]
"""Opens a store on fresh, empty storage for the duration of an `async with` block."""

Check: TypeAlias = Callable[[StoreFactory], Awaitable[None]]


# -- helpers ------------------------------------------------------------------------------------


def _session(
    session_id: str,
    *,
    cwd: str = "/work/project",
    updated_at: float = 100.0,
    title: str | None = None,
    dirs: tuple[str, ...] = (),
    forked_from: str | None = None,
    tenant: str | None = None,
) -> SessionRecord:
    return SessionRecord(
        session_id=session_id,
        cwd=cwd,
        additional_directories=dirs,
        title=title,
        created_at=50.0,
        updated_at=updated_at,
        forked_from=forked_from,
        tenant=tenant,
    )


def _user_update(message_id: str, text: str) -> bytes:
    return orjson.dumps(
        {
            "sessionUpdate": "user_message",
            "messageId": message_id,
            "content": [{"type": "text", "text": text}],
        }
    )


def _agent_update(message_id: str, text: str) -> bytes:
    return orjson.dumps(
        {
            "sessionUpdate": "agent_message",
            "messageId": message_id,
            "content": [{"type": "text", "text": text}],
        }
    )


async def _insert(
    store: SessionStore,
    session_id: str,
    message_id: str,
    key: str | None,
    digest: bytes | None = None,
    text: str = "hello",
) -> InsertOutcome:
    return await store.insert_user_message(
        session_id,
        message_id=message_id,
        update=_user_update(message_id, text),
        idempotency_key=key,
        prompt_digest=digest,
    )


async def _all_sessions(
    store: SessionStore,
    *,
    cwd: str | None = None,
    limit: int = 100,
    tenant: str | AnyTenant | None = ANY_TENANT,
) -> list[SessionRecord]:
    records: list[SessionRecord] = []
    cursor: str | None = None
    for _ in range(10_000):
        page, cursor = await store.list_sessions(cwd=cwd, cursor=cursor, limit=limit, tenant=tenant)
        expect(len(page) <= limit, f"a page holds {len(page)} records, more than limit={limit}")
        records.extend(page)
        if cursor is None:
            return records
        expect(bool(page), "a page with a next cursor must not be empty")
    raise ContractViolation("list_sessions paging does not end")


async def _all_entries(store: SessionStore, session_id: str, limit: int) -> list[TimelineEntry]:
    entries: list[TimelineEntry] = []
    after = 0
    while True:
        page = await store.read_timeline(session_id, after_seq=after, limit=limit)
        expect(len(page) <= limit, f"read_timeline returned more than limit={limit}")
        if not page:
            return entries
        entries.extend(page)
        after = page[-1].seq


# -- sessions -----------------------------------------------------------------------------------


async def check_create_and_get(factory: StoreFactory) -> None:
    """A created session reads back equal; a duplicate id is refused; unknown ids are None."""
    async with factory() as store:
        record = _session(
            "sess_a", title="Fix the build", dirs=("/work/lib", "/work/docs"), forked_from=None
        )
        await store.create_session(record)
        equal(await store.get_session("sess_a"), record, "get_session after create")
        equal(await store.get_session("sess_unknown"), None, "get_session of an unknown id")
        await raises(
            SessionExists, store.create_session(_session("sess_a", title="other")), "duplicate"
        )
        equal(await store.get_session("sess_a"), record, "a refused duplicate changes nothing")
        empty = _session("sess_b", title=None, dirs=())
        await store.create_session(empty)
        equal(await store.get_session("sess_b"), empty, "a session with no title or dirs")


async def check_list_order_and_paging(factory: StoreFactory) -> None:
    """Newest `updated_at` first, ties by id; every page size yields the same sequence."""
    async with factory() as store:
        stamps = {"s1": 300.0, "s2": 100.0, "s3": 300.0, "s4": 200.0, "s5": 300.0, "s6": 150.5}
        for sid in ("s4", "s1", "s6", "s5", "s2", "s3"):
            await store.create_session(_session(sid, updated_at=stamps[sid]))
        expected = ["s1", "s3", "s5", "s4", "s6", "s2"]
        for limit in (1, 2, 3, 4, 5, 6, 7, 100):
            ids = [r.session_id for r in await _all_sessions(store, limit=limit)]
            equal(ids, expected, f"session order with limit={limit}")
        page, cursor = await store.list_sessions(limit=6)
        equal(len(page), 6, "a page holding every session")
        equal(cursor, None, "the cursor of the last page")
        await raises(ValueError, store.list_sessions(limit=0), "limit=0")


async def check_list_empty(factory: StoreFactory) -> None:
    """An empty store lists nothing and no cursor."""
    async with factory() as store:
        equal(await store.list_sessions(), ([], None), "list_sessions of an empty store")


async def check_list_cursor_errors(factory: StoreFactory) -> None:
    """Malformed cursors raise InvalidCursor, which is both a ValueError and a StorageError."""
    async with factory() as store:
        await store.create_session(_session("s1"))
        bad = [
            "",
            "not a cursor!",
            "é",
            "bnVsbA",  # base64 of "null"
            "WzEsMiwzXQ",  # base64 of "[1,2,3]"
            encode_cursor(1.0, "s1")[:-3],
            encode_cursor(1.0, "s1") + "@",
        ]
        for cursor in bad:
            exc = await raises(
                InvalidCursor, store.list_sessions(cursor=cursor), f"cursor {cursor!r}"
            )
            expect(isinstance(exc, ValueError), "InvalidCursor must be a ValueError")
            expect(isinstance(exc, StorageError), "InvalidCursor must be a StorageError")


async def check_list_stable_while_adding(factory: StoreFactory) -> None:
    """Sessions created between pages neither repeat nor hide the remaining sessions."""
    async with factory() as store:
        for n in range(6):
            await store.create_session(_session(f"old{n}", updated_at=100.0 + n))
        first, cursor = await store.list_sessions(limit=2)
        equal([r.session_id for r in first], ["old5", "old4"], "first page")
        expect(cursor is not None, "a first page of 2 out of 6 has a cursor")
        for n in range(5):
            await store.create_session(_session(f"new{n}", updated_at=500.0 + n))
        rest: list[str] = []
        while cursor is not None:
            page, cursor = await store.list_sessions(cursor=cursor, limit=2)
            rest.extend(r.session_id for r in page)
        equal(rest, ["old3", "old2", "old1", "old0"], "pages after the cursor")


async def check_list_cwd_filter(factory: StoreFactory) -> None:
    """`cwd` matches exactly: subdirectories and other roots do not match; paging works."""
    async with factory() as store:
        await store.create_session(_session("a1", cwd="/repo", updated_at=10.0))
        await store.create_session(_session("a2", cwd="/repo", updated_at=30.0))
        await store.create_session(_session("a3", cwd="/repo", updated_at=20.0))
        await store.create_session(_session("sub", cwd="/repo/sub", updated_at=40.0))
        await store.create_session(_session("other", cwd="/other", updated_at=50.0))
        await store.create_session(
            _session("extra", cwd="/elsewhere", updated_at=60.0, dirs=("/repo",))
        )
        for limit in (1, 2, 10):
            ids = [r.session_id for r in await _all_sessions(store, cwd="/repo", limit=limit)]
            equal(ids, ["a2", "a3", "a1"], f"cwd filter with limit={limit}")
        equal(await store.list_sessions(cwd="/nowhere"), ([], None), "cwd without sessions")
        equal(len(await _all_sessions(store)), 6, "no filter lists all sessions")


async def check_tenant_field_and_filter(factory: StoreFactory) -> None:
    """A session's tenant reads back as stored, a fork keeps the tenant its record names, and
    `list_sessions(tenant=...)` lists one tenant's sessions (None: those without a tenant),
    with `cwd` and paging, while the default lists every session."""
    async with factory() as store:
        await store.create_session(_session("a1", tenant="alice", updated_at=10.0))
        await store.create_session(_session("a2", tenant="alice", updated_at=30.0, cwd="/x"))
        await store.create_session(_session("b1", tenant="bob", updated_at=20.0))
        await store.create_session(_session("n1", updated_at=40.0))
        equal(
            await store.get_session("a1"), _session("a1", tenant="alice", updated_at=10.0), "tenant"
        )
        fork = _session("a3", tenant="alice", forked_from="a1", updated_at=5.0)
        await store.fork_session("a1", fork)
        equal(await store.get_session("a3"), fork, "a fork's tenant")
        for limit in (1, 2, 10):
            alice = [r.session_id for r in await _all_sessions(store, tenant="alice", limit=limit)]
            equal(alice, ["a2", "a1", "a3"], f"tenant filter with limit={limit}")
        equal([r.session_id for r in await _all_sessions(store, tenant="bob")], ["b1"], "bob")
        equal([r.session_id for r in await _all_sessions(store, tenant=None)], ["n1"], "none")
        equal(await store.list_sessions(tenant="Alice"), ([], None), "tenants are exact")
        both = await _all_sessions(store, tenant="alice", cwd="/x")
        equal([r.session_id for r in both], ["a2"], "tenant and cwd together")
        equal(len(await _all_sessions(store)), 5, "the default lists every tenant's sessions")


async def check_delete(factory: StoreFactory) -> None:
    """Delete is idempotent and removes the session, its timeline and its keys."""
    async with factory() as store:
        await store.create_session(_session("gone"))
        await store.create_session(_session("kept"))
        await _insert(store, "gone", "m1", "key-1", b"digest")
        await store.append_update("gone", _agent_update("m2", "hi"), message_id="m2")
        await _insert(store, "kept", "k1", "key-1")
        equal(await store.delete_session("gone"), True, "deleting an existing session")
        equal(await store.delete_session("gone"), False, "deleting it again")
        equal(await store.delete_session("never"), False, "deleting an unknown session")
        equal(await store.get_session("gone"), None, "get_session after delete")
        equal(await store.read_timeline("gone"), [], "timeline after delete")
        equal(await store.find_key("gone", "key-1"), None, "find_key after delete")
        equal(await store.count_user_messages("gone"), 0, "user messages after delete")
        ids = [r.session_id for r in await _all_sessions(store)]
        equal(ids, ["kept"], "list after delete")
        equal(await store.find_key("kept", "key-1"), KeyRecord("k1", None), "other session's key")
        await raises(SessionMissing, _insert(store, "gone", "m3", "key-1"), "insert after delete")


async def check_recreated_session_forgets_keys(factory: StoreFactory) -> None:
    """A session re-created under a deleted id starts with no history and no keys (R37)."""
    async with factory() as store:
        await store.create_session(_session("s"))
        await _insert(store, "s", "m1", "key")
        await store.delete_session("s")
        await store.create_session(_session("s"))
        equal(await store.find_key("s", "key"), None, "key of the deleted incarnation")
        equal(await store.read_timeline("s"), [], "timeline of the re-created session")
        outcome = await _insert(store, "s", "m2", "key")
        equal(outcome, InsertOutcome("m2", True, None), "the key inserts again")


async def check_update_session(factory: StoreFactory) -> None:
    """`update_session` changes only the given fields, returns the record; missing raises."""
    async with factory() as store:
        await store.create_session(_session("s", title="first", updated_at=100.0))
        record = await store.update_session("s", title="second")
        equal(record.title, "second", "title after update")
        equal(record.updated_at, 100.0, "updated_at left unchanged")
        equal(await store.get_session("s"), record, "the returned record is the stored one")
        record = await store.update_session("s", updated_at=250.5)
        equal((record.title, record.updated_at), ("second", 250.5), "after updated_at only")
        record = await store.update_session("s", title=None, updated_at=UNCHANGED)
        equal(record.title, None, "title cleared with None")
        equal(await store.update_session("s"), record, "no fields: nothing changes")
        await raises(SessionMissing, store.update_session("nope", title="x"), "missing session")


# -- user messages and keys ---------------------------------------------------------------------


async def check_insert_without_key_inserts_each_time(factory: StoreFactory) -> None:
    """Without a key every call inserts a new message (R4)."""
    async with factory() as store:
        await store.create_session(_session("s"))
        first = await _insert(store, "s", "m1", None)
        second = await _insert(store, "s", "m2", None)
        equal(first, InsertOutcome("m1", True, None), "first keyless insert")
        equal(second, InsertOutcome("m2", True, None), "second keyless insert")
        equal(await store.count_user_messages("s"), 2, "user messages")
        ids = [e.message_id for e in await store.read_timeline("s")]
        equal(ids, ["m1", "m2"], "timeline message ids")


async def check_insert_with_key_inserts_once(factory: StoreFactory) -> None:
    """A recorded key inserts nothing and answers the first message id and digest (R19)."""
    async with factory() as store:
        await store.create_session(_session("s"))
        equal(await store.find_key("s", "key-1"), None, "find_key before insertion")
        first = await _insert(store, "s", "m1", "key-1", b"digest-1")
        equal(first, InsertOutcome("m1", True, b"digest-1"), "first keyed insert")
        retry = await _insert(store, "s", "m2", "key-1", b"digest-1")
        equal(retry, InsertOutcome("m1", False, b"digest-1"), "retry with the same key")
        changed = await _insert(store, "s", "m3", "key-1", b"another-digest", text="changed")
        equal(changed, InsertOutcome("m1", False, b"digest-1"), "same key, other prompt")
        equal(await store.find_key("s", "key-1"), KeyRecord("m1", b"digest-1"), "find_key")
        equal(await store.count_user_messages("s"), 1, "user messages")
        equal(await store.count_user_messages("s", idempotency_key="key-1"), 1, "with key")
        equal(await store.count_user_messages("s", idempotency_key="key-2"), 0, "other key")
        entries = await store.read_timeline("s")
        equal(len(entries), 1, "timeline length")
        equal(entries[0].update, _user_update("m1", "hello"), "the stored update")


async def check_insert_with_key_without_digest(factory: StoreFactory) -> None:
    """A key recorded without a digest answers `prompt_digest=None` (D4: answer as retry)."""
    async with factory() as store:
        await store.create_session(_session("s"))
        equal(await _insert(store, "s", "m1", "k"), InsertOutcome("m1", True, None), "insert")
        retry = await _insert(store, "s", "m2", "k", b"digest")
        equal(retry, InsertOutcome("m1", False, None), "retry")
        equal(await store.find_key("s", "k"), KeyRecord("m1", None), "find_key")


async def check_key_scoped_to_session(factory: StoreFactory) -> None:
    """The same key in another session is an unrelated submission (R32)."""
    async with factory() as store:
        await store.create_session(_session("a"))
        await store.create_session(_session("b"))
        equal((await _insert(store, "a", "ma", "shared")).inserted, True, "insert in a")
        equal(await _insert(store, "b", "mb", "shared"), InsertOutcome("mb", True, None), "b")
        equal(await store.find_key("a", "shared"), KeyRecord("ma", None), "key in a")
        equal(await store.find_key("b", "shared"), KeyRecord("mb", None), "key in b")


async def check_key_case_sensitive(factory: StoreFactory) -> None:
    """`K` and `k` are different keys (R7); unusual but valid keys work byte-exactly (D1)."""
    async with factory() as store:
        await store.create_session(_session("s"))
        keys = ["K", "k", " ", "K ", "ключ-🔑", "x" * 255, "e\u0301", "\u00e9"]
        for n, key in enumerate(keys):
            outcome = await _insert(store, "s", f"m{n}", key)
            equal(outcome, InsertOutcome(f"m{n}", True, None), f"insert with key #{n}")
        for n, key in enumerate(keys):
            equal(await store.find_key("s", key), KeyRecord(f"m{n}", None), f"key #{n}")
            equal((await _insert(store, "s", "dup", key)).message_id, f"m{n}", f"retry #{n}")
        equal(await store.count_user_messages("s"), len(keys), "user messages")


async def check_find_key_of_keyless_session(factory: StoreFactory) -> None:
    """Keyless messages record no key; find_key answers None for unknown sessions too."""
    async with factory() as store:
        await store.create_session(_session("s"))
        await _insert(store, "s", "m1", None)
        await store.append_update("s", _agent_update("a1", "x"), message_id="a1")
        equal(await store.find_key("s", "m1"), None, "a message id is not a key")
        equal(await store.find_key("nope", "k"), None, "unknown session")
        equal(await store.count_user_messages("s", idempotency_key="m1"), 0, "count by key")


async def check_concurrent_same_key_inserts_once(factory: StoreFactory) -> None:
    """50 concurrent inserts of one new key: exactly one inserts, all answer its id (R24)."""
    async with factory() as store:
        await store.create_session(_session("s"))
        outcomes: list[InsertOutcome] = []

        async def attempt(n: int) -> None:
            outcomes.append(await _insert(store, "s", f"m{n}", "the-key", f"d{n}".encode()))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for n in range(50):
                    tg.start_soon(attempt, n)
        winners = [o for o in outcomes if o.inserted]
        equal(len(outcomes), 50, "answers")
        equal(len(winners), 1, "inserted outcomes")
        winner = winners[0]
        expect(
            all(
                o == InsertOutcome(winner.message_id, False, winner.prompt_digest)
                for o in outcomes
                if o is not winner
            ),
            "every other attempt answers the winner's message id and digest",
        )
        equal(
            await store.find_key("s", "the-key"),
            KeyRecord(winner.message_id, winner.prompt_digest),
            "find_key",
        )
        equal(await store.count_user_messages("s"), 1, "user messages")
        equal(len(await store.read_timeline("s")), 1, "timeline length")


async def check_a_cancelled_insert_reports_what_it_stored(factory: StoreFactory) -> None:
    """A caller cancelled during `insert_user_message` either gets its outcome or nothing was
    stored: never a message stored behind its back (its turn would never run)."""
    async with factory() as store:
        await store.create_session(_session("s"))
        outcomes: dict[str, InsertOutcome] = {}

        async def attempt(n: int, scope: anyio.CancelScope) -> None:
            with scope:
                outcomes[f"k{n}"] = await _insert(store, "s", f"m{n}", f"k{n}")

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for n in range(20):
                    scope = anyio.CancelScope()
                    tg.start_soon(attempt, n, scope)
                    for _ in range(n % 5):  # cancelled at a different point each time
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()
        for n in range(20):
            found = await store.find_key("s", f"k{n}")
            told = outcomes.get(f"k{n}")
            if told is None:
                equal(found, None, f"a message its cancelled caller was not told of (k{n})")
            else:
                expect(found is not None, f"the insert its caller was told of (k{n})")
                assert found is not None
                equal(found.message_id, told.message_id, "the stored id")
        equal(await store.count_user_messages("s"), len(outcomes), "user messages")


async def check_concurrent_distinct_inserts(factory: StoreFactory) -> None:
    """Concurrent writes all land, each with a unique `seq`, none lost."""
    async with factory() as store:
        await store.create_session(_session("s"))

        async def user(n: int) -> None:
            key = None if n % 2 else f"key-{n}"
            equal((await _insert(store, "s", f"u{n}", key)).inserted, True, f"insert {n}")

        async def agent(n: int) -> None:
            await store.append_update("s", _agent_update(f"a{n}", "x"), message_id=f"a{n}")

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for n in range(20):
                    tg.start_soon(user, n)
                    tg.start_soon(agent, n)
        entries = await store.read_timeline("s")
        equal(len(entries), 40, "timeline length")
        equal([e.seq for e in entries], sorted({e.seq for e in entries}), "unique, ordered seq")
        equal(await store.count_user_messages("s"), 20, "user messages")
        ids = {e.message_id for e in entries}
        equal(ids, {f"u{n}" for n in range(20)} | {f"a{n}" for n in range(20)}, "ids")


async def check_fork_copies_history_not_keys(factory: StoreFactory) -> None:
    """A fork gets the source's timeline but none of its keys (R32, D15)."""
    async with factory() as store:
        await store.create_session(_session("src"))
        await _insert(store, "src", "m1", "key-1", b"d1")
        await store.append_update("src", _agent_update("a1", "answer"), message_id="a1")
        await _insert(store, "src", "m2", None)
        source_entries = await store.read_timeline("src")
        fork = _session("fork", title="forked", forked_from="src", updated_at=999.0)
        await store.fork_session("src", fork)
        equal(await store.get_session("fork"), fork, "the fork's record")
        copied = await store.read_timeline("fork")
        equal(
            [(e.session_id, e.seq, e.message_id, e.update) for e in copied],
            [("fork", e.seq, e.message_id, e.update) for e in source_entries],
            "the fork's timeline",
        )
        equal(await store.count_user_messages("fork"), 2, "copied user messages")
        equal(await store.find_key("fork", "key-1"), None, "the fork has no keys")
        equal(await store.count_user_messages("fork", idempotency_key="key-1"), 0, "by key")
        outcome = await _insert(store, "fork", "f1", "key-1", b"d1")
        equal(outcome, InsertOutcome("f1", True, b"d1"), "the source's key inserts in the fork")
        expect(
            [e.seq for e in await store.read_timeline("fork")][-1] > source_entries[-1].seq,
            "new entries of the fork come after the copied ones",
        )
        equal(await store.find_key("src", "key-1"), KeyRecord("m1", b"d1"), "source key kept")
        equal(await store.read_timeline("src"), source_entries, "the source is unchanged")
        await store.delete_session("src")
        equal(len(await store.read_timeline("fork")), 4, "the fork outlives its source")


async def check_fork_errors(factory: StoreFactory) -> None:
    """Forking a missing session or onto a taken id fails and changes nothing."""
    async with factory() as store:
        await store.create_session(_session("src"))
        await store.create_session(_session("taken"))
        await _insert(store, "src", "m1", None)
        await raises(SessionMissing, store.fork_session("nope", _session("new")), "fork of missing")
        equal(await store.get_session("new"), None, "no session created by a failed fork")
        await raises(
            SessionExists, store.fork_session("src", _session("taken")), "fork onto taken id"
        )
        equal(await store.read_timeline("taken"), [], "a failed fork copies nothing")


async def check_timeline_order_and_paging(factory: StoreFactory) -> None:
    """Entries come back in write order with increasing `seq`, pageable by `after_seq`."""
    async with factory() as store:
        await store.create_session(_session("s"))
        written: list[tuple[str | None, bytes]] = []
        for n in range(12):
            if n % 3 == 0:
                update = _user_update(f"u{n}", f"prompt {n}")
                await _insert(store, "s", f"u{n}", f"k{n}" if n % 2 else None, text=f"prompt {n}")
                written.append((f"u{n}", update))
            else:
                update = _agent_update(f"a{n}", f"chunk {n}")
                mid = None if n == 4 else f"a{n}"
                seq = await store.append_update("s", update, message_id=mid)
                expect(seq >= 1, "append_update returns a positive seq")
                written.append((mid, update))
        for limit in (1, 5, 12, 1000):
            entries = await _all_entries(store, "s", limit)
            equal([(e.message_id, e.update) for e in entries], written, f"limit={limit}")
            seqs = [e.seq for e in entries]
            expect(all(a < b for a, b in itertools.pairwise(seqs)), "seq increases")
            expect(all(e.session_id == "s" for e in entries), "entries name their session")
        entries = await store.read_timeline("s")
        middle = entries[5].seq
        equal(
            await store.read_timeline("s", after_seq=middle, limit=2),
            entries[6:8],
            "a page from the middle",
        )
        equal(await store.read_timeline("s", after_seq=entries[-1].seq), [], "after the end")
        await raises(ValueError, store.read_timeline("s", limit=0), "limit=0")


async def check_append_returns_seq(factory: StoreFactory) -> None:
    """`append_update` returns the `seq` that `read_timeline` reports for the entry."""
    async with factory() as store:
        await store.create_session(_session("s"))
        await _insert(store, "s", "u1", None)
        seq = await store.append_update("s", b'{"sessionUpdate":"x"}', message_id="a1")
        last = (await store.read_timeline("s"))[-1]
        equal((last.seq, last.message_id), (seq, "a1"), "the appended entry")


async def check_append_updates(factory: StoreFactory) -> None:
    """The optional `append_updates` (`AppendsUpdates`) appends in order and returns the seqs
    that `read_timeline` reports, bumps `updated_at`, and writes nothing on a missing session.
    A store without the method passes: the runtime then calls `append_update` per update."""
    async with factory() as store:
        append_updates = getattr(store, "append_updates", None)
        if append_updates is None:
            return
        await store.create_session(_session("s", updated_at=100.0))
        await _insert(store, "s", "u1", "k")
        entries = [
            (_agent_update("a1", "answer"), "a1"),
            (b'{"sessionUpdate":"marker"}', None),
        ]
        seqs = await append_updates("s", entries)
        timeline = await store.read_timeline("s")
        equal(len(timeline), 3, "entries after a user message and two appended updates")
        equal(seqs, [e.seq for e in timeline[1:]], "the returned seqs")
        equal(
            [(e.message_id, e.update) for e in timeline[1:]],
            [(mid, update) for update, mid in entries],
            "the appended entries, in order",
        )
        expect(timeline[0].seq < seqs[0] < seqs[1], "seqs increase")
        record = await store.get_session("s")
        expect(record is not None and record.updated_at > 100.0, "append_updates bumps it")
        equal(await store.count_user_messages("s"), 1, "appended updates are not user messages")
        equal(await append_updates("s", []), [], "nothing to append")
        await raises(SessionMissing, append_updates("nope", entries), "on a missing session")
        equal(await store.get_session("nope"), None, "no session appears")
        equal(await store.read_timeline("nope"), [], "nothing written")
        more = await append_updates("s", [(b'{"n":1}', None)])
        equal(more, [seqs[1] + 1], "the next append follows")
        # one, two and more entries may take different statements (PostgreSQL: arrays beyond two)
        three = [(b'{"n":2}', "b2"), (b'{"n":3}', None), (b'{"n":4}', "b4")]
        seqs3 = await append_updates("s", three)
        equal(seqs3, [more[0] + 1, more[0] + 2, more[0] + 3], "the seqs of three entries")
        tail = (await store.read_timeline("s"))[-3:]
        equal([(e.message_id, e.update) for e in tail], [(m, u) for u, m in three], "three stored")


async def check_payload_fidelity(factory: StoreFactory) -> None:
    """Update bytes come back byte for byte (non-ASCII, large, unusual but valid JSON)."""
    async with factory() as store:
        await store.create_session(_session("s"))
        payloads = [
            orjson.dumps({"sessionUpdate": "agent_message", "text": "naïve ☃ 🔑 \u0000 end"}),
            orjson.dumps({"sessionUpdate": "agent_message", "text": "x" * 200_000}),
            b'{"sessionUpdate" : "agent_message",  "spaced": true}',
        ]
        for payload in payloads:
            await store.append_update("s", payload)
        got = [e.update for e in await store.read_timeline("s")]
        equal(got, payloads, "update bytes")
        expect(all(type(u) is bytes for u in got), "updates are bytes")


async def check_keys_stay_private(factory: StoreFactory) -> None:
    """A key never shows in timeline bytes, session records, list pages or errors (R29)."""
    key = "PRIVATE-KEY-7c1e5d"
    async with factory() as store:
        await store.create_session(_session("s"))
        outcome = await _insert(store, "s", "m1", key, b"digest")
        retry = await _insert(store, "s", "m2", key, b"digest")
        await store.fork_session("s", _session("fork", forked_from="s"))
        found = await store.find_key("s", key)
        visible: list[object] = [
            outcome,
            retry,
            found,
            await store.get_session("s"),
            await store.list_sessions(),
            await store.list_sessions(limit=1),
            await store.read_timeline("s"),
            await store.read_timeline("fork"),
        ]
        missing = await raises(SessionMissing, _insert(store, "nope", "m", key), "missing")
        visible += [str(missing), missing.args]
        gone = await raises(
            SessionMissing,
            store.insert_user_message(
                "nope", message_id="m", update=b"{}", idempotency_key=key, prompt_digest=None
            ),
            "missing",
        )
        visible += [str(gone), repr(gone)]
        for thing in visible:
            expect(key not in repr(thing), f"the key leaks into {type(thing).__name__}")
        for session_id in ("s", "fork"):
            for entry in await store.read_timeline(session_id):
                expect(key.encode() not in entry.update, "the key leaks into an update")


async def check_writes_to_missing_session(factory: StoreFactory) -> None:
    """Writes on a missing session raise SessionMissing (a StorageError) and create nothing."""
    async with factory() as store:
        exc = await raises(SessionMissing, _insert(store, "nope", "m1", "k"), "insert")
        expect(isinstance(exc, StorageError), "SessionMissing is a StorageError")
        await raises(SessionMissing, _insert(store, "nope", "m1", None), "keyless insert")
        await raises(SessionMissing, store.append_update("nope", b"{}"), "append_update")
        equal(await store.get_session("nope"), None, "no session appears")
        equal(await store.find_key("nope", "k"), None, "no key appears")


async def check_reads_of_missing_session(factory: StoreFactory) -> None:
    """Reads of a missing session answer "nothing" instead of raising."""
    async with factory() as store:
        equal(await store.read_timeline("nope"), [], "read_timeline")
        equal(await store.count_user_messages("nope"), 0, "count_user_messages")
        equal(await store.count_user_messages("nope", idempotency_key="k"), 0, "count by key")
        equal(await store.find_key("nope", "k"), None, "find_key")


async def check_writes_bump_updated_at(factory: StoreFactory) -> None:
    """Inserting a message or appending an update bumps `updated_at`; a retry does not."""
    async with factory() as store:
        await store.create_session(_session("quiet", updated_at=100.0))
        await store.create_session(_session("busy", updated_at=100.0))
        await store.create_session(_session("agent", updated_at=100.0))
        await _insert(store, "busy", "m1", "k")
        record = await store.get_session("busy")
        expect(record is not None and record.updated_at > 100.0, "insert bumps updated_at")
        await store.append_update("agent", b"{}")
        agent = await store.get_session("agent")
        expect(agent is not None and agent.updated_at > 100.0, "append bumps updated_at")
        first_page, _ = await store.list_sessions(limit=1)
        expect(first_page[0].session_id in {"busy", "agent"}, "a written session lists first")
        await store.update_session("busy", updated_at=200.0)
        await _insert(store, "busy", "m2", "k")
        after = await store.get_session("busy")
        expect(after is not None and after.updated_at == 200.0, "a keyed retry writes nothing")
        quiet = await store.get_session("quiet")
        expect(quiet is not None and quiet.updated_at == 100.0, "other sessions unchanged")


async def check_count_user_messages(factory: StoreFactory) -> None:
    """Only user messages count; agent updates do not."""
    async with factory() as store:
        await store.create_session(_session("s"))
        await store.append_update("s", _agent_update("a1", "x"), message_id="a1")
        await _insert(store, "s", "u1", None)
        await _insert(store, "s", "u2", "k")
        await store.append_update("s", _agent_update("a2", "x"), message_id="a2")
        equal(await store.count_user_messages("s"), 2, "user messages")
        equal(await store.count_user_messages("s", idempotency_key="k"), 1, "with key k")


async def check_closed_store_refuses(factory: StoreFactory) -> None:
    """After `aclose` (idempotent) every call raises StorageError."""
    async with factory() as store:
        await store.create_session(_session("s"))
        await store.aclose()
        await store.aclose()
        await raises(StorageError, store.get_session("s"), "get_session after aclose")
        await raises(StorageError, _insert(store, "s", "m", "k"), "insert after aclose")


async def check_timeline_tail(factory: StoreFactory) -> None:
    """The tail is the last entries in order, for empty, short and missing timelines."""
    async with factory() as store:
        await store.create_session(_session("s"))
        expect(await store.read_timeline_tail("s") == [], "tail of an empty timeline")
        expect(
            await store.read_timeline_tail("missing", limit=3) == [], "tail of a missing session"
        )
        seqs = [await store.append_update("s", b'{"n":%d}' % i) for i in range(5)]
        tail = await store.read_timeline_tail("s", limit=2)
        expect([e.seq for e in tail] == seqs[-2:], "tail holds the last two entries in order")
        expect(tail[-1].update == b'{"n":4}', "tail keeps the payload")
        whole = await store.read_timeline_tail("s", limit=50)
        expect([e.seq for e in whole] == seqs, "a long limit returns the whole timeline")


# -- durable storage (a shared-storage factory: every store on one and the same storage) ------


def _in_order(entries: list[TimelineEntry], what: str) -> None:
    seqs = [e.seq for e in entries]
    expect(all(a < b for a, b in itertools.pairwise(seqs)), f"{what}: seqs {seqs} increase")


async def check_timeline_continues_after_reopen(factory: StoreFactory) -> None:
    """A store opened again on the same storage continues each timeline after its last entry
    (a restart never reuses a `seq` or reorders history) and still knows the keys."""
    async with factory() as store:
        await store.create_session(_session("s"))
        await _insert(store, "s", "u1", "k1", b"d1")
        await store.append_update("s", _agent_update("a1", "one"), message_id="a1")
        appends = getattr(store, "append_updates", None)
        if appends is not None:
            await appends("s", [(_agent_update("a2", "two"), "a2"), (b'{"end":1}', None)])
        before = await store.read_timeline("s")
    async with factory() as store:
        equal(await store.read_timeline("s"), before, "the timeline as it was stored")
        equal(await store.find_key("s", "k1"), KeyRecord("u1", b"d1"), "the key after reopening")
        retry = await _insert(store, "s", "u1-again", "k1", b"d1")
        equal(retry, InsertOutcome("u1", False, b"d1"), "a retry after reopening")
        await _insert(store, "s", "u2", "k2")
        seq = await store.append_update("s", b'{"after":1}')
        after = await store.read_timeline("s")
        equal(after[: len(before)], before, "earlier entries unchanged")
        equal(
            [e.message_id for e in after[len(before) :]],
            ["u2", None],
            "the new entries follow the old ones",
        )
        equal(after[-1].seq, seq, "the seq append_update returned")
        _in_order(after, "after reopening")


async def check_second_writer_on_one_session(factory: StoreFactory) -> None:
    """Two stores open on one storage write to one session in turn (two processes on one
    file): every write lands after the other's, whatever either remembered of the session;
    no `seq` is used twice, and a key recorded through one is recorded for the other."""
    async with factory() as first, factory() as second:
        await first.create_session(_session("s"))
        await _insert(first, "s", "u1", "k1")
        await _insert(second, "s", "u2", "k2")
        one = await first.append_update("s", b'{"n":1}')  # after the other store's write
        appends = getattr(second, "append_updates", None)
        if appends is not None:
            await appends("s", [(b'{"n":2}', None), (_agent_update("a3", "three"), "a3")])
        else:
            await second.append_update("s", b'{"n":2}')
            await second.append_update("s", _agent_update("a3", "three"), message_id="a3")
        retry = await _insert(second, "s", "u1-again", "k1")
        equal(retry, InsertOutcome("u1", False, None), "a key recorded through the other store")
        await _insert(first, "s", "u4", None)
        timeline = await second.read_timeline("s")
        equal(await first.read_timeline("s"), timeline, "both stores read one timeline")
        equal(
            [e.message_id for e in timeline],
            ["u1", "u2", None, None, "a3", "u4"],
            "every write, in the order written",
        )
        equal(timeline[2].seq, one, "the seq append_update returned")
        _in_order(timeline, "two writers")
        equal(await first.count_user_messages("s"), 3, "user messages")


async def check_session_deleted_by_another_store(factory: StoreFactory) -> None:
    """A session deleted through one store is gone for another that wrote to it: its writes
    raise SessionMissing and write nothing."""
    async with factory() as first, factory() as second:
        await first.create_session(_session("s"))
        await _insert(first, "s", "u1", "k1")
        await first.append_update("s", b"{}")
        expect(await second.delete_session("s"), "deleted through the other store")
        await raises(SessionMissing, _insert(first, "s", "u2", "k2"), "insert after the delete")
        await raises(SessionMissing, first.append_update("s", b"{}"), "append after the delete")
        equal(await first.get_session("s"), None, "no session appears")
        equal(await second.read_timeline("s"), [], "nothing written")


DURABLE_CHECKS: Final[tuple[Check, ...]] = (
    check_timeline_continues_after_reopen,
    check_second_writer_on_one_session,
    check_session_deleted_by_another_store,
)
"""The checks of a durable backend, each taking a shared-storage factory (module docstring)."""


async def run_durable_contract(
    new_storage: Callable[[], StoreFactory],
) -> list[tuple[str, Exception]]:
    """Run every durable check, each with a shared-storage factory of its own from
    `new_storage()` (fresh, empty storage); return the failures (name, error)."""
    failures: list[tuple[str, Exception]] = []
    for check in DURABLE_CHECKS:
        failures += await run_checks((check,), new_storage())
    return failures


CHECKS: Final[tuple[Check, ...]] = (
    check_create_and_get,
    check_list_order_and_paging,
    check_list_empty,
    check_list_cursor_errors,
    check_list_stable_while_adding,
    check_list_cwd_filter,
    check_tenant_field_and_filter,
    check_delete,
    check_recreated_session_forgets_keys,
    check_update_session,
    check_insert_without_key_inserts_each_time,
    check_insert_with_key_inserts_once,
    check_insert_with_key_without_digest,
    check_key_scoped_to_session,
    check_key_case_sensitive,
    check_find_key_of_keyless_session,
    check_concurrent_same_key_inserts_once,
    check_a_cancelled_insert_reports_what_it_stored,
    check_concurrent_distinct_inserts,
    check_fork_copies_history_not_keys,
    check_fork_errors,
    check_timeline_order_and_paging,
    check_timeline_tail,
    check_append_returns_seq,
    check_append_updates,
    check_payload_fidelity,
    check_keys_stay_private,
    check_writes_to_missing_session,
    check_reads_of_missing_session,
    check_writes_bump_updated_at,
    check_count_user_messages,
    check_closed_store_refuses,
)
"""Every check of the contract, in a stable order."""


async def run_contract(factory: StoreFactory) -> list[tuple[str, Exception]]:
    """Run every check against stores from `factory`; return the failures (name, error)."""
    return await run_checks(CHECKS, factory)
