"""A fault-injecting TCP proxy for `acp-once serve`: cut a connection at a chosen message.

    async with FaultProxy(("127.0.0.1", server_port)) as proxy:
        rule = proxy.cut_ws(answer_with_message_id())   # the answer of the next insertion
        ...  # clients connect to ws://127.0.0.1:{proxy.port}/acp
        await rule.wait()                               # it was cut: rule.messages[0] is it

It listens on loopback and forwards every accepted connection to the upstream server, parsing
just enough to see the ACP messages (HTTP/1.1 with `h11`, WebSocket frames with the sans-I/O
parser of `websockets`):

- WebSocket (`cut_ws`): a server-to-client text message that matches a rule is never
  forwarded; the connection is reset on both sides instead (RST, as a failing network does).
  That is the moment between the agent's insertion and the client reading the answer.
- Streamable HTTP: an SSE event of a GET stream that matches (`cut_sse`) resets that stream's
  connection; a POSTed message that matches (`fail_post`) either never reaches the server or,
  with `reach_server=True`, is processed by it and its 202 is lost.
- `chaos(rate)`: every server-to-client message is cut with probability `rate`; `cut_all()`
  resets every live connection now.

Rules are tried in the order they were added and each fires `times` times (then it is spent).
A rule's predicate gets the message parsed as JSON (None when it is not JSON). The proxy strips
`Sec-WebSocket-Extensions` from upgrade requests, so frames are never compressed, and it
re-frames what it forwards (same messages, possibly other frame boundaries). SSE events are
split on blank lines (`\\n\\n`), which is how `acp-once serve` writes them. Bodies are never
logged: a POSTed prompt carries its idempotency key.

Run it alone: `python -m acp_once.faultproxy --upstream 127.0.0.1:8765 --port 8766 --rate 0.05`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import socket
import struct
from collections.abc import AsyncGenerator, Callable, Generator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, Self

import anyio
import anyio.abc
import h11
from anyio.abc import SocketAttribute
from websockets.frames import Frame, Opcode
from websockets.streams import StreamReader

__all__ = [
    "FaultProxy",
    "Kind",
    "Rule",
    "answer_with_message_id",
    "nth_message",
    "request_with_method",
]

logger = logging.getLogger("acp_once.faultproxy")

Kind = Literal["ws", "sse", "post"]
Predicate = Callable[[Any], bool]

_READ = 65536
_MAX_HEAD = 64 * 1024


def answer_with_message_id(request_id: Any = None) -> Predicate:
    """Matches a JSON-RPC success response carrying `result.messageId` (a `session/prompt`
    answer), only the one answering `request_id` when given."""

    def match(message: Any) -> bool:
        if not isinstance(message, dict) or "method" in message:
            return False
        result = message.get("result")
        if not isinstance(result, dict) or "messageId" not in result:
            return False
        return request_id is None or message.get("id") == request_id

    return match


def request_with_method(method: str) -> Predicate:
    """Matches a JSON-RPC request (or notification) of `method`."""

    def match(message: Any) -> bool:
        return isinstance(message, dict) and message.get("method") == method

    return match


def nth_message(n: int) -> Predicate:
    """Matches the `n`th message it is asked about (1-based), counted over every connection
    the rule sees: `cut_ws(nth_message(3))` cuts after two server-to-client messages."""
    if n < 1:
        raise ValueError("n counts from 1")
    seen = 0

    def match(message: Any) -> bool:
        nonlocal seen
        seen += 1
        return seen == n

    return match


@dataclass(eq=False)
class Rule:
    """One fault: where it applies, what it matches, how often it may still fire.

    Attributes:
        messages: every message it fired on (parsed JSON), in order.
    """

    kinds: frozenset[Kind]
    match: Predicate
    times: int = 1
    reach_server: bool = False
    """For POSTs: let the server process the message, then lose its 202."""
    messages: list[Any] = field(default_factory=list)
    _fired: anyio.Event = field(default_factory=anyio.Event)

    @property
    def spent(self) -> bool:
        return self.times <= 0

    def cancel(self) -> None:
        """Let it fire no more."""
        self.times = 0

    async def wait(self) -> Any:
        """Wait until it fired at least once (bound it with the caller's timeout); returns
        the first message it fired on."""
        await self._fired.wait()
        return self.messages[0]

    def _try(self, kind: Kind, message: Any) -> bool:
        if self.times <= 0 or kind not in self.kinds or not self.match(message):
            return False
        self.times -= 1
        self.messages.append(message)
        self._fired.set()
        return True


def _parse(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _reset(stream: anyio.abc.SocketStream) -> None:
    """Make closing `stream` send RST instead of FIN (a dropped connection, not a close)."""
    with contextlib.suppress(OSError, anyio.TypedAttributeLookupError):
        sock = stream.extra(SocketAttribute.raw_socket)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class _Link:
    """One proxied TCP connection: the client's stream and the upstream one."""

    def __init__(
        self, proxy: FaultProxy, client: anyio.abc.SocketStream, upstream: anyio.abc.SocketStream
    ) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.scope = anyio.CancelScope()
        self.cut = False

    def abort(self) -> None:
        """Reset both sides (the handler closes them once its scope is cancelled)."""
        self.cut = True
        _reset(self.client)
        _reset(self.upstream)
        self.scope.cancel()

    async def run(self) -> None:
        with self.scope:
            try:
                await self._http()
            except* (
                anyio.EndOfStream,
                anyio.BrokenResourceError,
                anyio.ClosedResourceError,
                OSError,
                h11.ProtocolError,
            ):
                pass  # one side went away: so does the other
            except* Exception:
                # a bug here (or in a rule's predicate) drops this link, not the proxy
                logger.exception("a proxied connection failed")

    async def _cut(self) -> NoReturn:
        """Reset the link here: nothing after the current message is forwarded."""
        self.abort()
        await anyio.sleep_forever()  # cancelled at once: the link's scope is cancelled
        raise AssertionError("unreachable")

    async def _next(self, conn: h11.Connection, stream: anyio.abc.SocketStream) -> object:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await stream.receive(_READ)
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                data = b""
            conn.receive_data(data)

    async def _http(self) -> None:
        down = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        up = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD)
        while True:
            request = await self._next(down, self.client)
            if not isinstance(request, h11.Request):
                return  # the client closed the connection between requests
            headers = [(n, v) for n, v in request.headers if n != b"sec-websocket-extensions"]
            body: list[bytes] = []
            while not isinstance(event := await self._next(down, self.client), h11.EndOfMessage):
                if not isinstance(event, h11.Data):
                    return  # the client left mid-request
                body.append(bytes(event.data))
            post_rule: Rule | None = None
            if request.method == b"POST":
                post_rule = self.proxy._match("post", _parse(b"".join(body)))
                if post_rule is not None and not post_rule.reach_server:
                    await self._cut()  # it never reaches the server
            head = h11.Request(method=request.method, target=request.target, headers=headers)
            out = [up.send(head), *(up.send(h11.Data(data=part)) for part in body)]
            out.append(up.send(h11.EndOfMessage()))
            await self.upstream.send(b"".join(part or b"" for part in out))
            response = await self._next(up, self.upstream)
            if post_rule is not None:
                await self._cut()  # the server took it; its answer is lost
            if isinstance(response, h11.InformationalResponse) and response.status_code == 101:
                await self.client.send(down.send(response) or b"")
                await self._websocket(down.trailing_data[0], up.trailing_data[0])
                return
            if not isinstance(response, h11.Response):
                return
            await self._relay_response(down, up, response)
            if down.our_state is h11.MUST_CLOSE or up.their_state is h11.MUST_CLOSE:
                return
            down.start_next_cycle()
            up.start_next_cycle()

    async def _relay_response(
        self, down: h11.Connection, up: h11.Connection, response: h11.Response
    ) -> None:
        content_type = dict(response.headers).get(b"content-type", b"")
        sse = content_type.startswith(b"text/event-stream")
        await self.client.send(down.send(response) or b"")
        async with anyio.create_task_group() as tg:

            async def watch_client() -> None:
                # a client that leaves an SSE stream ends it; a pipelined request waits in h11
                try:
                    while True:
                        down.receive_data(await self.client.receive(_READ))
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    self.scope.cancel()

            tg.start_soon(watch_client)
            pending = b""
            while True:
                event = await self._next(up, self.upstream)
                if isinstance(event, h11.Data):
                    if not sse:
                        await self.client.send(down.send(event) or b"")
                        continue
                    pending += bytes(event.data)
                    *events, pending = pending.split(b"\n\n")
                    for raw in events:
                        data = b"".join(
                            line[5:].strip()
                            for line in raw.split(b"\n")
                            if line.startswith(b"data:")
                        )
                        if data and self.proxy._match("sse", _parse(data)) is not None:
                            await self._cut()
                        await self.client.send(down.send(h11.Data(data=raw + b"\n\n")) or b"")
                elif isinstance(event, h11.EndOfMessage):
                    if pending:
                        await self.client.send(down.send(h11.Data(data=pending)) or b"")
                    await self.client.send(down.send(event) or b"")
                    break
                else:
                    raise anyio.EndOfStream  # the server went away mid-response
            tg.cancel_scope.cancel()

    async def _websocket(self, from_client: bytes, from_server: bytes) -> None:
        async with anyio.create_task_group() as tg:

            async def client_to_server() -> None:
                if from_client:
                    await self.upstream.send(from_client)
                async for data in self.client:
                    await self.upstream.send(data)
                tg.cancel_scope.cancel()

            tg.start_soon(client_to_server)
            await self._server_frames(from_server)
            tg.cancel_scope.cancel()

    async def _server_frames(self, initial: bytes) -> None:
        reader = StreamReader()
        reader.feed_data(initial)
        message: list[Frame] = []
        while True:
            frame = await self._frame(reader)
            if frame is None:
                return
            if frame.opcode is Opcode.TEXT or (frame.opcode is Opcode.CONT and message):
                message.append(frame)
                if not frame.fin:
                    continue
                text = b"".join(f.data for f in message)
                if self.proxy._match("ws", _parse(text)) is not None:
                    await self._cut()
                out = b"".join(f.serialize(mask=False) for f in message)
                message = []
                await self.client.send(out)
            else:
                await self.client.send(frame.serialize(mask=False))  # control, binary frames

    async def _frame(self, reader: StreamReader) -> Frame | None:
        parser: Generator[None, None, Frame] = Frame.parse(
            reader.read_exact, mask=False, max_size=None
        )
        while True:
            try:
                next(parser)
            except StopIteration as done:
                frame: Frame = done.value
                return frame
            try:
                reader.feed_data(await self.upstream.receive(_READ))
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return None


