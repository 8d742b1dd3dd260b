"""What a check drives: a target that launches agent connections, and a probe on each of them.

A check gets a `CheckContext`. `ctx.connect()` launches a fresh connection to the target (for a
stdio target: a new agent process running the same command, hence the same store), initializes
it and yields a `Probe`. Every frame both ways is kept in the check's transcript, and every
received frame in the suite's privacy log. Inserted messages are observed only on the wire:
`user_message` updates seen live, plus the ids a `session/resume` with
`replayFrom: {"type": "start"}` replays.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson

from acp_once.client import (
    Client,
    ClientSideConnection,
    HttpLauncher,
    Launcher,
    StdioLauncher,
    WebSocketLauncher,
)
from acp_once.protocol import schema as s
from acp_once.protocol.errors import METHOD_NOT_FOUND, AcpError
from acp_once.protocol.framing import FrameEvent
from acp_once.rpc.connection import PendingCall
from acp_once.rpc.errors import ConnectionClosed, RequestTimeout
from acp_once.rpc.streams import FrameStream

__all__ = [
    "CheckContext",
    "CheckFailed",
    "CheckSkipped",
    "Exchange",
    "Link",
    "Probe",
    "SuiteState",
    "Target",
]

NO_KEY: Any = object()
"""Marks "leave `idempotencyKey` out of the params" (as opposed to sending `null`)."""


class CheckFailed(AssertionError):
    """The target broke the requirement; the message says how.

    `sent`, `expected` and `received` say what was sent, what the check expected and what came
    back; left empty, the report fills them from the check's last request and its title.
    """

    def __init__(
        self, message: str, *, sent: str = "", expected: str = "", received: str = ""
    ) -> None:
        super().__init__(message)
        self.sent = sent
        self.expected = expected
        self.received = received


class CheckSkipped(Exception):
    """The requirement could not be exercised on this target; the message says why."""


def short(text: str, limit: int = 300) -> str:
    """`text` cut to `limit` characters (a report line, not a dump)."""
    return text if len(text) <= limit else text[:limit] + "..."


def describe_request(method: str, params: Any) -> str:
    """`method {params as compact JSON}`, cut to a report line."""
    try:
        body = orjson.dumps(params).decode()
    except TypeError:
        body = repr(params)
    return short(f"{method} {body}")


def describe_answer(value: Any) -> str:
    try:
        return short(orjson.dumps(value).decode())
    except TypeError:
        return short(repr(value))


@dataclass(slots=True)
class Exchange:
    """The last request a check sent, and what came back for it so far."""

    sent: str
    started: float
    received: str = ""


def expect(condition: bool, message: str) -> None:
    """Fail the check with `message` unless `condition` holds."""
    if not condition:
        raise CheckFailed(message)


# -- targets -------------------------------------------------------------------------------


@dataclass(slots=True)
class Link:
    """One live connection to the target: its frame stream and, if possible, a way to kill the
    agent abruptly (SIGKILL for a subprocess)."""

    frames: FrameStream
    kill: Callable[[], Any] | None = None


_NO_KILL = "this target cannot be killed"
_REMOTE_NO_RESTART = (
    "a remote server cannot be killed and restarted by the suite (URL target); "
    "check the agent's command over stdio for this one"
)


@dataclass(frozen=True, slots=True)
class Target:
    """A client launcher plus what the suite must know about the agent behind it. Each
    `connect()` is a new connection; state the agent stores must survive between them (for
    stdio: the same command and store).

    `Target.of(launcher)` describes the client's launchers: a `StdioLauncher`'s agent can be
    killed (SIGKILL) and started again, a remote server cannot, and on Streamable HTTP each
    `initialize` opens a new connection. Build a `Target` yourself for a launcher of your own.

    Attributes:
        launcher: opens the connections.
        description: what the report calls the target (never a token).
        no_restart: why the suite cannot kill and restart the agent (None: it can); checks
            that need a restart are skipped with this reason.
        repeat_initialize: whether `initialize` can be sent again on one connection (not on
            Streamable HTTP, where each initialize opens a new connection).
        carries_batches: whether one frame may hold a JSON-RPC batch (not on Streamable HTTP,
            D43); the batch checks are skipped otherwise.
    """

    launcher: Launcher
    description: str
    no_restart: str | None = _NO_KILL
    repeat_initialize: bool = True
    carries_batches: bool = True

    @classmethod
    def of(cls, launcher: Launcher | Target) -> Target:
        """The target for `launcher` (a `Target` is returned as it is)."""
        match launcher:
            case Target():
                return launcher
            case StdioLauncher():
                return cls(launcher, "stdio: " + " ".join(launcher.command), no_restart=None)
            case WebSocketLauncher():
                return cls(launcher, "websocket: " + launcher.url, _REMOTE_NO_RESTART)
            case HttpLauncher():
                return cls(
                    launcher,
                    "streamable http: " + launcher.url,
                    _REMOTE_NO_RESTART,
                    repeat_initialize=False,
                    carries_batches=False,
                )
            case _:
                return cls(launcher, repr(launcher))

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[Link]:
        """Open a new connection; a `StdioLauncher`'s can be killed."""
        if isinstance(self.launcher, StdioLauncher) and self.no_restart is None:
            async with self.launcher.launch() as proc:
                yield Link(proc.frames, kill=proc.process.kill)
        else:
            async with self.launcher.connect() as frames:
                yield Link(frames)


