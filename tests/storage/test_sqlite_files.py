"""The files of a SQLite store (issue 20, finding 10): private, and `~` is the home directory.

A store holds users' prompts: other local users must not read them. `sqlite:~/x.db` used to
create a directory literally named `~` in the working directory.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from acp_once.storage import open_store
from acp_once.storage.sqlite import SqliteStore, migrate_database

pytestmark = pytest.mark.anyio


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def _common_umask() -> Iterator[None]:
    # the usual 022: the modes asserted must come from the code, not from a strict umask
    old = os.umask(0o022)
    yield
    os.umask(old)


async def test_a_new_store_file_is_0600_in_a_new_0700_directory(tmp_path: Path) -> None:
    path = tmp_path / "new-dir" / "sessions.db"
    async with SqliteStore.open(path):
        assert _mode(path.parent) == 0o700
        assert _mode(path) == 0o600
        # open in WAL mode: SQLite gives its sidecar files the database file's mode
        for sidecar in (Path(f"{path}-wal"), Path(f"{path}-shm")):
            assert _mode(sidecar) == 0o600


async def test_an_existing_directory_keeps_its_mode(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    async with SqliteStore.open(tmp_path / "s.db"):
        pass
    assert _mode(tmp_path) == 0o755
    assert _mode(tmp_path / "s.db") == 0o600


async def test_tilde_is_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    async with open_store("sqlite:~/data/x.db"):
        pass
    await migrate_database("~/data/y.db")
    assert (home / "data" / "x.db").is_file()
    assert (home / "data" / "y.db").is_file()
    assert _mode(home / "data") == 0o700
    assert not (work / "~").exists()
