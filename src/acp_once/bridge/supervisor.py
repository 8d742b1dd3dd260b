"""The bridge's child process: spawned, initialized once, read, and started again when it dies.

`Supervisor.run` is the supervision loop: it spawns the agent's command, initializes it (the
one `initialize` the child ever gets), reads its frames and hands them to a `ChildListener`,
and after the child's death waits a jittered, exponentially growing delay (`Backoff`) before
the next one. Only the first child must succeed; later failures just start another.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus
from pydantic import ValidationError

from acp_once.protocol import jsonrpc
from acp_once.protocol import methods as m
from acp_once.protocol import schema as s
from acp_once.protocol.framing import OversizedFrame
from acp_once.protocol.initialization import PROTOCOL_VERSION
from acp_once.protocol.jsonrpc import RequestId
from acp_once.rpc.connection import unwrap_single_exception
from acp_once.support.backoff import Backoff
from acp_once.support.environment import child_environment
from acp_once.transports.stdio import AgentProcess, spawn

__all__ = [
    "DEFAULT_BACKOFF",
    "BridgeError",
    "Child",
    "ChildListener",
    "Supervisor",
    "Unavailable",
]

logger = logging.getLogger("acp_once.bridge")

DEFAULT_BACKOFF = Backoff(base=0.2, factor=2.0, cap=5.0)
"""Delay before restarting a dead child: up to 0.2 s, doubling, never above 5 s."""


class BridgeError(Exception):
    """The child agent could not be started or initialized."""


class Unavailable(Exception):
    """No initialized child right now (it is restarting)."""


class Child:
    """One child process and what lives and dies with it (the ids of the requests sent to it).

    Attributes:
        alive: False once it exited (or was killed); nothing is written to it then.
        gone: set when it died.
        ids: the ids of the requests sent to it (the bridge's own and the forwarded ones).
        init_result: its `initialize` answer, as it sent it.
    """

    def __init__(self, proc: AgentProcess, tg: TaskGroup, send_timeout: float) -> None:
        self.proc = proc
        self.tg = tg
        self.send_timeout = send_timeout
        self.alive = True
        self.gone = anyio.Event()
        self.ids = itertools.count(1)
        self.init_result: dict[str, Any] = {}
        self.version = PROTOCOL_VERSION
        self._calls: dict[RequestId, anyio.Event] = {}
        self._answers: dict[RequestId, jsonrpc.Response | jsonrpc.ErrorResponse] = {}
        self._send_lock = anyio.Lock()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.process.kill()

    async def send(self, frame: bytes) -> None:
        """Write one frame, whole (shielded), within `send_timeout`; a child that does not
        read is killed (its death ends what depended on it). Never raises."""
        if not self.alive:
            return
        try:
            async with self._send_lock:
                with anyio.CancelScope(
                    shield=True, deadline=anyio.current_time() + self.send_timeout
                ) as scope:
                    await self.proc.frames.send(frame)
                if scope.cancelled_caught:
                    logger.warning("the agent stopped reading its input; killing it")
                    self.kill()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            self.kill()

    def send_soon(self, frame: bytes) -> None:
        """`send` in a task of the child's: for a caller that must not block on the child
        (a child blocked writing to us would deadlock with a write made inline)."""
        if self.alive:
            self.tg.start_soon(self.send, frame)

    async def call(self, method: str, params: Any, timeout: float) -> jsonrpc.Response:
        """Send the bridge's own request and wait up to `timeout` for its answer.

        Raises:
            BridgeError: the child answered with an error, or died first.
            TimeoutError: no answer in time.
        """
        id = next(self.ids)
        event = self._calls[id] = anyio.Event()
        await self.send(jsonrpc.encode_request(id, method, params))
        with anyio.fail_after(timeout):
            await event.wait()
        answer = self._answers.pop(id, None)
        if isinstance(answer, jsonrpc.ErrorResponse):
            raise BridgeError(f"the agent refused {method} ({answer.error.get('code')})")
        if answer is None:
            raise BridgeError(f"the agent exited before answering {method}")
        return answer

    def _answered(self, msg: jsonrpc.Message) -> bool:
        """Take `msg` when it answers one of the bridge's own requests."""
        if not isinstance(msg, jsonrpc.Response | jsonrpc.ErrorResponse) or msg.id is None:
            return False
        event = self._calls.pop(msg.id, None)
        if event is None:
            return False
        self._answers[msg.id] = msg
        event.set()
        return True

    def _died(self) -> None:
        self.alive = False
        self.gone.set()
        for event in self._calls.values():
            event.set()


class ChildListener(Protocol):
    """What the supervisor tells the bridge about its children."""

    async def child_message(self, child: Child, msg: jsonrpc.Message, frame: bytes) -> None:
        """A message from `child` (not an answer to the bridge's own requests)."""

    async def child_oversized(self, child: Child, frame: OversizedFrame) -> None:
        """`child` sent a frame over the limit (dropped)."""

    def child_exited(self, child: Child) -> None:
        """`child` died: everything that lived in it is gone."""


class Supervisor:
    """Runs the agent `command` as a child, started again after each death (see the module
    docstring). The options are `Bridge`'s of the same names.

    Attributes:
        restarts: how many times the child was started again.
    """

    def __init__(
        self,
        command: Sequence[str],
        listener: ChildListener,
        *,
        env: Mapping[str, str] | None,
        cwd: str | os.PathLike[str] | None,
        initialize: dict[str, Any],
        backoff: Backoff,
        stable_after: float,
        ready_timeout: float,
        send_timeout: float,
        stderr: int | None,
        shutdown_timeout: float,
    ) -> None:
        self.command = list(command)
        self.listener = listener
        self.env = env
        self.cwd = cwd
        self.initialize = initialize
        self.backoff = backoff
        self.stable_after = stable_after
        self.ready_timeout = ready_timeout
        self.send_timeout = send_timeout
        self.stderr = stderr
        self.shutdown_timeout = shutdown_timeout
        self.restarts = 0
        self.child: Child | None = None
        """The initialized child, while it lives."""
        self._ready = anyio.Event()
        self._started = False

    @property
    def pid(self) -> int | None:
        child = self.child
        return child.proc.pid if child is not None and child.alive else None

    async def wait_ready(self) -> Child:
        """Wait (unbounded: the caller bounds it) until an initialized child runs."""
        while True:
            child = self.child
            if child is not None and child.alive:
                return child
            await self._ready.wait()

    async def ready(self) -> Child:
        """The initialized child, waiting up to `ready_timeout` while it restarts.

        Raises:
            Unavailable: no child became ready in time.
        """
        with anyio.move_on_after(self.ready_timeout):
            return await self.wait_ready()
        raise Unavailable

    async def run(self, *, task_status: TaskStatus[None]) -> None:
        """Supervise children until cancelled; `task_status.started()` once the first one is
        initialized.

        Raises:
            BridgeError: the first child could not be started or initialized.
        """
        attempt = 0
        while True:
            began = anyio.current_time()
            failure: BaseException | None = None
            returncode: int | None = None
            try:
                async with spawn(
                    self.command,
                    env=child_environment(self.env),
                    cwd=self.cwd,
                    stderr=self.stderr,
                    shutdown_timeout=self.shutdown_timeout,
                ) as proc:
                    with unwrap_single_exception():
                        await self._run_child(proc, task_status)
                returncode = proc.returncode
            except (OSError, BridgeError, TimeoutError) as exc:
                failure = exc
            if not self._started:
                raise BridgeError(f"the agent could not be started: {failure}") from failure
            self.restarts += 1
            if anyio.current_time() - began >= self.stable_after:
                attempt = 0
            delay = self.backoff.next_delay(attempt)
            attempt += 1
            logger.warning(
                "agent exited (%s); starting it again in %.2f s",
                f"exit code {returncode}" if failure is None else type(failure).__name__,
                delay,
            )
            await anyio.sleep(delay)

    async def _run_child(self, proc: AgentProcess, task_status: TaskStatus[None]) -> None:
        """Run one child until it dies: read it, initialize it, then serve with it."""
        async with anyio.create_task_group() as tg:
            child = Child(proc, tg, self.send_timeout)
            tg.start_soon(self._read, child)
            try:
                await self._initialize(child)
            except BaseException:
                child.kill()
                raise
            self.child = child
            self._ready.set()
            logger.warning("agent started (pid %d)", proc.pid)
            if not self._started:
                self._started = True
                task_status.started()
            await child.gone.wait()
            tg.cancel_scope.cancel()

    async def _initialize(self, child: Child) -> None:
        answer = await child.call(m.INITIALIZE, self.initialize, self.ready_timeout)
        try:
            result = s.InitializeResponse.model_validate(answer.result)
        except ValidationError:
            raise BridgeError("the agent's initialize answer is not valid") from None
        if result.protocol_version != PROTOCOL_VERSION:
            raise BridgeError(
                f"the agent speaks protocol version {result.protocol_version}, "
                f"the bridge {PROTOCOL_VERSION}"
            )
        child.version = result.protocol_version
        child.init_result = dict(answer.result)

    async def _read(self, child: Child) -> None:
        try:
            while True:
                try:
                    frame = await child.proc.frames.receive()
                except (
                    anyio.EndOfStream,
                    anyio.ClosedResourceError,
                    anyio.BrokenResourceError,
                    OSError,
                ):
                    break
                try:
                    if isinstance(frame, OversizedFrame):
                        await self.listener.child_oversized(child, frame)
                        continue
                    msg = jsonrpc.decode(frame)
                    if not child._answered(msg):
                        await self.listener.child_message(child, msg, frame)
                except Exception:  # a bug here must not take every connection down
                    logger.exception("failed to handle a message from the agent")
        finally:
            child._died()
            if self.child is child:
                self.child = None
                self._ready = anyio.Event()
            self.listener.child_exited(child)
