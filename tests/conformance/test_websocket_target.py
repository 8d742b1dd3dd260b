"""`acp-once check ws://...`: the suite against a server over WebSocket (fresh connections per
check, the restart trace skipped), and a server that ignores keys fails the right ids."""

from __future__ import annotations

import contextlib
import io
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import pytest
import uvicorn
from rich.console import Console

from acp_once.agent import CallContext
from acp_once.agent.reference import ReferenceAgent
from acp_once.cli.check import run_check
from acp_once.client import WebSocketLauncher
from acp_once.conformance import CHECKS, Status, run_suite
from acp_once.protocol import schema as s
from acp_once.server import DEFAULT_MAX_MESSAGE_BYTES, create_app
from acp_once.server.listen import uvicorn_config
from acp_once.server.run import reference_factory, serve_agent
from acp_once.storage import open_store
from tests.remote.harness import listening_socket

SLOW = "[work:1]"
TOKEN = "conformance-token"
T3 = "trace.T3-agent-restart"

Serve = Callable[[int, object, Callable[[uvicorn.Server], None]], Awaitable[None]]


@contextlib.contextmanager
def served_in_thread(serve: Serve) -> Iterator[str]:
    """Run `serve(port, sock, on_server)` on its own event loop in a thread (`run_check` runs
    one of its own in this thread); yields the URL; stops uvicorn on the way out."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    servers: list[uvicorn.Server] = []
    errors: list[BaseException] = []

    def main() -> None:
        try:
            anyio.run(serve, port, sock, servers.append)
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    try:
        yield f"ws://127.0.0.1:{port}/acp"
    finally:
        for server in servers:
            server.should_exit = True
        thread.join(20)
        sock.close()
    assert not thread.is_alive(), "the server did not stop"
    assert not errors, errors


def _check(url: str, tmp: Path, *, token: str | None) -> tuple[int, dict[str, dict[str, str]], str]:
    buffer = io.StringIO()
    code = run_check(
        target=url,
        command=[],
        token=token,
        json_report=tmp / "report.json",
        junit=None,
        slow_prompt=SLOW,
        timeout=10,
        console=Console(file=buffer, width=160),
    )
    data = json.loads((tmp / "report.json").read_text())
    results = {r["id"]: {"status": r["status"], "message": r["message"]} for r in data["results"]}
    return code, results, buffer.getvalue()


@pytest.mark.slow
def test_acp_once_serve_passes_every_check_over_websocket_with_the_restart_skipped(
    tmp_path: Path,
) -> None:
    async def serve(port: int, sock: object, on_server: Callable[[uvicorn.Server], None]) -> None:
        await serve_agent(
            reference_factory(side_effects=tmp_path / "effects"),
            host="127.0.0.1",
            port=port,
            store=f"sqlite:{tmp_path / 'agent.sqlite3'}",
            token=TOKEN,
            max_connections=100,
            max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
            sock=sock,  # type: ignore[arg-type]
            on_server=on_server,
        )

    with served_in_thread(serve) as url:
        code, results, out = _check(url, tmp_path, token=TOKEN)
        refused, refusal = _check_with_a_wrong_token(url)
    assert list(results) == [c.id for c in CHECKS]
    not_passed = {i: r for i, r in results.items() if r["status"] != "passed"}
    assert set(not_passed) == {T3}, out
    assert not_passed[T3]["status"] == "skipped"
    assert "cannot be killed and restarted" in not_passed[T3]["message"]
    assert results["trace.T2-new-connection"]["status"] == "passed"
    assert code == 0, out
    assert f"target: websocket: {url}" in out
    assert TOKEN not in out
    assert refused == 2
    assert "401" in refusal, refusal


def _check_with_a_wrong_token(url: str) -> tuple[int, str]:
    """The server refuses the upgrade: nothing is run, exit 2."""
    buffer = io.StringIO()
    code = run_check(
        target=url,
        command=[],
        token="wrong",
        json_report=None,
        junit=None,
        slow_prompt=SLOW,
        timeout=10,
        console=Console(file=buffer, width=160),
    )
    return code, buffer.getvalue()


class IgnoreKeys(ReferenceAgent):
    async def prompt(self, params: s.PromptRequest, ctx: CallContext) -> s.PromptResponse:
        return await super().prompt(params.model_copy(update={"idempotency_key": None}), ctx)


@pytest.mark.slow
def test_a_server_that_ignores_keys_fails_over_websocket(tmp_path: Path) -> None:
    async def serve(port: int, sock: object, on_server: Callable[[uvicorn.Server], None]) -> None:
        async with (
            open_store(f"sqlite:{tmp_path / 'agent.sqlite3'}") as store,
            IgnoreKeys(store, side_effects=tmp_path / "effects") as agent,
        ):
            config = uvicorn_config(
                create_app(agent),
                host="127.0.0.1",
                port=port,
                max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
                log_level="warning",
            )
            server = uvicorn.Server(config)
            on_server(server)
            await server.serve([sock])  # type: ignore[list-item]

    with served_in_thread(serve) as url:
        code, _, out = _check(url, tmp_path, token=None)  # every check, through the CLI
        report = anyio.run(
            lambda: run_suite(
                WebSocketLauncher(url),
                slow_prompt=SLOW,
                select=["key.case-sensitive", "trace.T1-*", "trace.T2-*", "trace.T3-*"],
                timeout=10,
            )
        )
    assert code == 1, out
    assert "FAILED: a MUST requirement is broken" in out
    assert report.failed_ids() == {"trace.T1-same-connection", "trace.T2-new-connection"}
    assert report.by_id("key.case-sensitive").status is Status.PASSED
    assert report.by_id(T3).status is Status.SKIPPED
    assert report.exit_code == 1
    for failed in report.failed_ids():
        connections = {frame["conn"] for frame in report.by_id(failed).transcript}
        assert connections, "a failed check keeps its wire transcript"
    assert len({f["conn"] for f in report.by_id("trace.T2-new-connection").transcript}) >= 2
