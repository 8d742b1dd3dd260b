"""Errors that name their cause in one line: a refused token (401), a URL without /acp (404),
nothing listening, for `prompt`, `check` and `AcpClient`; `ACP_ONCE_TOKEN` taken by `check`; a
store that cannot be opened; Ctrl-C. Real subprocesses and sockets on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

pytest.importorskip("uvicorn")

from acp_once.cli.reasons import unreachable
from acp_once.client import AcpClient, HttpLauncher, WebSocketLauncher
from acp_once.rpc.errors import ConnectionClosed
from acp_once.transports.websocket import WebSocketRejected

URL = re.compile(r"ws://127\.0\.0\.1:(\d+)/acp")
TOKEN = "s3cret-token"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ACP_ONCE_TOKEN"}
    env["COLUMNS"] = "200"
    return env | extra


def acp_once(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "acp_once", *args],
        env=_env(**env), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """`acp-once serve` with a token on a free port (killed after 120 s whatever happens)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "acp_once", "serve", "--port", "0", "--store", "memory:"],
        env=_env(ACP_ONCE_TOKEN=TOKEN), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if found := URL.search(line):
                break
        else:
            raise AssertionError("serve did not start")
        yield int(found.group(1))
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    text = (done.stdout + done.stderr).strip()
    assert "Traceback" not in text, text
    return text.splitlines()[-1]


@pytest.mark.parametrize("scheme", ["ws", "http"])
def test_prompt_and_check_name_a_refused_token(port: int, scheme: str) -> None:
    url = f"{scheme}://127.0.0.1:{port}/acp"
    for done in (acp_once("prompt", "hi", "--agent", url), acp_once("check", url)):
        assert done.returncode in (1, 2)
        line = _one_line(done)
        assert "the server refused the token (HTTP 401): check --token or ACP_ONCE_TOKEN" in line
        assert "Connection lost" not in line


@pytest.mark.parametrize(("scheme", "path"), [("ws", "/"), ("ws", ""), ("http", "/agent")])
def test_a_url_without_acp_is_said_to_be_the_wrong_path(port: int, scheme: str, path: str) -> None:
    url = f"{scheme}://127.0.0.1:{port}{path}"
    for done in (
        acp_once("prompt", "hi", "--agent", url, ACP_ONCE_TOKEN=TOKEN),
        acp_once("check", url, ACP_ONCE_TOKEN=TOKEN),
    ):
        line = _one_line(done)
        assert "no ACP endpoint at the path" in line and "(HTTP 404)" in line, line
        assert f"e.g. {scheme}://127.0.0.1:{port}/acp" in line
        assert "token" not in line


def test_nothing_listening_is_said_so() -> None:
    url = f"ws://127.0.0.1:{_closed_port()}/acp"
    for done in (acp_once("prompt", "hi", "--agent", url), acp_once("check", url)):
        line = _one_line(done)
        assert f"connection refused: nothing listens at {url[5:-4]}" in line, line


def test_check_takes_the_token_from_acp_once_token(port: int) -> None:
    url = f"ws://127.0.0.1:{port}/acp"
    done = acp_once("check", url, "--only", "init.version", ACP_ONCE_TOKEN=TOKEN)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_403_is_not_blamed_on_the_token() -> None:
    line = unreachable(WebSocketRejected("The server refused the WebSocket: HTTP 403", 403))
    assert "HTTP 403" in line and "Origin or Host" in line and "token" not in line


def test_acp_client_names_the_cause(port: int) -> None:
    async def first_connect(launcher: WebSocketLauncher | HttpLauncher) -> BaseException:
        with pytest.raises((OSError, ConnectionClosed)) as caught:
            with anyio.fail_after(30):
                async with AcpClient(launcher):
                    pass
        return caught.value

    base = f"127.0.0.1:{port}"
    ws_401 = anyio.run(first_connect, WebSocketLauncher(f"ws://{base}/acp"))
    assert "HTTP 401: missing or wrong bearer token" in str(ws_401)
    ws_404 = anyio.run(first_connect, WebSocketLauncher(f"ws://{base}/", TOKEN))
    assert "HTTP 404: no ACP endpoint at this path" in str(ws_404)
    http_401 = anyio.run(first_connect, HttpLauncher(f"http://{base}/acp"))
    assert isinstance(http_401, ConnectionClosed)
    http_refused = anyio.run(first_connect, HttpLauncher(f"http://127.0.0.1:{_closed_port()}/acp"))
    assert "Could not connect: ConnectError: All connection attempts failed" in str(http_refused)
    assert "Could not connect: initialize: HTTP 401: missing or wrong bearer token" in str(http_401)


@pytest.mark.parametrize("command", ["agent", "serve"])
def test_a_store_that_cannot_be_opened_is_one_line(tmp_path: Path, command: str) -> None:
    not_a_db = tmp_path / "not.db"
    not_a_db.write_text("this is no SQLite database\n" * 100)
    for store, cause in [
        ("sqlite:/proc/nope/x.db", "/proc/nope: cannot create the store's directory: No such"),
        (f"sqlite:{not_a_db}", f"{not_a_db}: cannot open the database: file is not a database"),
    ]:
        args = [command, "--store", store] + (["--port", "0"] if command == "serve" else [])
        done = acp_once(*args)
        assert done.returncode == 1
        assert len(done.stderr.splitlines()) == 1, done.stderr
        assert done.stderr.startswith(f"acp-once {command}: {cause}"), done.stderr
        verbose = acp_once(*args, "-v")
        assert verbose.returncode == 1 and "Traceback" in verbose.stderr


def test_an_outbox_that_cannot_be_opened_is_one_line() -> None:
    agent = f"{sys.executable} -m acp_once agent --store memory:"
    done = acp_once("prompt", "hi", "--agent", agent, "--outbox", "/proc/nope/outbox.db")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "acp-once prompt: /proc/nope/outbox.db: cannot create the outbox: [Errno 2] No such "
        "file or directory: '/proc/nope'"
    ]


def test_ctrl_c_ends_a_command_quietly_with_130() -> None:
    agent = f"{sys.executable} -m acp_once agent --store memory:"
    proc = subprocess.Popen(
        [sys.executable, "-m", "acp_once", "prompt", "[work:60]", "--agent", agent],
        env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("state running"):  # the turn runs: the command is waiting
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
