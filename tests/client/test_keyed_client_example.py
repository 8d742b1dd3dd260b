"""`examples/keyed_client.py` runs as documented: a keyed prompt waited for to the end of its
turn, a turn interrupted by an agent restart, the key sent again inserting nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent.parent


def test_keyed_client_example_survives_an_agent_restart() -> None:
    done = subprocess.run(
        [sys.executable, "examples/keyed_client.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 5, done.stdout
    message_id = lines[0].removeprefix("inserted as ")
    assert message_id.startswith("msg_user_")
    assert lines[1:] == [
        "turn ended: end_turn: Summarise the release notes",
        "interrupted turn ended: error",
        f"the same key again: {message_id}",
        "after the restart: Still there?",
    ]
