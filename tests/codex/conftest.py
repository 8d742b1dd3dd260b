"""Fixtures of the Codex tests: codex-acp installed once per run (skipped without node and
npm, except under `CI=true`, where that fails), a scripted model per test, and the PostgreSQL
fixtures of the storage tests."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.codex.harness import Missing, codex_pids, install
from tests.codex.model_server import ModelServer
from tests.storage.conftest import new_schema, postgres_dsn

__all__ = ["codex_bin", "model", "new_schema", "postgres_dsn"]


@pytest.fixture(scope="session")
def codex_bin() -> str:
    try:
        return install()
    except Missing as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true requires the Codex tests: {exc}")
        pytest.skip(str(exc))


@pytest.fixture
def model(tmp_path: Path) -> Iterator[ModelServer]:
    with ModelServer(tmp_path / "model-requests.jsonl") as server:
        yield server
    # whatever Codex process a test left (a failure midway) is killed here
    for pid in codex_pids(tmp_path / "codex-home"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
