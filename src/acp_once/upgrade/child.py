"""The v1 child process of the upgrade runtime: spawned, initialized, and started again after it
dies.

`V1Children` keeps at most one live child, contained in a process group of its own
(`acp_once.upgrade.containment`): a new child is started only once the last one's group is
stopped. `current()` returns it, starting a new one when the
last one died (after a jittered backoff when children keep dying young). Each child is one
`V1Child`: a process on pipes, a JSON-RPC `Connection` to it, the answer to its `initialize`,
and a generation number, so that whatever was attached to a dead child (its sessions) is known
to be gone.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Self

import anyio
from anyio.abc import TaskGroup, TaskStatus

from acp_once.protocol import methods as m
from acp_once.protocol.errors import AcpError
from acp_once.rpc.connection import Connection, RequestContext, unwrap_single_exception
from acp_once.rpc.errors import ConnectionClosed, RequestTimeout
from acp_once.support.backoff import Backoff
from acp_once.support.environment import child_environment
from acp_once.transports.stdio import spawn
from acp_once.upgrade.containment import GROUP_TOKEN_VARIABLE, GroupFile, launcher_command
from acp_once.upgrade.translate import CLIENT_CAPABILITIES

__all__ = ["ChildError", "V1Child", "V1Children"]

logger = logging.getLogger("acp_once.upgrade")

V1_PROTOCOL_VERSION = 1
_BACKOFF = Backoff(base=0.2, factor=2.0, cap=5.0)
_STABLE_AFTER = 10.0  # seconds: a child that lived this long resets the backoff

ChildRequestHandler = Callable[
    ["V1Child", str, dict[str, Any] | None, RequestContext], Awaitable[Any]
]
ChildNotificationHandler = Callable[["V1Child", str, dict[str, Any] | None], Awaitable[None]]


class ChildError(Exception):
    """The v1 agent could not be started or initialized, or it speaks another version."""


class V1Child:
    """One running v1 agent process (see the module docstring).

    Attributes:
        generation: 1 for the first child, one more for each restart.
        rpc: the JSON-RPC connection to it (closed when it died).
        init_result: its answer to `initialize`.
    """

    def __init__(self, generation: int, rpc: Connection, pid: int) -> None:
        self.generation = generation
        self.rpc = rpc
        self.pid = pid
        self.init_result: dict[str, Any] = {}
        self.stopped = anyio.Event()
        """Set once its process group is stopped."""

    @property
    def alive(self) -> bool:
        return not self.rpc.closed

    @property
    def capabilities(self) -> dict[str, Any]:
        value = self.init_result.get("agentCapabilities")
        return value if isinstance(value, dict) else {}

    @property
    def can_load(self) -> bool:
        """Whether it advertised `loadSession`."""
        return self.capabilities.get("loadSession") is True


class V1Children(anyio.AsyncContextManagerMixin):
    """Runs the v1 agent `command` as a child process, one at a time, for `async with`.

    Args:
        command: the agent's command line.
        on_request: handles the child's requests (`session/request_permission`...).
        on_notification: handles the child's notifications (`session/update`), inline in the
            reader, in arrival order: before the answer that follows them is seen.
        env: its environment (None: ours without our secrets, `ACP_ONCE_TOKEN`).
        cwd: its working directory (None: ours).
        ready_timeout: seconds allowed for starting it and for its `initialize` answer.
        client_name: the name the child is told its client has.
        group_file: where the child's process group is recorded for the next runtime on the
            same store, which kills it if it is still running (None: not recorded).
        stop_timeout: seconds each step of stopping a child may take (stdin closed, SIGTERM,
            SIGKILL, to its whole process group).

    Raises:
        OSError: (on entering) the group file cannot be opened.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        on_request: ChildRequestHandler,
        on_notification: ChildNotificationHandler,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        ready_timeout: float = 30.0,
        client_name: str = "acp-once-upgrade",
        group_file: Path | None = None,
        stop_timeout: float = 2.0,
    ) -> None:
        self.command = list(command)
        self.on_request = on_request
        self.on_notification = on_notification
        self.env = env
        self.cwd = cwd
        self.ready_timeout = ready_timeout
        self.client_name = client_name
        self.stop_timeout = stop_timeout
        self._group_file = GroupFile(group_file) if group_file is not None else None
        self.generations = 0
        """Children started so far."""
        self._child: V1Child | None = None
        self._lock = anyio.Lock()
        self._tg: TaskGroup | None = None
        self._failures = 0
        self._last_start = 0.0

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Self]:
        group_file = self._group_file
        if group_file is not None:
            # kills what a runtime that died on this store left running (bounded)
            await anyio.to_thread.run_sync(group_file.acquire)
        try:
            with unwrap_single_exception():
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    try:
                        yield self
                    finally:
                        tg.cancel_scope.cancel()
        finally:
            if group_file is not None:
                group_file.release()

    @property
    def latest(self) -> V1Child | None:
        """The child started last (alive or not), None before the first."""
        return self._child

    async def current(self) -> V1Child:
        """The live child, started (again) if there is none.

        Raises:
            ChildError: it could not be started or initialized within `ready_timeout`.
        """
        child = self._child
        if child is not None and child.alive:
            return child
        async with self._lock:
            child = self._child
            if child is not None and child.alive:
                return child
            if child is not None:
                # never two children at once: the last one's group is stopped first
                with anyio.fail_after(3 * self.stop_timeout + 5):
                    await child.stopped.wait()
            if self._failures or self.generations:
                delay = 0.0 if self._failures == 0 else _BACKOFF.next_delay(self._failures - 1)
                if anyio.current_time() - self._last_start < _STABLE_AFTER:
                    delay = max(delay, _BACKOFF.next_delay(0))
                await anyio.sleep(delay)  # bounded: the backoff's cap
            self._last_start = anyio.current_time()
            try:
                child = await self._start()
            except ChildError:
                self._failures += 1
                raise
            self._failures = 0
            self._child = child
            return child

    async def _start(self) -> V1Child:
        assert self._tg is not None, "use V1Children as an async context manager"
        self.generations += 1
        generation = self.generations
        try:
            with anyio.fail_after(self.ready_timeout):
                child: V1Child = await self._tg.start(self._run, generation)
        except TimeoutError:
            raise ChildError(
                f"the v1 agent did not start within {self.ready_timeout:.0f} s"
            ) from None
        logger.info("v1 agent started (pid %d, generation %d)", child.pid, generation)
        return child

    async def _run(self, generation: int, *, task_status: TaskStatus[V1Child]) -> None:
        """One child's life: spawn, connect, initialize, report it started, wait for its end."""
        holder: list[V1Child] = []

        async def requests(method: str, params: dict[str, Any] | None, ctx: RequestContext) -> Any:
            return await self.on_request(holder[0], method, params, ctx)

        async def notifications(method: str, params: dict[str, Any] | None) -> None:
            if holder:
                await self.on_notification(holder[0], method, params)

        started = False
        token = secrets.token_hex(16)
        env = child_environment(self.env) | {GROUP_TOKEN_VARIABLE: token}
        try:
            async with (
                spawn(
                    launcher_command(self.command),
                    env=env,
                    cwd=self.cwd,
                    process_group=True,
                    shutdown_timeout=self.stop_timeout,
                ) as proc,
                Connection(
                    proc.frames,
                    on_request=requests,
                    on_notification=notifications,
                    name="v1-child",
                ) as rpc,
            ):
                if self._group_file is not None:
                    self._group_file.record(proc.pid, token)
                child = V1Child(generation, rpc, proc.pid)
                holder.append(child)
                child.init_result = await self._initialize(rpc)
                started = True
                task_status.started(child)
                await rpc.wait_closed()
            logger.warning("the v1 agent exited (pid %d, exit code %s)", child.pid, proc.returncode)
        except OSError as exc:
            if not started:
                raise ChildError(f"the v1 agent could not be started: {exc}") from None
            logger.warning("the v1 agent's pipes failed (%s)", type(exc).__name__)
        finally:
            if self._group_file is not None:
                self._group_file.clear()
            if holder:
                holder[0].stopped.set()

    async def _initialize(self, rpc: Connection) -> dict[str, Any]:
        params = {
            "protocolVersion": V1_PROTOCOL_VERSION,
            "clientCapabilities": CLIENT_CAPABILITIES,
            "clientInfo": {"name": self.client_name, "version": "1"},
        }
        try:
            result = await rpc.request(m.INITIALIZE, params, timeout=self.ready_timeout)
        except (AcpError, ConnectionClosed, RequestTimeout) as exc:
            raise ChildError(f"the v1 agent's initialize failed ({type(exc).__name__})") from None
        if not isinstance(result, dict) or result.get("protocolVersion") != V1_PROTOCOL_VERSION:
            version = result.get("protocolVersion") if isinstance(result, dict) else None
            raise ChildError(f"the agent speaks protocol version {version!r}, not 1")
        return result
