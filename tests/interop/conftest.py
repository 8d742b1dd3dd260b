"""Interop with the TypeScript SDK 2.4.0: its node project is installed once per test session
(`npm ci` into a temporary directory, pinned by `package-lock.json`). Without node and npm the
tests fail under CI (`CI=true`) and are skipped elsewhere, like
tests/conformance/test_typescript_agent.py."""

from __future__ import annotations

import pytest

from tests.interop.node import NodeProject, install


@pytest.fixture(scope="session")
def node_project(tmp_path_factory: pytest.TempPathFactory) -> NodeProject:
    return install(tmp_path_factory.mktemp("ts-interop"))
