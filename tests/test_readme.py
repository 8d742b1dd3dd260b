"""The README shows real, tested code and a current retry table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("example", ["echo_agent.py", "client.py", "session_agent.py"])
def test_readme_shows_the_examples_verbatim(example: str) -> None:
    source = (ROOT / "examples" / example).read_text(encoding="utf-8")
    body = source.split('"""', 2)[2].lstrip("\n")  # the file without its docstring
    assert f"# examples/{example}\n{body}" in README


def test_readme_retry_table_is_current() -> None:
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "render_retry_table.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_readme_names_the_two_commands() -> None:
    assert "python3 dev.py demo" in README
    assert "python3 dev.py test" in README
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 dev.py test" in ci


def test_client_example_runs_against_the_agent_example() -> None:
    done = subprocess.run(
        [sys.executable, "examples/client.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("inserted as ")


def test_session_agent_example_serves_a_keyed_prompt(tmp_path: Path) -> None:
    import anyio

    from acp_once.client import AcpClient, StdioLauncher

    async def go() -> None:
        store = f"sqlite:{tmp_path / 'chosen.db'}"
        launcher = StdioLauncher(
            [sys.executable, str(ROOT / "examples" / "session_agent.py"), store],
            cwd=str(tmp_path),
        )
        async with AcpClient(launcher) as client:
            session = await client.new_session(str(tmp_path))
            first = await session.prompt("hello", idempotency_key="k-1")
            assert await session.prompt("hello", idempotency_key="k-1") == first

    anyio.run(go)
    # the path the user chose, and nothing in the working directory
    assert (tmp_path / "chosen.db").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("sessions")) == []
