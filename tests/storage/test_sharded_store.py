"""A store sharded over two PostgreSQL servers: where sessions go, that it stays so, the list
merged across shards, keys per session on each shard, forks between shards, migrations on
every shard. (The whole `SessionStore` contract runs on it too: `postgres-sharded` in
tests/storage/conftest.py.)"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import anyio
import pytest

from acp_once.storage import InsertOutcome, SessionRecord, StorageError, open_store
from acp_once.storage.postgres import (
    LATEST_VERSION,
    PostgresStore,
    describe_postgres,
    parse_postgres_url,
)
from acp_once.storage.postgres.shards import open_shards, shards_status
from acp_once.storage.sharded import ShardedStore, shard_of

pytestmark = [pytest.mark.postgres]


def record(sid: str, *, updated_at: float = 100.0, cwd: str = "/w") -> SessionRecord:
    return SessionRecord(
        session_id=sid,
        cwd=cwd,
        additional_directories=(),
        title=None,
        created_at=50.0,
        updated_at=updated_at,
    )


def ids_on(shard: int, count: int, *, shards: int = 2, prefix: str = "sess") -> list[str]:
    """The first `count` ids `prefix-N` that hash to `shard`."""
    found: list[str] = []
    n = 0
    while len(found) < count:
        sid = f"{prefix}-{n}"
        if shard_of(sid, shards) == shard:
            found.append(sid)
        n += 1
    return found


def user_update(text: str) -> bytes:
    return (
        b'{"sessionUpdate":"user_message","content":[{"type":"text","text":"'
        + text.encode()
        + b'"}]}'
    )


def test_placement_is_a_fixed_function_of_the_id() -> None:
    # Stored data depends on these values: they must never change between versions.
    assert [shard_of(sid, 2) for sid in ("src", "fork", "a", "d", "taken")] == [0, 1, 0, 1, 1]
    assert [shard_of(sid, 3) for sid in ("src", "fork", "a", "taken")] == [0, 2, 1, 1]
    assert shard_of("anything", 1) == 0
    # spread: 1,000 ids over 2 shards land about evenly
    counts = [0, 0]
    for n in range(1000):
        counts[shard_of(f"sess_{n}", 2)] += 1
    assert min(counts) > 400
    with pytest.raises(ValueError, match="at least one shard"):
        shard_of("x", 0)


@pytest.mark.anyio
async def test_sessions_stay_on_their_shard_across_reopening(
    shard_urls: Callable[[], list[str]],
) -> None:
    urls = shard_urls()
    sids = [f"sess-{n}" for n in range(12)]
    async with open_shards(urls) as store:
        for sid in sids:
            await store.create_session(record(sid))
            outcome = await store.insert_user_message(
                sid, message_id=f"m-{sid}", update=user_update(sid),
                idempotency_key="k", prompt_digest=b"d",
            )  # fmt: skip
            assert outcome.inserted
    # each server holds exactly the sessions that hash to it, read by a store of its own
    for index, url in enumerate(urls):
        dsn, schema = parse_postgres_url(url)
        async with PostgresStore.open(dsn, schema=schema, shard=True) as alone:
            page, _ = await alone.list_sessions(limit=100)
            assert sorted(r.session_id for r in page) == sorted(
                sid for sid in sids if shard_of(sid, 2) == index
            )
    assert {shard_of(sid, 2) for sid in sids} == {0, 1}  # both shards are used
    # a new process (a new store) finds every session and its key where it left them
    async with open_store(urls) as again:
        assert isinstance(again, ShardedStore)
        for sid in sids:
            found = await again.find_key(sid, "k")
            assert found is not None and found.message_id == f"m-{sid}"


@pytest.mark.anyio
async def test_a_changed_shard_set_is_refused(
    shard_urls: Callable[[], list[str]], postgres_dsn: str
) -> None:
    first, second = shard_urls()
    third, _ = shard_urls()
    async with open_shards([first, second]) as store:
        await store.create_session(record("sess-1"))
    # another order: each shard says what it was recorded as
    with pytest.raises(StorageError, match=r"recorded as shard 2 of 2.*given as shard 1 of 2"):
        await open_shards([second, first])
    # another size
    with pytest.raises(StorageError, match=r"recorded as shard 1 of 2.*shard 1 of 3"):
        await open_shards([first, second, third])
    # the same database twice
    with pytest.raises(StorageError, match="same database as shard 1"):
        await open_shards([first, first])
    # one shard opened alone would miss the other's sessions
    dsn, schema = parse_postgres_url(first)
    with pytest.raises(StorageError, match=r"shard 1 of 2 of a sharded store"):
        await PostgresStore.open(dsn, schema=schema)
    with pytest.raises(StorageError, match=r"shard 2 of 2 of a sharded store"):
        async with open_store(second):
            pass
    # a one-database store with sessions cannot become a shard: they would hash elsewhere
    single, other = shard_urls()
    async with open_store(single) as alone:
        await alone.create_session(record("sess-x"))
    with pytest.raises(StorageError, match="holds sessions stored without sharding"):
        await open_shards([single, other])
    # and after all these refusals the set still opens as recorded, its session in place
    async with open_shards([first, second]) as store:
        assert await store.get_session("sess-1") == record("sess-1")


@pytest.mark.anyio
async def test_list_merges_the_shards_in_list_order_and_pages(
    shard_urls: Callable[[], list[str]],
) -> None:
    on0, on1 = ids_on(0, 5), ids_on(1, 5)
    # ties on updated_at across shards are ordered by id, as on one store
    stamps = {sid: float(100 + (n % 3)) for n, sid in enumerate(on0 + on1)}
    async with open_shards(shard_urls()) as store:
        for sid, stamp in stamps.items():
            await store.create_session(record(sid, updated_at=stamp, cwd="/a"))
        await store.create_session(record("other-cwd", updated_at=500.0, cwd="/b"))
        expected = sorted(stamps, key=lambda sid: (-stamps[sid], sid))
        for limit in (1, 2, 3, 4, 7, 10, 11, 100):
            seen: list[str] = []
            cursor: str | None = None
            while True:
                page, cursor = await store.list_sessions(cwd="/a", cursor=cursor, limit=limit)
                assert len(page) <= limit
                seen.extend(r.session_id for r in page)
                if cursor is None:
                    break
            assert seen == expected, limit
        whole, cursor = await store.list_sessions(limit=100)
        assert cursor is None
        assert [r.session_id for r in whole] == ["other-cwd", *expected]
        # a page boundary that falls on the last session of the union has no next page
        page, cursor = await store.list_sessions(limit=11)
        assert len(page) == 11 and cursor is None
        # sessions of one shard only: a full page from it, the other empty, still has a next
        only = ids_on(1, 3, prefix="only")
        for n, sid in enumerate(only):
            await store.create_session(record(sid, updated_at=10.0 + n, cwd="/one"))
        first, cursor = await store.list_sessions(cwd="/one", limit=2)
        assert [r.session_id for r in first] == [only[2], only[1]] and cursor is not None
        rest, cursor = await store.list_sessions(cwd="/one", cursor=cursor, limit=2)
        assert [r.session_id for r in rest] == [only[0]] and cursor is None


@pytest.mark.anyio
async def test_keys_are_per_session_on_every_shard(shard_urls: Callable[[], list[str]]) -> None:
    a, b = ids_on(0, 1)[0], ids_on(1, 1)[0]
    async with open_shards(shard_urls()) as store:
        for sid in (a, b):
            await store.create_session(record(sid))

        async def insert(sid: str, mid: str) -> InsertOutcome:
            return await store.insert_user_message(
                sid, message_id=mid, update=user_update(mid), idempotency_key="same-key",
                prompt_digest=b"d",
            )  # fmt: skip

        # one key in two sessions on two shards: two messages, each inserted once
        outcomes: dict[str, list[InsertOutcome]] = {a: [], b: []}

        async def racer(sid: str, n: int) -> None:
            outcomes[sid].append(await insert(sid, f"{sid}-{n}"))

        async with anyio.create_task_group() as tg:
            for n in range(4):
                tg.start_soon(racer, a, n)
                tg.start_soon(racer, b, n)
        for sid in (a, b):
            assert sum(o.inserted for o in outcomes[sid]) == 1
            assert len({o.message_id for o in outcomes[sid]}) == 1
            assert await store.count_user_messages(sid, idempotency_key="same-key") == 1
        assert outcomes[a][0].message_id != outcomes[b][0].message_id


@pytest.mark.anyio
async def test_a_fork_onto_another_shard_is_a_copy_without_keys(
    shard_urls: Callable[[], list[str]],
) -> None:
    source = ids_on(0, 1, prefix="src")[0]
    same, other = ids_on(0, 1, prefix="fork")[0], ids_on(1, 1, prefix="fork")[0]
    async with open_shards(shard_urls()) as store:
        await store.create_session(record(source))
        for n in range(3):
            await store.insert_user_message(
                source, message_id=f"m{n}", update=user_update(f"m{n}"),
                idempotency_key=f"k{n}", prompt_digest=b"d",
            )  # fmt: skip
            await store.append_update(
                source, b'{"sessionUpdate":"agent_message"}', message_id=f"a{n}"
            )
        entries = await store.read_timeline(source)
        for target in (same, other):
            forked = record(target, updated_at=7.0)
            await store.fork_session(source, forked)
            assert await store.get_session(target) == forked
            copied = await store.read_timeline(target)
            assert [(e.seq, e.message_id, e.update) for e in copied] == [
                (e.seq, e.message_id, e.update) for e in entries
            ]
            assert await store.count_user_messages(target) == 3
            assert await store.find_key(target, "k0") is None
            outcome = await store.insert_user_message(
                target, message_id="new", update=user_update("new"), idempotency_key="k0",
                prompt_digest=b"d",
            )  # fmt: skip
            assert outcome.inserted
            assert (await store.read_timeline_tail(target))[0].seq == entries[-1].seq + 1
        assert isinstance(store, ShardedStore)
        assert store.shard(same) is store.shard(source)
        assert store.shard(other) is not store.shard(source)


def test_db_migrate_and_status_cover_every_shard(shard_urls: Callable[[], list[str]]) -> None:
    urls = shard_urls()

    def db(*args: str) -> subprocess.CompletedProcess[str]:
        stores = [arg for url in urls for arg in ("--store", url)]
        return subprocess.run(
            [sys.executable, "-m", "acp_once", "db", *args, *stores],
            capture_output=True, text=True, timeout=30, check=False,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip

    pending = db("status")
    assert pending.returncode == 1, pending.stderr
    assert pending.stdout.count(f"schema version 0 of {LATEST_VERSION}") == 2, pending.stdout
    migrated = db("migrate")
    assert migrated.returncode == 0, migrated.stderr
    lines = migrated.stdout.splitlines()
    assert len(lines) == 2 and all(f"0 -> {LATEST_VERSION}" in line for line in lines), lines
    for line, url in zip(lines, urls, strict=True):  # in --store order, described
        assert line.startswith(describe_postgres(*parse_postgres_url(url))), line
    status = db("status")
    assert status.returncode == 0, status.stdout
    assert status.stdout.count("up to date") == 2
    # migrate recorded the set: the other order is refused now, before any session exists
    reordered = subprocess.run(
        [sys.executable, "-m", "acp_once", "db", "migrate", "--store", urls[1], "--store", urls[0]],
        capture_output=True, text=True, timeout=30, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert reordered.returncode == 2
    assert "recorded as shard 2 of 2" in reordered.stderr
    # and serve refuses it in one line, before serving anything
    serve = subprocess.run(
        [sys.executable, "-m", "acp_once", "serve", "--port", "0",
         "--store", urls[1], "--store", urls[0]],
        capture_output=True, text=True, timeout=30, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert serve.returncode == 1, serve.stderr
    assert "recorded as shard 2 of 2" in serve.stderr and "Traceback" not in serve.stderr
    versions = anyio.run(shards_status, urls)
    assert [(s.before, s.after) for s in versions] == [(LATEST_VERSION, LATEST_VERSION)] * 2


@pytest.mark.anyio
async def test_nodes_opening_a_new_set_at_once_record_one_set(
    shard_urls: Callable[[], list[str]],
) -> None:
    urls = shard_urls()
    opened: list[ShardedStore] = []
    errors: list[BaseException] = []

    async def node() -> None:
        try:
            store = await open_shards(urls, max_size=2)
        except StorageError as exc:  # pragma: no cover - the failure this test looks for
            errors.append(exc)
            return
        opened.append(store)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(node)
    try:
        assert errors == [] and len(opened) == 4
        # one set: a session written through one node is read through every other
        await opened[0].create_session(record("sess-shared"))
        for store in opened[1:]:
            assert await store.get_session("sess-shared") == record("sess-shared")
    finally:
        for store in opened:
            await store.aclose()
    with pytest.raises(StorageError, match="recorded as shard 2 of 2"):
        await open_shards([urls[1], urls[0]])
