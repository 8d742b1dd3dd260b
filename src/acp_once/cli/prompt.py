"""`acp-once prompt`: one prompt, its turn streamed readably as it arrives.

The agent is a command (run over stdio), a `ws://`/`wss://` URL (WebSocket) or an
`http(s)://` URL (Streamable HTTP), both as served by `acp-once serve`. An agent that speaks
ACP v1 works too: the prompt goes without a key, its turn is streamed the same way, and the
unaware-agent policy (`on_unaware`) says what a lost answer means (see `AcpClient`).
"""

from __future__ import annotations

import math
import os
import shlex
from typing import Any, Literal

import anyio
import orjson
from rich.console import Console
from rich.markup import escape

from acp_once.cli.reasons import unreachable
from acp_once.client import (
    AcpClient,
    AgentRefused,
    ClientSession,
    HttpLauncher,
    Launcher,
    PromptHandle,
    SessionUpdate,
    StdioLauncher,
    WebSocketLauncher,
)
from acp_once.protocol.errors import AcpError
from acp_once.rpc.errors import TransportError
from acp_once.support.backoff import Backoff

__all__ = ["Renderer", "launcher_for", "run_prompt"]


def launcher_for(agent: str, token: str | None = None) -> Launcher:
    """How to reach `agent`: a `ws://`/`wss://` URL, an `http://`/`https://` URL (both with
    the bearer `token`, if any), or else a command line run over stdio.

    Raises:
        ValueError: the command is empty.
    """
    if agent.startswith(("ws://", "wss://")):
        return WebSocketLauncher(agent, token)
    if agent.startswith(("http://", "https://")):
        return HttpLauncher(agent, token)
    return StdioLauncher(shlex.split(agent), env=dict(os.environ))


def _text(update: dict[str, Any]) -> str:
    content = update.get("content") or []
    if isinstance(content, dict):
        content = [content]
    return escape("".join(b.get("text", "") for b in content if isinstance(b, dict)))


