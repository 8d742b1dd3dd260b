"""The command line: `db migrate` / `db status`, and the agent's help."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from acp_once.client import ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.storage import SchemaOutOfDate, SqliteStore
from acp_once.transports.stdio import spawn
from tests.helpers import UpdateRecorder, initialize_request


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acp_once", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        # a wide terminal: the help's option table (with its choices) fits on one line each
        env={**os.environ, "COLUMNS": "200"},
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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("agent", "--store", "sessions.db"), "has no scheme"),
        (("agent", "--store", "mem:x"), "unsupported store URL scheme 'mem'"),
        (("agent", "--runtime", "langgraph", "--store", "postgresql://h/db"), "memory: or sqlite"),
        (("serve", "--store", "sqlite:"), "needs a path"),
    ],
)
def test_a_bad_store_is_a_usage_error_before_anything_starts(
    args: tuple[str, ...], message: str
) -> None:
    refused = run(*args)
    assert refused.returncode == 2
    flat = " ".join(refused.stderr.replace("│", " ").split())
    assert "Invalid value for --store" in flat and message in flat
    assert "Traceback" not in refused.stderr


@pytest.mark.anyio
async def test_agent_store_memory_without_a_colon_is_the_memory_store(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "acp_once", "agent", "--store", "memory"]
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    with anyio.fail_after(60):
        for _ in range(2):  # a second process starts empty: nothing was kept
            async with (
                spawn(command, env=env) as proc,
                ClientSideConnection(UpdateRecorder(), proc.frames) as conn,
            ):
                await conn.agent.initialize(initialize_request())
                listed = await conn.agent.list_sessions(s.ListSessionsRequest())
                assert listed.sessions == []
                await conn.agent.new_session(s.NewSessionRequest(cwd="/tmp"))
    assert not (tmp_path / "acp-once").exists()  # not the default SQLite store
