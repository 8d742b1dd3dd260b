"""The README shows real, tested code, stays short, and keeps a current retry table."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
# the README's own examples; the guides include the others (and these) whole
README_EXAMPLES = ["quickstart_agent.py", "quickstart_client.py"]


def body(example: str) -> str:
    """The example's source without its docstring: what the README shows."""
    source = (ROOT / "examples" / example).read_text(encoding="utf-8")
    return source.split('"""', 2)[2].lstrip("\n")


@pytest.mark.parametrize("example", README_EXAMPLES)
def test_readme_shows_the_examples_verbatim(example: str) -> None:
    block = f"```python\n# examples/{example}\n{body(example)}```\n"
    assert block in README


@pytest.mark.parametrize(
    ("example", "most"), [("quickstart_agent.py", 15), ("quickstart_client.py", 10)]
)
def test_readme_examples_are_as_short_as_their_headings_say(example: str, most: int) -> None:
    code = [line for line in body(example).splitlines() if line.strip()]
    assert len(code) <= most, code
    heading = "## An agent in 15 lines" if most == 15 else "## A client in 10 lines"
    assert heading in README


def test_readme_examples_are_formatted_and_lint_clean() -> None:
    # as the rest of the code (the README shows them verbatim)
    paths = [str(ROOT / "examples" / e) for e in README_EXAMPLES]
    for args in (["format", "--check", *paths], ["check", *paths]):
        ruff = [sys.executable, "-m", "ruff", *args]
        done = subprocess.run(ruff, cwd=ROOT, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


def test_readme_stays_a_front_door() -> None:
    assert len(README.splitlines()) <= 300
    for heading in (
        "## Install",
        "## The two commands",
        "## Retry classes",
        "## Documentation",
    ):
        assert f"\n{heading}\n" in README
    # every local link of the README points at a file that is there
    for target in re.findall(r"\]\(((?:docs|benchmarks|examples)/[^)#\s]+)", README):
        assert (ROOT / target).exists(), target


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


def test_readme_client_runs_against_the_readme_agent(tmp_path: Path) -> None:
    # run as the README says (from the repository's root), in a copy, so that the agent's
    # store and the client's outbox land in a temporary directory
    (tmp_path / "examples").mkdir()
    for example in README_EXAMPLES:
        shutil.copy(ROOT / "examples" / example, tmp_path / "examples" / example)
    done = subprocess.run(
        [sys.executable, "examples/quickstart_client.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"inserted as \S+ then: you said: hello\n", done.stdout), done.stdout
    assert (tmp_path / "sessions.db").exists() and (tmp_path / "outbox.db").exists()


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