class Renderer:
    """Prints a turn's updates as lines a person can read: the chunks of one agent message
    joined on one line, tool calls with their title (or kind) and status."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._open: str | None = None  # the message whose chunks are being printed on a line
        self._tools: dict[str, str] = {}  # toolCallId -> the title (or kind) seen for it

    def _end_line(self) -> None:
        if self._open is not None:
            self.console.print()
            self._open = None

    def update(self, update: SessionUpdate) -> None:
        """Print one update (a chunk continues the line of its message)."""
        data = update.model_dump(by_alias=True, exclude_unset=True, mode="json")
        kind = data.get("sessionUpdate")
        if kind == "agent_message_chunk":
            message = str(data.get("messageId") or "")
            if self._open != message:
                self._end_line()
                self.console.print("[bold green]agent[/] ", end="")
                self._open = message
            self.console.print(_text(data), end="", soft_wrap=True)
            return
        self._end_line()
        if kind == "user_message":
            self.console.print(f"[bold cyan]you[/] [dim]({data.get('messageId')})[/] {_text(data)}")
        elif kind == "agent_message":
            self.console.print(f"[bold green]agent[/] {_text(data)}", soft_wrap=True)
        elif kind == "tool_call_update":
            tool = str(data.get("toolCallId"))
            # a later update names only the id: show what the first one called it
            name = data.get("title") or data.get("kind") or self._tools.get(tool) or "tool"
            self._tools.setdefault(tool, str(name))
            status = data.get("status")
            suffix = f": {escape(str(status))}" if status else ""
            self.console.print(f"[magenta]tool[/] {escape(self._tools[tool])}{suffix}")
        elif kind == "state_update":
            if data.get("state") != "idle" or not data.get("stopReason"):
                self.console.print(f"[dim]state {escape(str(data.get('state')))}[/]")
        elif kind is not None:
            self.console.print(f"[dim]{escape(str(kind))}[/]")

    def finish(self) -> None:
        """End a line of chunks still open."""
        self._end_line()


async def _follow(turn: PromptHandle, renderer: Renderer, console: Console) -> int:
    async for update in turn.updates():
        renderer.update(update)
    renderer.finish()
    result = await turn.finished()
    reason = result.stop_reason or "not reported"
    console.print(f"[bold]stop reason:[/] {escape(reason)}")
    if result.stop_reason == "error":
        message = (result.error or {}).get("message", "")
        console.print(f"[bold red]the turn failed[/] {escape(str(message))}")
        return 1
    return 0


async def run_prompt(
    *,
    agent: str,
    text: str,
    session_id: str | None,
    cwd: str,
    outbox: str,
    wait: float,
    token: str | None = None,
    on_unaware: Literal["trust", "warn", "refuse"] = "warn",
) -> int:
    """Send `text` to `agent` (see `launcher_for`) and print its turn; return the exit status:
    0 the turn ended (or was not waited for), 1 refused, unreachable, a failed turn, or no end
    within `wait` seconds. Failures are one line on stdout, never a traceback.

    Against an ACP v1 agent the turn is always followed (its answer comes at its end; with
    `wait` 0, for as long as it runs), and a pending submission of a killed run is not
    finished but dropped: v1 has no keys, so this run's prompt is a new one."""
    console = Console(stderr=False, highlight=False)
    launcher: Launcher | None = None
    blocks = orjson.dumps([{"type": "text", "text": text}])
    status = 0
    try:
        launcher = launcher_for(agent, token)
        # a stdio agent that exits is started again; a server that is gone is not waited for
        backoff = Backoff(max_attempts=5) if not isinstance(launcher, StdioLauncher) else None
        async with AcpClient(
            launcher, outbox=outbox, backoff=backoff, on_unaware=on_unaware
        ) as client:
            # A pending submission of a killed run with this text is this submission: finish it.
            pending = [
                p
                for p in await client.outbox.pending()
                if p.prompt == blocks and (session_id is None or p.session_id == session_id)
            ]
            target: ClientSession | None = None
            if pending:
                target = client.session(pending[0].session_id)
            elif session_id is not None:
                target = await client.resume_session(session_id, cwd)
            else:
                target = await client.new_session(cwd)
            assert target is not None
            console.print(f"[dim]session {target.session_id}[/]")
            if not client.keyed:  # ACP v1: no key, and no answer before the turn ends
                for stale in pending:
                    await client.discard(stale)
                return await _prompt_v1(target, text, console, wait, dropped=bool(pending))
            key = pending[0].idempotency_key if pending else None
            turn = target.prompt(text, idempotency_key=key)
            message_id = await turn
            if pending:
                console.print(f"[bold]finished a pending submission:[/] {message_id}")
            else:
                console.print(f"[bold]inserted as[/] {message_id}")
            if wait > 0:
                renderer = Renderer(console)
                with anyio.move_on_after(wait) as scope:
                    status = await _follow(turn, renderer, console)
                if scope.cancelled_caught:
                    renderer.finish()
                    console.print(f"[bold red]the turn did not end within {wait:g} s[/]")
                    status = 1
    except AcpError as exc:
        console.print(f"[bold red]refused[/] ({exc.code}): {escape(exc.message)}", soft_wrap=True)
        return 1
    except AgentRefused as exc:
        console.print(f"[bold red]refused the agent:[/] {escape(str(exc))}", soft_wrap=True)
        return 1
    except (TransportError, OSError, TimeoutError, anyio.BrokenResourceError) as exc:
        noted = getattr(launcher, "last_failure", None)
        reason = escape(unreachable(exc, noted, url=agent if "://" in agent else None))
        console.print(f"[bold red]could not reach the agent:[/] {reason}", soft_wrap=True)
        return 1
    except ValueError as exc:
        console.print(f"[bold red]bad --agent:[/] {escape(str(exc))}", soft_wrap=True)
        return 1
    return status


async def _prompt_v1(
    session: ClientSession, text: str, console: Console, wait: float, *, dropped: bool
) -> int:
    """One prompt to an ACP v1 agent: no key, no message id; the turn streamed as it runs."""
    if dropped:
        console.print(
            "[yellow]a killed run's submission of this text was dropped, not finished: "
            "ACP v1 has no idempotency keys; this is a new prompt[/]",
            soft_wrap=True,
        )
    console.print("[dim]ACP v1 agent: sent without an idempotency key[/]")
    turn = session.prompt(text)
    renderer = Renderer(console)
    with anyio.move_on_after(wait if wait > 0 else math.inf):
        return await _follow(turn, renderer, console)
    renderer.finish()
    console.print(f"[bold red]the turn did not end within {wait:g} s[/]")
    return 1
