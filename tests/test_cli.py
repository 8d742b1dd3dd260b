"""The command line: `db migrate` / `db status`, and the agent's help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from acp_once.storage import SchemaOutOfDate, SqliteStore


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acp_once", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_db_status_and_migrate(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite3"
    pending = run("db", "status", "--store", f"sqlite:{db}")
    assert pending.returncode == 1 and "pending" in pending.stdout
    assert not db.exists()  # status never creates the file

    async def open_unmigrated() -> None:
        async with SqliteStore.open(db, migrate=False):
            pass

    migrated = run("db", "migrate", "--store", f"sqlite:{db}")
    assert migrated.returncode == 0 and "-> " in migrated.stdout
    up = run("db", "status", "--store", f"sqlite:{db}")
    assert up.returncode == 0 and "up to date" in up.stdout
    anyio.run(open_unmigrated)  # an up-to-date file opens without migrating


def test_unmigrated_store_names_the_command(tmp_path: Path) -> None:
    async def go() -> None:
        async with SqliteStore.open(tmp_path / "new.sqlite3", migrate=False):
            pass

    with pytest.raises(SchemaOutOfDate, match="acp-once db migrate"):
        anyio.run(go)


def test_agent_help_documents_the_scripted_turn() -> None:
    helped = run("agent", "--help")
    assert helped.returncode == 0
    for marker in ("[work:SECONDS]", "[tool]", "--store", "--policy", "--no-compare-prompts"):
        assert marker in helped.stdout