# -- per-suite and per-check state -------------------------------------------------------------


@dataclass(slots=True)
class SuiteState:
    """Shared by every check of a run: the keys used and every frame received."""

    keys: set[str] = field(default_factory=set)
    received: list[bytes] = field(default_factory=list)
    capabilities: dict[str, Any] | None = None


class _Tap:
    """A frame stream that records every frame into the check's transcript."""

    def __init__(self, inner: FrameStream, ctx: CheckContext, conn: int) -> None:
        self.inner = inner
        self.ctx = ctx
        self.conn = conn
        self.frames: list[dict[str, Any]] = []  # parsed received frames, in order
        self.values: list[Any] = []  # every parsed received frame, batch arrays included
        self._arrived = anyio.Event()

    async def receive(self) -> FrameEvent:
        frame = await self.inner.receive()
        if isinstance(frame, bytes):
            self.ctx._record(self.conn, "received", frame)
            self.ctx.suite.received.append(frame)
            try:
                parsed = orjson.loads(frame)
            except orjson.JSONDecodeError:
                # An ACP peer writes nothing but JSON-RPC (stdout of a stdio agent is the
                # wire). Waiting on would end in a timeout that says nothing; end the
                # connection now so the check fails at once, naming the line.
                self.ctx.non_json = frame.decode("utf-8", "replace")
                raise anyio.BrokenResourceError from None
            self.values.append(parsed)
            if isinstance(parsed, dict):
                self.frames.append(parsed)
            self._arrived.set()
            self._arrived = anyio.Event()
        return frame

    async def send(self, frame: bytes) -> None:
        self.ctx._record(self.conn, "sent", frame)
        await self.inner.send(frame)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Recorder(Client):
    def __init__(self, ctx: CheckContext) -> None:
        self.ctx = ctx
        self.updates: list[tuple[str, dict[str, Any]]] = []

    async def session_update(self, params: s.UpdateSessionNotification) -> None:
        wire = params.model_dump(by_alias=True, exclude_unset=True)
        update = wire.get("update") or {}
        sid = str(wire.get("sessionId"))
        self.updates.append((sid, update))
        if update.get("sessionUpdate") in ("user_message", "user_message_chunk"):
            self.ctx.user_ids.setdefault(sid, set()).add(str(update.get("messageId")))


