"""`acp-once check http://...`: the suite against `acp-once serve` over Streamable HTTP (a new
ACP connection per check, the restart trace skipped)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import uvicorn

from acp_once.conformance import CHECKS
from acp_once.server import DEFAULT_MAX_MESSAGE_BYTES
from acp_once.server.run import reference_factory, serve_agent
from tests.conformance.test_websocket_target import T3, TOKEN, _check, served_in_thread


@pytest.mark.slow
def test_acp_once_serve_passes_every_check_over_streamable_http(tmp_path: Path) -> None:
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

    with served_in_thread(serve) as ws_url:
        url = ws_url.replace("ws://", "http://", 1)
        code, results, out = _check(url, tmp_path, token=TOKEN)
    assert list(results) == [c.id for c in CHECKS]
    not_passed = {i: r for i, r in results.items() if r["status"] != "passed"}
    batches = {c.id for c in CHECKS if c.id.startswith("batch.")}  # D43: none over HTTP
    assert len(batches) == 4 and set(not_passed) == {T3} | batches, out
    assert all(not_passed[i]["status"] == "skipped" for i in {T3} | batches)
    assert results["trace.T2-new-connection"]["status"] == "passed"
    assert results["privacy.no-key-in-frames"]["status"] == "passed"
    assert code == 0, out
    assert f"target: streamable http: {url}" in out
    assert TOKEN not in out
