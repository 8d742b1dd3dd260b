"""Every page of docs/ reads as plain markdown in the repository: code is in the page (no
include line, no marker a code host shows raw or hides with nothing in its place), API links
have their definitions, and what scripts/render_docs.py generates is current."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
PARTS = ("file", "code", "cli", "api")


def test_the_generated_parts_are_current() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "render_docs.py"), "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_a_page_shows_its_code_and_no_raw_include(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"^\s*--8<--", text, re.M), "a snippet include line"
    assert not re.search(r"^::: ", text, re.M), "a mkdocstrings directive outside a comment"
    for part in PARTS:
        # every generated part holds something between its two markers
        empty = re.search(
            rf"^<!-- {part}:[^\n]*(?:\n    [^\n]*)*\n?-->?\n<!-- /{part} -->", text, re.M
        )
        assert empty is None, f"an empty {part} part: {empty.group(0) if empty else ''}"
        opened = len(re.findall(rf"^<!-- {part}: ", text, re.M))
        assert opened == len(re.findall(rf"^<!-- /{part} -->$", text, re.M)), part
    for ref in set(re.findall(r"\]\[(acp_once[\w.]*)\]", text)):
        assert re.search(rf"^\[{re.escape(ref)}\]: \S+\.md$", text, re.M), f"no link for {ref}"
    assert not re.search(r"\]\[\]", text), "a collapsed reference link"


def test_the_quickstart_opens_the_docs_home() -> None:
    home = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    first = re.findall(r"^## (.+)$", home, re.M)[0]
    assert first == "Quickstart"
    quickstart = home.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    for step in (
        "**Install**",
        "**Write an agent**",
        "**Run it**",
        "**Drive it**",
        "**Put it in Zed**",
    ):
        assert step in quickstart
    agent = (ROOT / "examples" / "my_agent.py").read_text(encoding="utf-8")
    assert agent in quickstart
    assert len([line for line in agent.splitlines() if line.strip()]) <= 15