class Probe:
    """An initialized connection to the target, with the calls checks need."""

    def __init__(
        self, ctx: CheckContext, conn: ClientSideConnection, tap: _Tap, link: Link
    ) -> None:
        self.ctx = ctx
        self.conn = conn
        self.tap = tap
        self.link = link
        self.recorder: _Recorder = conn.client  # type: ignore[assignment]
        self.initialize_result: dict[str, Any] = {}
        self._sent: dict[Any, Exchange] = {}

    @property
    def timeout(self) -> float:
        return self.ctx.timeout

    async def request(self, method: str, params: Any) -> Any:
        """A raw request and its result.

        Raises:
            AcpError: an error answer (other than -32601).
            CheckFailed: no answer within the timeout, -32601 (the agent does not implement
                `method`), non-JSON from the agent, or the connection ended.
        """
        return await self.result(await self.start(method, params))

    async def start(self, method: str, params: Any) -> PendingCall:
        """Send a request without waiting; `result(call)` waits for its answer."""
        call = await self.conn.rpc.start_request(method, params)
        self._sent[call.id] = Exchange(describe_request(method, params), time.monotonic())
        return call

    async def result(self, call: PendingCall) -> Any:
        """The result of a call from `start`, with the failures of `request`."""
        exchange = self._sent.get(call.id) or Exchange(call.method, time.monotonic())
        self.ctx.last = exchange
        try:
            value = await call.result(self.timeout)
        except RequestTimeout:
            waited = time.monotonic() - exchange.started
            exchange.received = f"nothing after {waited:.1f} s"
            raise CheckFailed(
                f"no answer to {call.method} after {waited:.1f} s",
                sent=exchange.sent,
                expected=f"an answer within {self.timeout:g} s (--timeout)",
                received=exchange.received,
            ) from None
        except AcpError as exc:
            exchange.received = f"error {exc.code}: {exc.message}"
            if exc.code == METHOD_NOT_FOUND:
                raise CheckFailed(
                    f"the agent does not implement {call.method} (-32601)",
                    sent=exchange.sent,
                    expected=f"a result for {call.method}",
                    received=exchange.received,
                ) from None
            raise
        except ConnectionClosed:
            self.ctx.raise_non_json()
            raise
        exchange.received = (
            f"{describe_answer(value)} (after {time.monotonic() - exchange.started:.2f} s)"
        )
        return value

    async def notify(self, method: str, params: Any) -> None:
        await self.conn.rpc.notify(method, params)

    async def send_raw(self, value: Any) -> int:
        """Send `value` (a batch array, say) as one frame, in order with the connection's
        other frames; returns how many frames had arrived before it (for `arrived_since`)."""
        mark = len(self.tap.values)
        self.ctx.last = Exchange(short(orjson.dumps(value).decode()), time.monotonic())
        await self.conn.rpc.send_encoded(orjson.dumps(value))
        return mark

    def arrived_since(self, mark: int) -> list[Any]:
        """Every frame parsed since `mark` (a value `send_raw` returned), in order."""
        return self.tap.values[mark:]

    async def new_session(self) -> str:
        result = await self.request("session/new", {"cwd": self.ctx.cwd})
        sid = result.get("sessionId") if isinstance(result, dict) else None
        expect(isinstance(sid, str) and bool(sid), f"session/new gave no sessionId: {result!r}")
        assert isinstance(sid, str)
        return sid

    def prompt_params(self, sid: str, text: str, key: Any = NO_KEY) -> dict[str, Any]:
        params: dict[str, Any] = {"sessionId": sid, "prompt": [{"type": "text", "text": text}]}
        if key is not NO_KEY:
            params["idempotencyKey"] = key
        return params

    async def prompt(self, sid: str, text: str, key: Any = NO_KEY) -> str:
        """`session/prompt`; returns the `messageId` (fails the check if there is none)."""
        result = await self.request("session/prompt", self.prompt_params(sid, text, key))
        return message_id_of(result)

    async def start_prompt(self, sid: str, text: str, key: Any = NO_KEY) -> PendingCall:
        return await self.start("session/prompt", self.prompt_params(sid, text, key))

    async def resume(self, sid: str, *, replay: bool = False) -> PendingCall:
        """Send `session/resume` and wait for its answer; returns the answered call."""
        params: dict[str, Any] = {"sessionId": sid, "cwd": self.ctx.cwd}
        if replay:
            params["replayFrom"] = {"type": "start"}
        call = await self.start("session/resume", params)
        await self.result(call)
        return call

    async def inserted(self, sid: str) -> set[str]:
        """Ids of the user messages of `sid` seen so far in this check, live or replayed (a
        `session/resume` with replay from the start is sent on this connection)."""
        await self.resume(sid, replay=True)
        return set(self.ctx.user_ids.get(sid, set()))

    def user_message_updates(self, sid: str) -> list[str]:
        return [
            str(u.get("messageId"))
            for s_id, u in self.recorder.updates
            if s_id == sid and u.get("sessionUpdate") in ("user_message", "user_message_chunk")
        ]

    async def wait_for(
        self, predicate: Callable[[], bool], what: str = "the frame the check waits for"
    ) -> None:
        """Wait (bounded by the check timeout) until `predicate()` holds after a frame.

        Raises:
            CheckFailed: it did not hold within the timeout; the message names `what`.
        """
        started = time.monotonic()
        with anyio.move_on_after(self.timeout):
            while not predicate():
                await self.tap._arrived.wait()
            return
        kinds = [u.get("sessionUpdate") for _, u in self.recorder.updates]
        seen = ", ".join(str(k) for k in kinds[-10:]) if kinds else "no session/update at all"
        raise CheckFailed(
            f"waited {time.monotonic() - started:.1f} s for {what}; it did not come",
            sent=self.ctx.last.sent if self.ctx.last else "",
            expected=what,
            received=f"session/update kinds: {seen}",
        )

    async def kill(self) -> None:
        """Kill the agent abruptly (SIGKILL) and wait until the connection has ended."""
        if self.link.kill is None:
            raise CheckSkipped(self.ctx.target.no_restart or _NO_KILL)
        self.link.kill()
        with anyio.move_on_after(self.timeout):
            await self.conn.wait_closed()
            return
        raise CheckFailed(
            f"the connection did not end within {self.timeout:g} s of killing the agent",
            sent="SIGKILL to the agent process",
            expected="the connection ends (its stdout closes)",
            received=f"the connection still open after {self.timeout:g} s",
        )