class FaultProxy(anyio.AsyncContextManagerMixin):
    """A loopback TCP proxy in front of an ACP server that cuts connections on rules (see the
    module docstring). Use as `async with FaultProxy(("127.0.0.1", port)) as proxy`.

    Attributes:
        port: where it listens (127.0.0.1), once entered.
        accepted: how many connections it accepted.
        cuts: how many connections it reset (rules, chaos, `cut_all`).
    """

    def __init__(
        self, upstream: tuple[str, int], *, port: int = 0, connect_timeout: float = 10.0
    ) -> None:
        self.upstream = upstream
        self.port = port
        self.connect_timeout = connect_timeout
        self.accepted = 0
        self.cuts = 0
        self.rules: list[Rule] = []
        self._links: set[_Link] = set()
        self._chaos: tuple[float, random.Random, frozenset[Kind]] | None = None

    def url(self, scheme: str = "ws", path: str = "/acp") -> str:
        """`ws://127.0.0.1:PORT/acp` (or `http://...`) through the proxy."""
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    @property
    def live(self) -> int:
        """Connections open through the proxy right now."""
        return len(self._links)

    def add(self, kinds: set[Kind], match: Predicate, *, times: int = 1, **kw: Any) -> Rule:
        """Add a rule: cut the connection carrying a message of one of `kinds` that matches."""
        if times < 1:
            raise ValueError("times must be positive")
        rule = Rule(frozenset(kinds), match, times, **kw)
        self.rules.append(rule)
        return rule

    def cut_ws(self, match: Predicate, *, times: int = 1) -> Rule:
        """Reset the WebSocket whose server-to-client message matches, instead of
        forwarding that message."""
        return self.add({"ws"}, match, times=times)

    def cut_sse(self, match: Predicate, *, times: int = 1) -> Rule:
        """Reset the SSE GET stream whose event matches, instead of forwarding it."""
        return self.add({"sse"}, match, times=times)

    def cut_answer(self, match: Predicate, *, times: int = 1) -> Rule:
        """`cut_ws` and `cut_sse` at once: wherever the matching answer travels."""
        return self.add({"ws", "sse"}, match, times=times)

    def fail_post(self, match: Predicate, *, times: int = 1, reach_server: bool = False) -> Rule:
        """Fail the POST whose message matches before its 202: the message never reaches the
        server, or (`reach_server`) the server processes it and the 202 is lost."""
        return self.add({"post"}, match, times=times, reach_server=reach_server)

    def chaos(self, rate: float, *, seed: int = 0, kinds: set[Kind] | None = None) -> None:
        """Cut each server-to-client message (and POST, if in `kinds`) with probability
        `rate`; `rate` 0 stops it."""
        if not 0 <= rate <= 1:
            raise ValueError("rate is a probability")
        chosen: frozenset[Kind] = frozenset(kinds if kinds is not None else {"ws", "sse"})
        self._chaos = (rate, random.Random(seed), chosen) if rate > 0 else None

    def cut_all(self) -> int:
        """Reset every live connection now; returns how many."""
        links = list(self._links)
        for link in links:
            link.abort()
        self.cuts += len(links)
        return len(links)

    def _match(self, kind: Kind, message: Any) -> Rule | None:
        for rule in self.rules:
            if rule._try(kind, message):
                self.cuts += 1
                logger.info("cutting a %s connection at a chosen message", kind)
                return rule
        if self._chaos is not None:
            rate, rng, kinds = self._chaos
            if kind in kinds and rng.random() < rate:
                self.cuts += 1
                chance = Rule(frozenset({kind}), lambda m: True, 1, kind == "post")
                chance.messages.append(message)
                return chance
        return None

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Self]:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=self.port)
        self.port = listener.extra(SocketAttribute.local_port)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, self._handle)
                try:
                    yield self
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):  # its close checkpoints before it closes
                await listener.aclose()

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        self.accepted += 1
        async with client:
            try:
                with anyio.fail_after(self.connect_timeout):
                    upstream = await anyio.connect_tcp(*self.upstream)
            except (OSError, TimeoutError):
                _reset(client)  # the server is down: the client sees a dropped connection
                return
            async with upstream:
                link = _Link(self, client, upstream)
                self._links.add(link)
                try:
                    await link.run()
                finally:
                    self._links.discard(link)


async def _main(upstream: tuple[str, int], port: int, rate: float, seed: int) -> None:
    async with FaultProxy(upstream, port=port) as proxy:
        proxy.chaos(rate, seed=seed)
        print(f"proxying 127.0.0.1:{proxy.port} -> {upstream[0]}:{upstream[1]}", flush=True)
        await anyio.sleep_forever()


def main(argv: list[str] | None = None) -> None:
    """`python -m acp_once.faultproxy --upstream HOST:PORT [--port P] [--rate R] [--seed S]`."""
    parser = argparse.ArgumentParser(prog="python -m acp_once.faultproxy")
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the ACP server")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (127.0.0.1)")
    parser.add_argument("--rate", type=float, default=0.05, help="share of messages cut")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    host, _, port = str(args.upstream).rpartition(":")
    logging.basicConfig(level=logging.INFO)
    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(_main, (host or "127.0.0.1", int(port)), args.port, args.rate, args.seed)


if __name__ == "__main__":
    main()
