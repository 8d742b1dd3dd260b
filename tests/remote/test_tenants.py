"""Tenants over a real `acp-once serve --tokens FILE` process (issue 20, item 7): two tenants
on one server cannot list, resume, prompt into, fork, close or delete each other's sessions
nor probe their keys; SIGHUP reloads the file. On memory and SQLite here; PostgreSQL with two
nodes in tests/cluster/test_tenants.py."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
from typer.testing import CliRunner

from acp_once.cli.app import app
from acp_once.client import Client, ClientSideConnection
from acp_once.protocol.errors import AcpError
from acp_once.rpc.errors import ConnectionClosed
from acp_once.transports.http import CONNECTION_ID_HEADER
from acp_once.transports.websocket import WebSocketRejected, connect_websocket
from tests.helpers import initialize_request
from tests.remote.harness import listening_socket, running
from tests.remote.test_http import SSE, Raw, new_session, request

pytestmark = pytest.mark.anyio

TIMEOUT = 20
SESSION_NOT_FOUND = -32002
ALICE, BOB, CAROL = "alice-token-1", "bob-token-2", "carol-token-3"


class TenantServer:
    """`acp-once serve --tokens FILE` on a pre-bound loopback socket (clients wait in its
    backlog: nothing waits for "started"); its stderr lines are read as they come, so a test
    can wait for the line that says a reload took effect."""

    def __init__(
        self, tmp: Path, store: str, tokens: Path, env: dict[str, str] | None = None
    ) -> None:
        self.env = env
        self.sock = listening_socket()
        self.url = f"ws://127.0.0.1:{self.sock.getsockname()[1]}/acp"
        fd = self.sock.fileno()
        self.command = [
            sys.executable, "-m", "acp_once", "serve", "--store", store,
            "--side-effects", str(tmp / "effects"), "--fd", str(fd), "--tokens", str(tokens),
        ]  # fmt: skip
        self.lines: list[str] = []
        self._arrived = anyio.Event()
        self.process: anyio.abc.Process | None = None

    @contextlib.asynccontextmanager
    async def run(self) -> AsyncIterator[TenantServer]:
        fd = self.sock.fileno()
        async with (
            await anyio.open_process(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=(fd,),
                env=self.env,
            ) as process,
            anyio.create_task_group() as tg,
        ):
            self.process = process
            tg.start_soon(self._read, process)
            try:
                yield self
            finally:
                process.kill()
                tg.cancel_scope.cancel()
                self.sock.close()

    async def _read(self, process: anyio.abc.Process) -> None:
        assert process.stderr is not None
        pending = b""
        async for chunk in process.stderr:
            pending += chunk
            *complete, pending = pending.split(b"\n")
            self.lines.extend(line.decode(errors="replace") for line in complete)
            self._arrived.set()
            self._arrived = anyio.Event()

    async def wait_for_line(self, text: str, after: int) -> None:
        """Wait (bounded by the caller) for a stderr line containing `text` past `after`."""
        while not any(text in line for line in self.lines[after:]):
            await self._arrived.wait()

    async def sighup(self, text: str) -> None:
        """Send SIGHUP and wait for the log line `text` that says it was handled."""
        assert self.process is not None
        seen = len(self.lines)
        self.process.send_signal(signal.SIGHUP)
        await self.wait_for_line(text, seen)


@contextlib.asynccontextmanager
async def tenant(url: str, token: str) -> AsyncIterator[ClientSideConnection]:
    async with (
        connect_websocket(url, token=token) as frames,
        ClientSideConnection(Client(), frames) as conn,
    ):
        await conn.agent.initialize(initialize_request("t"))
        yield conn


def prompt(sid: str, key: str) -> dict[str, Any]:
    return {"sessionId": sid, "prompt": [{"type": "text", "text": "hi"}], "idempotencyKey": key}


async def refused(conn: ClientSideConnection, method: str, params: dict[str, Any]) -> str:
    with pytest.raises(AcpError) as info:
        await conn.rpc.request(method, params)
    assert info.value.code == SESSION_NOT_FOUND, (method, info.value)
    return str(info.value)


async def listed(conn: ClientSideConnection) -> set[str]:
    result = await conn.rpc.request("session/list", {})
    return {entry["sessionId"] for entry in result["sessions"]}


async def check_isolation(alice_url: str, bob_url: str) -> None:
    """Alice's session is invisible to bob (on `bob_url`, maybe another node) as if it did
    not exist, and is unchanged by all he tries; then the same the other way round."""
    async with tenant(alice_url, ALICE) as alice, tenant(bob_url, BOB) as bob:
        alice_had, bob_had = await listed(alice), await listed(bob)  # from earlier calls
        assert alice_had.isdisjoint(bob_had)
        sid = (await alice.rpc.request("session/new", {"cwd": "/w"}))["sessionId"]
        first = (await alice.rpc.request("session/prompt", prompt(sid, "k1")))["messageId"]
        bob_sid = (await bob.rpc.request("session/new", {"cwd": "/w"}))["sessionId"]
        assert await listed(alice) == alice_had | {sid}
        assert await listed(bob) == bob_had | {bob_sid}
        missing = "sess_never_was"
        for method, params in [
            ("session/resume", {"sessionId": sid, "cwd": "/w"}),
            ("session/prompt", prompt(sid, "k1")),  # a probe of alice's key
            ("session/prompt", prompt(sid, "k2")),
            ("session/fork", {"sessionId": sid, "cwd": "/w"}),
        ]:
            text = await refused(bob, method, params)
            as_missing = await refused(bob, method, {**params, "sessionId": missing})
            assert text == as_missing.replace(missing, sid)  # the same answer, word for word
        await bob.rpc.request("session/close", {"sessionId": sid})  # as for a missing one
        await bob.rpc.request("session/delete", {"sessionId": sid})
        await refused(alice, "session/resume", {"sessionId": bob_sid, "cwd": "/w"})
    # alice's session survived bob's delete, with its one message and its key
    async with tenant(alice_url, ALICE) as alice:
        await alice.rpc.request("session/resume", {"sessionId": sid, "cwd": "/w"})
        assert (await alice.rpc.request("session/prompt", prompt(sid, "k1")))["messageId"] == first
        assert await listed(alice) == alice_had | {sid}


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_two_tenants_on_one_server_never_meet(kind: str, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# tenants\nalice:{ALICE}\n\nbob:{BOB}\n")
    store = "memory" if kind == "memory" else f"sqlite:{tmp_path / 's.db'}"
    with anyio.fail_after(TIMEOUT):
        async with TenantServer(tmp_path, store, tokens).run() as srv:
            await check_isolation(srv.url, srv.url)


async def test_sighup_reloads_the_tokens_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    with anyio.fail_after(TIMEOUT):
        async with (
            TenantServer(tmp_path, "memory", tokens).run() as srv,
            tenant(srv.url, BOB) as bob_before,
        ):
            with pytest.raises(WebSocketRejected):
                async with connect_websocket(srv.url, token=CAROL):
                    pass
            tokens.write_text(f"alice:{ALICE}\ncarol:{CAROL}\n")
            await srv.sighup("tokens reloaded")
            with pytest.raises(WebSocketRejected) as info:
                async with connect_websocket(srv.url, token=BOB):
                    pass
            assert info.value.status == 401
            # bob's open connection was closed (tests/remote/test_revocation.py looks closer);
            # a new one of carol's gets in
            with pytest.raises((AcpError, ConnectionClosed, anyio.EndOfStream)):
                await listed(bob_before)
            async with tenant(srv.url, CAROL) as carol:
                assert await listed(carol) == set()
            # a broken file leaves the tokens as they were, and the log names no token
            tokens.write_text(f"carol {CAROL}\n")
            await srv.sighup("tokens not reloaded")
            async with tenant(srv.url, CAROL), tenant(srv.url, ALICE):
                pass
    assert not any(token in line for line in srv.lines for token in (ALICE, BOB, CAROL))


def _usage_error(args: list[str], env: dict[str, str] | None = None) -> str:
    """The CLI's usage error for `args` (exit 2), unwrapped from its box."""
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 2, result.output
    return re.sub(r"[\s│╭╮╰╯─]+", " ", result.output)


