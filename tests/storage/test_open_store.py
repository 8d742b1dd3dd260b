"""`open_store(url)`: the one place that turns a configuration string into a store."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from acp_once.storage import (
    KeyRecord,
    MemoryStore,
    SchemaOutOfDate,
    SessionRecord,
    SqliteStore,
    check_store_url,
    open_store,
)

if TYPE_CHECKING:
    from pathlib import Path

_RECORD = SessionRecord("sess_1", "/work", (), None, 1.0, 1.0)


@pytest.mark.anyio
async def test_memory_url_opens_a_fresh_memory_store() -> None:
    async with open_store("memory:") as store:
        assert isinstance(store, MemoryStore)
        await store.create_session(_RECORD)
        assert await store.get_session("sess_1") == _RECORD
    async with open_store("memory:") as other:
        assert await other.get_session("sess_1") is None
    async with open_store("memory") as bare:  # the issue's `--store memory`
        assert isinstance(bare, MemoryStore)


def test_check_store_url_normalises_without_opening(tmp_path: Path) -> None:
    assert check_store_url("memory") == "memory:"
    url = f"sqlite:{tmp_path / 'never.db'}"
    assert check_store_url(url) == url
    assert check_store_url("postgresql://h/db?schema=x") == "postgresql://h/db?schema=x"
    assert not (tmp_path / "never.db").exists()
    with pytest.raises(ValueError, match="has no scheme"):
        check_store_url("memoryx")


@pytest.mark.anyio
async def test_sqlite_url_opens_the_file(tmp_path: Path) -> None:
    url = f"sqlite:{tmp_path / 'sessions.db'}"
    async with open_store(url) as store:
        assert isinstance(store, SqliteStore)
        await store.create_session(_RECORD)
        await store.insert_user_message(
            "sess_1", message_id="m1", update=b"{}", idempotency_key="k", prompt_digest=None
        )
    assert (tmp_path / "sessions.db").exists()
    async with open_store(url, migrate=False) as again:
        assert await again.find_key("sess_1", "k") == KeyRecord("m1", None)


@pytest.mark.anyio
async def test_sqlite_url_without_migrate_refuses_an_old_file(tmp_path: Path) -> None:
    with pytest.raises(SchemaOutOfDate, match="acp-once db migrate"):
        async with open_store(f"sqlite:{tmp_path / 'new.db'}", migrate=False):
            pass


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://localhost/acp", "unsupported store URL scheme 'mysql'"),
        ("redis:x", "unsupported store URL scheme 'redis'"),
        ("sessions.db", "has no scheme"),
        ("sqlite:", "needs a path"),
        ("memory:extra", "takes nothing"),
    ],
)
async def test_bad_urls_raise_value_error(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        async with open_store(url):
            pass
