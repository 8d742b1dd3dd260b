"""The launchers check what they are given when built, and never show a token."""

from __future__ import annotations

import sys

import pytest

from acp_once.client import HttpLauncher, StdioLauncher, WebSocketLauncher


def test_a_stdio_launcher_refuses_an_empty_command() -> None:
    with pytest.raises(ValueError, match="empty"):
        StdioLauncher([])


@pytest.mark.parametrize(
    ("launcher", "url"),
    [
        (WebSocketLauncher, "http://127.0.0.1:1/acp"),
        (WebSocketLauncher, "127.0.0.1:1/acp"),
        (HttpLauncher, "ws://127.0.0.1:1/acp"),
        (HttpLauncher, "ftp://127.0.0.1:1/acp"),
    ],
)
def test_a_remote_launcher_refuses_another_scheme(
    launcher: type[WebSocketLauncher | HttpLauncher], url: str
) -> None:
    with pytest.raises(ValueError, match="URL"):
        launcher(url, "secret-token")


@pytest.mark.parametrize(
    "launcher",
    [
        WebSocketLauncher("wss://example.invalid/acp", "secret-token"),
        HttpLauncher("https://example.invalid/acp", "secret-token"),
    ],
)
def test_a_remote_launcher_never_shows_its_token(launcher: object) -> None:
    assert "secret-token" not in repr(launcher)
    assert "example.invalid" in repr(launcher)


def _current(launcher: StdioLauncher) -> object:
    return launcher.current  # read afresh: the context managers change it


@pytest.mark.anyio
async def test_a_stdio_launcher_tracks_its_current_process() -> None:
    launcher = StdioLauncher([sys.executable, "-c", "import sys; sys.stdin.read()"])
    async with launcher.launch() as proc:
        assert _current(launcher) is proc
        assert launcher.connects == 1
    assert _current(launcher) is None
    assert proc.returncode is not None  # stopped on the way out
    async with launcher.connect():
        assert launcher.connects == 2
