"""The command line's logging: one format, `-v` / `--log-level` on every command, uvicorn's
INFO records only when asked for, and the startup URL as one INFO line."""

from __future__ import annotations

import os
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


@pytest.mark.parametrize(
    ("command", "choices"),
    [
        (["agent"], ["<hold|steer>", "<report|continue>", "<reference|langgraph|v1>"]),
        (["serve"], ["<hold|steer>", "<report|continue>", "<debug|info|warning|error>"]),
        (["demo"], ["<stdio|ws|http>"]),
    ],
)
def test_help_lists_the_choices(command: list[str], choices: list[str]) -> None:
    helped = subprocess.run(
        [sys.executable, "-m", "acp_once", *command, "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert helped.returncode == 0, helped.stderr
    for choice in choices:
        assert choice in helped.stdout, (choice, helped.stdout)


def test_a_choice_outside_the_list_is_a_usage_error() -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "acp_once", "agent", "--policy", "queue"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert refused.returncode == 2
    assert "hold" in refused.stderr and "steer" in refused.stderr, refused.stderr


def test_help_text_reflows_to_the_terminal() -> None:
    """The docstrings' own line breaks are not kept: a wide terminal gets long lines."""
    helped = subprocess.run(
        [sys.executable, "-m", "acp_once", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )
    flat = " ".join(helped.stdout.split())
    assert "Without a token it listens on loopback addresses only. On a PostgreSQL store" in flat
    assert any(len(line.rstrip()) > 120 for line in helped.stdout.splitlines())