def test_serve_and_bridge_refuse_what_they_cannot_do(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice:{ALICE}\n")
    assert "not both" in _usage_error(["serve", "--token", "t", "--tokens", str(tokens)])
    env = {"ACP_ONCE_TOKEN": "t"}
    assert "not both" in _usage_error(["serve", "--tokens", str(tokens)], env)
    tokens.write_text(f"alice:{ALICE}\nalice:{BOB}\n")
    bad = _usage_error(["serve", "--tokens", str(tokens)])
    assert "line 2" in bad and "appears twice" in bad and BOB not in bad
    bridged = _usage_error(["bridge", "--tokens", str(tokens), "--", "true"])
    assert "line 2" in bridged and "appears twice" in bridged and BOB not in bridged
    bridged = _usage_error(["bridge", "--tokens", str(tokens), "--", "true"], env)
    assert "not both" in bridged


async def test_a_streamable_http_connection_is_its_tenants_alone(tmp_path: Path) -> None:
    """Another tenant's POST, GET and DELETE on a connection id get 404, as an unknown id does;
    a session created over HTTP belongs to the tenant that opened the connection."""
    tenants = {"alice": ALICE, "bob": BOB}
    timeout = httpx.Timeout(TIMEOUT, read=None)
    with anyio.fail_after(TIMEOUT):
        async with (
            running(tmp_path, app_options={"tokens": tenants}) as srv,
            httpx.AsyncClient(timeout=timeout, headers={"Authorization": f"Bearer {ALICE}"}) as a,
            httpx.AsyncClient(timeout=timeout, headers={"Authorization": f"Bearer {BOB}"}) as b,
        ):
            alice = Raw(a, f"{srv.http}/acp")
            await alice.initialize()
            async with alice.stream() as stream:
                sid = await new_session(alice, stream)
            record = await srv.agent.store.get_session(sid)
            assert record is not None and record.tenant == "alice"
            as_bob = Raw(b, alice.url)
            as_bob.cid = alice.cid
            listing = request(5, "session/list", {})
            assert (await as_bob.post(listing)).status_code == 404
            streamed = await b.get(alice.url, headers={**SSE, CONNECTION_ID_HEADER: alice.cid})
            assert streamed.status_code == 404
            deleted = await b.delete(alice.url, headers={CONNECTION_ID_HEADER: alice.cid})
            assert deleted.status_code == 404
            assert (await alice.post(listing)).status_code == 202  # still alice's, still open
