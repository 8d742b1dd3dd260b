"""The command line's logging: one format, `-v` / `--log-level` on every command, uvicorn's
INFO records only when asked for, and the startup URL as one INFO line."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("uvicorn")

# "2026-12-04 01:47:33,601 INFO acp_once.server.address ACP over WebSocket at ws://..."
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) \S+ ")
URL = re.compile(
    r" INFO acp_once\.server\.address ACP over WebSocket at ws://127\.0\.0\.1:(\d+)/acp "
)


@contextmanager
def serving(*options: str) -> Iterator[subprocess.Popen[str]]:
    """`acp-once OPTIONS` as a subprocess (killed after 30 s whatever happens)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "acp_once", *options],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(30, proc.kill)
    watchdog.start()
    try:
        yield proc
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    assert proc.stderr is not None
    rest = proc.stderr.read()
    return proc.wait(), rest


def test_serve_at_warning_shows_the_url_once_and_no_uvicorn_info() -> None:
    with serving("serve", "--port", "0", "--store", "memory:", "--log-level", "warning") as proc:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        found = URL.search(first)
        assert found and LINE.match(first), first
        # the server answers: uvicorn's startup records would have been written by now
        health = f"http://127.0.0.1:{found.group(1)}/healthz"
        with urllib.request.urlopen(health, timeout=10) as answer:
            assert answer.status == 200
        code, rest = stop(proc)
    assert code == 0
    assert "uvicorn" not in rest and "ACP over WebSocket" not in rest, rest


@pytest.mark.parametrize(
    "command",
    [
        ["serve", "-v", "--port", "0", "--store", "memory:"],
        ["-v", "serve", "--port", "0", "--store", "memory:"],  # before the command
        [
            "bridge",
            "--log-level",
            "info",
            "--port",
            "0",
            "--",
            sys.executable,
            "-m",
            "acp_once",
            "agent",
            "--store",
            "memory:",
        ],
    ],
)
def test_verbose_shows_the_url_and_uvicorn_in_one_format(command: list[str]) -> None:
    with serving(*command) as proc:
        assert proc.stderr is not None
        lines: list[str] = []
        while not any("Application startup complete" in line for line in lines):
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        code, rest = stop(proc)
    assert code == 0
    lines += rest.splitlines(keepends=True)
    assert sum(bool(URL.search(line)) for line in lines) == 1, "".join(lines)
    assert any(" INFO uvicorn.error Started server process" in line for line in lines)
    for line in lines:  # one format for acp-once's records and uvicorn's
        assert LINE.match(line), line


def test_every_command_takes_verbose_and_log_level() -> None:
    for command in (
        ["agent"],
        ["serve"],
        ["bridge"],
        ["prompt"],
        ["check"],
        ["demo"],
        ["status"],
        ["db", "migrate"],
        ["db", "status"],
        [],
    ):
        helped = subprocess.run(
            [sys.executable, "-m", "acp_once", *command, "--help"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert helped.returncode == 0, helped.stderr
        flat = " ".join(helped.stdout.replace("│", " ").split())
        assert "--verbose" in flat and "--log-level" in flat, (command, flat)