def message_id_of(result: Any) -> str:
    mid = result.get("messageId") if isinstance(result, dict) else None
    expect(
        isinstance(mid, str) and bool(mid), f"session/prompt result has no messageId: {result!r}"
    )
    assert isinstance(mid, str)
    return mid


async def error_code(probe: Probe, call: PendingCall) -> int | str:
    """The error code of the call's answer, or its `messageId` when it succeeded (failures as
    `Probe.result`)."""
    try:
        return message_id_of(await probe.result(call))
    except AcpError as exc:
        return exc.code


class CheckContext:
    """What one check works with: connections to the target, keys, the transcript."""

    def __init__(
        self, target: Target, suite: SuiteState, *, slow_prompt: str, timeout: float
    ) -> None:
        self.target = target
        self.suite = suite
        self.slow_prompt = slow_prompt
        self.timeout = timeout
        self.cwd = "/tmp/acp-once-conformance"
        self.transcript: list[dict[str, Any]] = []
        self.user_ids: dict[str, set[str]] = {}
        self.notes: list[str] = []
        self.last: Exchange | None = None
        self.non_json: str | None = None
        self._conns = 0
        self._t0 = time.monotonic()

    def _record(self, conn: int, direction: str, frame: bytes) -> None:
        self.transcript.append(
            {
                "conn": conn,
                "dir": direction,
                "t": round(time.monotonic() - self._t0, 4),
                "frame": frame.decode("utf-8", "replace"),
            }
        )

    def key(self, prefix: str = "acp-once-check") -> str:
        """A fresh random key, registered for the privacy scan."""
        key = f"{prefix}-{uuid.uuid4()}"
        self.suite.keys.add(key)
        return key

    def note(self, text: str) -> None:
        self.notes.append(text)

    def non_json_failure(self) -> CheckFailed | None:
        """The failure to report when the agent sent something that is not JSON, else None."""
        if self.non_json is None:
            return None
        where = "stdout" if isinstance(self.target.launcher, StdioLauncher) else "the connection"
        return CheckFailed(
            f"non-JSON on {where}: {short(self.non_json.rstrip(), 200)!r}",
            sent=self.last.sent if self.last else "",
            expected="only JSON-RPC messages, one per line",
            received=short(self.non_json.rstrip(), 200),
        )

    def raise_non_json(self) -> None:
        """Raise `non_json_failure()` if there is one."""
        failure = self.non_json_failure()
        if failure is not None:
            raise failure

    @contextlib.asynccontextmanager
    async def connect(self, *, initialize: bool = True) -> AsyncIterator[Probe]:
        """Launch a fresh connection (a new agent process on stdio) and initialize it."""
        self._conns += 1
        async with self.target.connect() as link:
            tap = _Tap(link.frames, self, self._conns)
            async with ClientSideConnection(_Recorder(self), tap, name="conformance") as conn:
                probe = Probe(self, conn, tap, link)
                if initialize:
                    result = await probe.request(
                        "initialize",
                        {
                            "protocolVersion": 2,
                            "info": {"name": "acp-once-check", "version": "1"},
                            "capabilities": {},
                        },
                    )
                    expect(isinstance(result, dict), f"initialize answered {result!r}")
                    probe.initialize_result = result
                    caps = result.get("capabilities")
                    if isinstance(caps, dict):
                        self.suite.capabilities = caps
                yield probe

    def session_capability(self, name: str) -> bool:
        caps = self.suite.capabilities or {}
        session = caps.get("session")
        return isinstance(session, dict) and isinstance(session.get(name), dict)
