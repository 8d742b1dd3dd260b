"""`acp-once serve` and migrations: a store whose schema is out of date is refused (naming
`acp-once db migrate`) unless `--migrate`; a new store is created."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_once.storage.sqlite.schema import LATEST_VERSION, apply_migrations, current_version
from acp_once.support.sqlite import Connection
from tests.cli.test_cli_logging import serving, stop

pytest.importorskip("uvicorn")


def serve(*options: str) -> subprocess.CompletedProcess[str]:
    """`acp-once serve --port 0 OPTIONS`, which must end by itself (refused) within 30 s."""
    return subprocess.run(
        [sys.executable, "-m", "acp_once", "serve", "--port", "0", *options],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def old_sqlite_file(path: Path) -> None:
    """A store file one schema version behind."""
    raw = sqlite3.connect(path, isolation_level=None, factory=Connection)
    try:
        assert apply_migrations(raw, target=LATEST_VERSION - 1)
    finally:
        raw.close()


def version(path: Path) -> int:
    raw = sqlite3.connect(path, isolation_level=None, factory=Connection)
    try:
        return current_version(raw)
    finally:
        raw.close()


def test_serve_refuses_an_out_of_date_sqlite_store(tmp_path: Path) -> None:
    db = tmp_path / "old.sqlite3"
    old_sqlite_file(db)
    refused = serve("--store", f"sqlite:{db}")
    assert refused.returncode == 1, refused.stderr
    flat = " ".join(refused.stderr.split())
    assert f"acp-once db migrate --store sqlite:{db}" in flat, flat
    assert "--migrate" in flat and "1 migration(s) pending" in flat
    assert "Traceback" not in flat and "ACP over WebSocket" not in flat
    assert version(db) == LATEST_VERSION - 1  # nothing applied


def started(*options: str) -> None:
    """`acp-once serve OPTIONS` reaches its startup line, then stops on SIGTERM."""
    with serving("serve", "--port", "0", *options) as proc:
        assert proc.stderr is not None
        lines = [proc.stderr.readline()]
        while "ACP over WebSocket at ws://" not in lines[-1]:
            assert lines[-1], "".join(lines)
            lines.append(proc.stderr.readline())
        port = re.search(r"ws://127\.0\.0\.1:(\d+)/acp", lines[-1])
        assert port
        # serving: SIGTERM now stops it gracefully
        health = f"http://127.0.0.1:{port.group(1)}/healthz"
        with urllib.request.urlopen(health, timeout=10) as answer:
            assert answer.status == 200
        code, rest = stop(proc)
    assert code == 0, rest


def test_serve_with_migrate_applies_them(tmp_path: Path) -> None:
    db = tmp_path / "old.sqlite3"
    old_sqlite_file(db)
    started("--store", f"sqlite:{db}", "--migrate")
    assert version(db) == LATEST_VERSION


def test_serve_creates_a_new_store_without_migrate(tmp_path: Path) -> None:
    db = tmp_path / "new" / "s.sqlite3"
    started("--store", f"sqlite:{db}")
    assert version(db) == LATEST_VERSION


def test_db_migrate_then_serve_is_not_refused(tmp_path: Path) -> None:
    db = tmp_path / "old.sqlite3"
    old_sqlite_file(db)
    migrated = subprocess.run(
        [sys.executable, "-m", "acp_once", "db", "migrate", "--store", f"sqlite:{db}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert migrated.returncode == 0, migrated.stderr
    assert version(db) == LATEST_VERSION
    started("--store", f"sqlite:{db}")


POSTGRES_DSN = os.environ.get("ACP_ONCE_TEST_POSTGRES_DSN")


@pytest.mark.skipif(not POSTGRES_DSN, reason="ACP_ONCE_TEST_POSTGRES_DSN is not set")
def test_serve_refuses_an_out_of_date_postgres_schema() -> None:
    pytest.importorskip("psycopg")
    from psycopg import sql

    from acp_once.storage.postgres import migrate_postgres
    from acp_once.storage.postgres.migrations import LATEST_VERSION as LATEST_PG
    from acp_once.storage.postgres.migrations import _on_one_connection, apply_migrations

    assert POSTGRES_DSN is not None
    dsn = POSTGRES_DSN
    schema = f"cli_{uuid.uuid4().hex[:12]}"

    async def on_schema(statement: str) -> None:
        async def work(conn: Any) -> None:
            if statement == "older":
                await apply_migrations(conn, schema, target=LATEST_PG - 1)
            else:
                drop = sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                await conn.execute(drop)
                await conn.commit()

        await _on_one_connection(dsn, schema, work)

    anyio.run(on_schema, "older")
    url = f"{dsn}{'&' if '?' in dsn else '?'}schema={schema}"
    try:
        refused = serve("--store", url)
        assert refused.returncode == 1, refused.stderr
        flat = " ".join(refused.stderr.split())
        assert "acp-once db migrate --store postgresql://" in flat and "--migrate" in flat, flat
        assert f"schema version {LATEST_PG - 1} of {LATEST_PG}" in flat
        started("--store", url, "--migrate")
        assert anyio.run(migrate_postgres, dsn, schema) == (LATEST_PG, LATEST_PG)
    finally:
        anyio.run(on_schema, "drop")


def test_the_default_store_is_in_the_platforms_data_directory(tmp_path: Path) -> None:
    """`db migrate` without --store writes where platformdirs puts the user's data (on Linux
    $XDG_DATA_HOME/acp-once), not a hard-coded path."""
    from platformdirs import user_data_dir

    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "HOME": str(tmp_path)}
    migrated = subprocess.run(
        [sys.executable, "-m", "acp_once", "db", "migrate"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env=env,
    )
    assert migrated.returncode == 0, migrated.stderr
    if sys.platform.startswith("linux"):
        expected = tmp_path / "data" / "acp-once" / "sessions.sqlite3"
    else:
        expected = Path(user_data_dir("acp-once", appauthor=False)) / "sessions.sqlite3"
    assert str(expected) in migrated.stdout
    assert expected.exists() or not sys.platform.startswith("linux")
