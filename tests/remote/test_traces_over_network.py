"""The RFD's seven traces over WebSocket and Streamable HTTP, through a fault-injecting proxy.

`acp-once serve` runs as a real subprocess on SQLite; `FaultProxy` sits between it and the
client and resets the connection carrying the agent's answer, i.e. after the insertion and
before the client reads the answer. T3 also kills the server with SIGKILL and starts it again
on the same database. Every test counts, in the server's store, the user messages of each
session (and the lines of the side-effect log for `[tool]` prompts): each submission is
inserted exactly once. The answer the proxy cut is kept by its rule, so a retry is checked
against the very message id the client never read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import anyio
import httpx
import pytest

from acp_once.client import AcpClient, ClientSideConnection, HttpLauncher, WebSocketLauncher
from acp_once.faultproxy import (
    FaultProxy,
    answer_with_message_id,
    nth_message,
    request_with_method,
)
from acp_once.protocol import schema as s
from acp_once.protocol.errors import REQUEST_CANCELLED, RESOURCE_NOT_FOUND, AcpError
from acp_once.rpc.errors import ConnectionClosed
from acp_once.rpc.streams import FrameStream
from acp_once.transports.http import CONNECTION_ID_HEADER, SESSION_ID_HEADER, connect_http
from acp_once.transports.websocket import connect_websocket
from tests.helpers import UpdateRecorder, initialize_request
from tests.remote.harness import ServeProcess
from tests.remote.test_websocket import FAST

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

TIMEOUT = 60
KEY = "net-key-5c1f"
Transport = Literal["ws", "http"]
TRANSPORTS = pytest.mark.parametrize("transport", ["ws", "http"])


class Net:
    """A served agent behind a proxy, and raw ACP connections to it."""

    def __init__(self, server: ServeProcess, proxy: FaultProxy, transport: Transport) -> None:
        self.server = server
        self.proxy = proxy
        self.transport = transport

    @asynccontextmanager
    async def connect(
        self, recorder: UpdateRecorder | None = None, *, direct: bool = False
    ) -> AsyncIterator[ClientSideConnection]:
        """An initialized connection through the proxy (`direct`: to the server itself)."""
        port = self.server.port if direct else self.proxy.port
        scheme = "ws" if self.transport == "ws" else "http"
        url = f"{scheme}://127.0.0.1:{port}/acp"
        frames: AbstractAsyncContextManager[FrameStream] = (
            connect_websocket(url) if self.transport == "ws" else connect_http(url)
        )
        async with (
            frames as stream,
            ClientSideConnection(recorder or UpdateRecorder(), stream) as conn,
        ):
            await conn.agent.initialize(initialize_request("traces"))
            yield conn


@asynccontextmanager
async def net(tmp: Path, transport: Transport, *extra: str) -> AsyncIterator[Net]:
    async with (
        ServeProcess(tmp, *extra) as server,
        FaultProxy(("127.0.0.1", server.port)) as proxy,
    ):
        yield Net(server, proxy, transport)


def params(sid: str, text: str, key: str | None = KEY) -> dict[str, Any]:
    p: dict[str, Any] = {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}
    if key is not None:
        p["idempotencyKey"] = key
    return p


async def prompt(conn: ClientSideConnection, sid: str, text: str, key: str | None = KEY) -> str:
    result = await conn.rpc.request("session/prompt", params(sid, text, key))
    return str(result["messageId"])


async def new_session(conn: ClientSideConnection) -> str:
    return (await conn.agent.new_session(s.NewSessionRequest(cwd="/w"))).session_id


async def resume(conn: ClientSideConnection, sid: str) -> None:
    await conn.agent.resume_session(s.ResumeSessionRequest(session_id=sid, cwd="/w"))


def cut_id(message: Any) -> str:
    return str(message["result"]["messageId"])


async def lose_the_answer(n: Net, sid: str, text: str, key: str | None = KEY) -> str:
    """Submit on a new connection whose answer the proxy cuts; returns the lost message id."""
    rule = n.proxy.cut_answer(answer_with_message_id())
    async with n.connect() as conn:
        await resume(conn, sid)
        with pytest.raises(ConnectionClosed):
            await prompt(conn, sid, text, key)
    return cut_id(await rule.wait())


async def wait_idle(recorder: UpdateRecorder, after: int = 0) -> None:
    """Until an idle state_update ending a turn arrives (after the first `after` updates)."""
    await recorder.wait_for(
        lambda ups: any(
            u.get("sessionUpdate") == "state_update"
            and u.get("state") == "idle"
            and "stopReason" in u
            for u in ups[after:]
        )
    )


@TRANSPORTS
async def test_t1_retry_on_the_same_connection(tmp_path: Path, transport: Transport) -> None:
    """WebSocket: the retry on the same connection answers the same id. Streamable HTTP: the
    connection is logical, so the proxy loses the prompt POST's 202 after the server took it
    and the client resends (same key, fresh id) on the same `Acp-Connection-Id`."""
    with anyio.fail_after(TIMEOUT):
        async with net(tmp_path, transport) as n:
            if transport == "ws":
                async with n.connect() as conn:
                    sid = await new_session(conn)
                    first = await prompt(conn, sid, "deploy [tool]")
                    assert await prompt(conn, sid, "deploy [tool]") == first
            else:
                sid, first = await _t1_over_http(n)
            assert await n.server.count(sid) == 1
            assert await n.server.count(sid, KEY) == 1
            await _wait_effects(n, sid, 1)
            assert n.server.effect_lines(sid) == [first]


async def _t1_over_http(n: Net) -> tuple[str, str]:
    url = n.proxy.url("http")
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {"protocolVersion": 2, "info": {"name": "t1", "version": "1"}},
    }
    async with httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT, read=None)) as http:
        answer = await http.post(url, json=init)
        assert answer.status_code == 200
        cid = answer.headers[CONNECTION_ID_HEADER]
        sse = {"Accept": "text/event-stream", CONNECTION_ID_HEADER: cid}
        async with http.stream("GET", url, headers=sse) as conn_stream:
            lines = conn_stream.aiter_lines()
            new = {"jsonrpc": "2.0", "id": 1, "method": "session/new", "params": {"cwd": "/w"}}
            assert (
                await http.post(url, json=new, headers={CONNECTION_ID_HEADER: cid})
            ).status_code == 202
            sid = str((await _response(lines, 1))["result"]["sessionId"])
            headers = {CONNECTION_ID_HEADER: cid, SESSION_ID_HEADER: sid}
            async with http.stream("GET", url, headers={**sse, SESSION_ID_HEADER: sid}) as stream:
                session_lines = stream.aiter_lines()
                rule = n.proxy.fail_post(request_with_method("session/prompt"), reach_server=True)
                body = {"jsonrpc": "2.0", "id": 2, "method": "session/prompt"}
                with pytest.raises(httpx.TransportError):
                    await http.post(
                        url, json={**body, "params": params(sid, "deploy [tool]")}, headers=headers
                    )
                await rule.wait()
                # the server took it: its answer comes on the session stream all the same
                first = str((await _response(session_lines, 2))["result"]["messageId"])
                retry = {**body, "id": 3, "params": params(sid, "deploy [tool]")}
                assert (await http.post(url, json=retry, headers=headers)).status_code == 202
                assert (await _response(session_lines, 3))["result"]["messageId"] == first
    return sid, first


async def _response(lines: AsyncIterator[str], id_: int) -> dict[str, Any]:
    import json

    async for line in lines:
        if line.startswith("data:"):
            message: dict[str, Any] = json.loads(line[5:])
            if message.get("id") == id_ and "method" not in message:
                return message
    raise AssertionError("the stream ended")


async def _wait_effects(n: Net, sid: str, count: int) -> None:
    """Poll the side-effect log (bounded by the caller's deadline) until `count` lines."""
    while len(n.server.effect_lines(sid)) < count:  # noqa: ASYNC110 (a file, no event)
        await anyio.sleep(0.02)


@TRANSPORTS
async def test_t2_retry_after_resume_on_a_new_connection(
    tmp_path: Path, transport: Transport
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with net(tmp_path, transport) as n:
            async with n.connect() as conn:
                sid = await new_session(conn)
            lost = await lose_the_answer(n, sid, "deploy [tool]")
            async with n.connect() as conn:
                # T2': before resume the session is not active on the new connection
                with pytest.raises(AcpError) as info:
                    await prompt(conn, sid, "deploy [tool]")
                assert info.value.code == RESOURCE_NOT_FOUND
                await resume(conn, sid)
                assert await prompt(conn, sid, "deploy [tool]") == lost
            assert await n.server.count(sid) == 1
            await _wait_effects(n, sid, 1)
            assert n.server.effect_lines(sid) == [lost]
            assert n.proxy.cuts == 1


@TRANSPORTS
async def test_t3_retry_after_sigkill_and_restart_on_the_same_database(
    tmp_path: Path, transport: Transport
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with net(tmp_path, transport) as n:
            async with n.connect() as conn:
                sid = await new_session(conn)
            lost = await lose_the_answer(n, sid, "migrate [tool]")
            await n.server.restart()  # SIGKILL, then a new process on the same file and port
            assert n.server.starts == 2
            async with n.connect() as conn:
                await resume(conn, sid)
                assert await prompt(conn, sid, "migrate [tool]") == lost
                # a new submission after the restart is inserted too, once
                after = await prompt(conn, sid, "after the restart", "key-after")
                assert await prompt(conn, sid, "after the restart", "key-after") == after
            assert await n.server.count(sid) == 2
            assert await n.server.count(sid, KEY) == 1
            # the side effect ran at most once: before the kill, or not at all
            assert n.server.effect_lines(sid) in ([], [lost])


@TRANSPORTS
async def test_t4_retry_while_held(tmp_path: Path, transport: Transport) -> None:
    """A keyed prompt is held behind a running turn; a retry arrives on a second connection
    while it is held; the first connection's answer is cut after insertion. Both requests
    got the same outcome: the retry's answer is the id the cut answer carried."""
    with anyio.fail_after(TIMEOUT):
        async with net(tmp_path, transport) as n:
            recorder = UpdateRecorder()
            async with n.connect(recorder, direct=True) as b:
                sid = await new_session(b)
                await prompt(b, sid, "long [work:1.5]", None)
                rule = n.proxy.cut_answer(answer_with_message_id())
                async with n.connect() as a:
                    await resume(a, sid)
                    held = await a.rpc.start_request("session/prompt", params(sid, "held [tool]"))
                    retry = await b.rpc.start_request("session/prompt", params(sid, "held [tool]"))
                    with pytest.raises(ConnectionClosed):
                        await held.result()
                answer = await retry.result()
                assert answer["messageId"] == cut_id(await rule.wait())
                await _wait_effects(n, sid, 1)
            assert await n.server.count(sid) == 2
            assert await n.server.count(sid, KEY) == 1
            assert n.server.effect_lines(sid) == [answer["messageId"]]


@TRANSPORTS
async def test_t5_retry_after_an_error(tmp_path: Path, transport: Transport) -> None:
    """Two errors leave the key unused: `$/cancel_request` withdraws a held keyed prompt
    (-32800), and the connection of another held keyed prompt is dropped (D11: nobody can hear
    its answer, so it is withdrawn). Each retry then inserts once, its answer cut and
    recovered after resume."""
    with anyio.fail_after(TIMEOUT):
        async with net(tmp_path, transport) as n:
            async with n.connect() as conn:
                sid = await new_session(conn)
                await prompt(conn, sid, "long [work:1]", None)
                held = await conn.rpc.start_request("session/prompt", params(sid, "a [tool]"))
                await held.cancel()
                with pytest.raises(AcpError) as info:
                    await held.result()
                assert info.value.code == REQUEST_CANCELLED
            assert await n.server.count(sid, KEY) == 0
            lost = await lose_the_answer(n, sid, "a [tool]")
            async with n.connect() as conn:
                await resume(conn, sid)
                assert await prompt(conn, sid, "a [tool]") == lost
            # a held prompt whose only connection drops is withdrawn, its key unused
            recorder = UpdateRecorder()
            async with n.connect(recorder) as conn:
                await resume(conn, sid)
                seen = len(recorder.updates)
                await prompt(conn, sid, "long again [work:1]", None)
                await conn.rpc.start_request("session/prompt", params(sid, "b", "key-b"))
                await recorder.wait_for(
                    lambda ups: any(u.get("state") == "running" for u in ups[seen:])
                )
                assert n.proxy.cut_all() >= 1  # HTTP: its POST and GET connections
            async with n.connect(recorder) as conn:
                await resume(conn, sid)
                second = await prompt(conn, sid, "b", "key-b")
                assert await prompt(conn, sid, "b", "key-b") == second
            assert await n.server.count(sid, KEY) == 1
            assert await n.server.count(sid, "key-b") == 1
            assert await n.server.count(sid) == 4
            await _wait_effects(n, sid, 1)
            assert n.server.effect_lines(sid) == [lost]


@TRANSPORTS
async def test_t6_same_key_in_another_session_and_in_a_fork(
    tmp_path: Path, transport: Transport
) -> None:
    with anyio.fail_after(TIMEOUT):
        async with net(tmp_path, transport) as n:
            async with n.connect() as conn:
                a = await new_session(conn)
                b = await new_session(conn)
            lost = await lose_the_answer(n, a, "same")
            async with n.connect() as conn:
                await resume(conn, a)
                assert await prompt(conn, a, "same") == lost
                await resume(conn, b)
                in_b = await prompt(conn, b, "same")
                fork = await conn.agent.fork_session(s.ForkSessionRequest(session_id=a, cwd="/w"))
                in_fork = await prompt(conn, fork.session_id, "same")
                assert len({lost, in_b, in_fork}) == 3
                assert await prompt(conn, a, "same") == lost
            assert await n.server.count(a) == 1
            assert await n.server.count(b) == 1
            assert await n.server.count(fork.session_id) == 2  # the copy and the new one
            assert await n.server.count(fork.session_id, KEY) == 1


@TRANSPORTS
async def test_t7_retry_of_a_prompt_steered_into_active_work(
    tmp_path: Path, transport: Transport
) -> None:
    """With `--policy steer` a prompt sent during a turn is inserted at once; its answer is
    cut and the retry after resume answers the original id while the turn still runs."""
    with anyio.fail_after(TIMEOUT):
        async with net(tmp_path, transport, "--policy", "steer") as n:
            recorder = UpdateRecorder()
            async with n.connect(recorder, direct=True) as watcher:
                sid = await new_session(watcher)
                await prompt(watcher, sid, "long [work:1.5]", None)
                lost = await lose_the_answer(n, sid, "steer this [tool]")
                async with n.connect() as conn:
                    await resume(conn, sid)
                    assert await prompt(conn, sid, "steer this [tool]") == lost
                await wait_idle(recorder)
                assert recorder.user_messages().count(lost) == 1
            assert await n.server.count(sid) == 2
            assert await n.server.count(sid, KEY) == 1
            await _wait_effects(n, sid, 1)
            assert n.server.effect_lines(sid) == [lost]


async def test_a_post_that_never_reached_the_server_is_resent_on_the_same_connection(
    tmp_path: Path,
) -> None:
    """Streamable HTTP: the proxy fails the prompt POST before the server reads it; the client
    resends (same key, fresh id) on the same `Acp-Connection-Id` and it is inserted once."""
    with anyio.fail_after(TIMEOUT):
        async with net(tmp_path, "http") as n:
            url = n.proxy.url("http")
            async with httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT, read=None)) as http:
                init = {
                    "jsonrpc": "2.0",
                    "id": 0,
                    "method": "initialize",
                    "params": {"protocolVersion": 2, "info": {"name": "t", "version": "1"}},
                }
                cid = (await http.post(url, json=init)).headers[CONNECTION_ID_HEADER]
                sse = {"Accept": "text/event-stream", CONNECTION_ID_HEADER: cid}
                async with http.stream("GET", url, headers=sse) as conn_stream:
                    new = {
                        "jsonrpc": "2.0",
                        "id": 1,
                        "method": "session/new",
                        "params": {"cwd": "/w"},
                    }
                    await http.post(url, json=new, headers={CONNECTION_ID_HEADER: cid})
                    sid = str(
                        (await _response(conn_stream.aiter_lines(), 1))["result"]["sessionId"]
                    )
                headers = {CONNECTION_ID_HEADER: cid, SESSION_ID_HEADER: sid}
                async with http.stream(
                    "GET", url, headers={**sse, SESSION_ID_HEADER: sid}
                ) as stream:
                    lines = stream.aiter_lines()
                    rule = n.proxy.fail_post(request_with_method("session/prompt"))
                    body = {
                        "jsonrpc": "2.0",
                        "method": "session/prompt",
                        "params": params(sid, "x"),
                    }
                    with pytest.raises(httpx.TransportError):
                        await http.post(url, json={**body, "id": 2}, headers=headers)
                    await rule.wait()
                    assert await n.server.count(sid) == 0  # it never arrived
                    assert (
                        await http.post(url, json={**body, "id": 3}, headers=headers)
                    ).status_code == 202
                    first = (await _response(lines, 3))["result"]["messageId"]
                    assert (
                        await http.post(url, json={**body, "id": 4}, headers=headers)
                    ).status_code == 202
                    assert (await _response(lines, 4))["result"]["messageId"] == first
            assert await n.server.count(sid) == 1


async def test_the_proxy_cuts_at_the_nth_server_message(tmp_path: Path) -> None:
    """`nth_message(1)` cuts the first server-to-client frame: the initialize answer."""
    with anyio.fail_after(TIMEOUT):
        async with net(tmp_path, "ws") as n:
            rule = n.proxy.cut_ws(nth_message(1))
            with pytest.raises(ConnectionClosed):
                async with n.connect():
                    pass
            assert (await rule.wait())["id"] == 0  # the initialize answer, never delivered
            async with n.connect() as conn:  # the rule is spent
                assert await new_session(conn)
            assert n.proxy.cuts == 1


@TRANSPORTS
async def test_acp_client_through_cut_answers_and_sigkills(
    tmp_path: Path, transport: Transport
) -> None:
    """`AcpClient` submits ten prompts through the proxy; twice the answer of an insertion is
    cut and the server is killed with SIGKILL right after and started again on the same
    database. The client reconnects, resumes and resends: each prompt is inserted once, and
    each side effect ran at most once."""
    with anyio.fail_after(TIMEOUT):
        async with net(tmp_path, transport) as n:
            launcher = (
                WebSocketLauncher(n.proxy.url("ws"))
                if transport == "ws"
                else HttpLauncher(n.proxy.url("http"))
            )
            lost: list[str] = []
            outbox = f"sqlite:{tmp_path / 'outbox.sqlite3'}"
            async with AcpClient(launcher, outbox=outbox, backoff=FAST) as client:
                session = await client.new_session("/w")

                async def killer() -> None:
                    for _ in range(2):
                        rule = n.proxy.cut_answer(answer_with_message_id())
                        lost.append(cut_id(await rule.wait()))
                        await n.server.restart()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(killer)
                    ids = [await session.prompt(f"step {i} [tool]") for i in range(10)]
                    tg.cancel_scope.cancel()
                assert not await client.outbox.pending()
            sid = session.session_id
            assert len(lost) == 2 and set(lost) <= set(ids)
            assert n.server.starts == 3
            assert len(set(ids)) == 10
            assert await n.server.count(sid) == 10
            effects = n.server.effect_lines(sid)
            assert len(effects) == len(set(effects)) and set(effects) <= set(ids)
