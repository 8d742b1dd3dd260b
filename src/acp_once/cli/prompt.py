"""`acp-once prompt`: one prompt, its streamed updates printed readably."""

from __future__ import annotations

import os
from typing import Any

import anyio
import orjson
from rich.console import Console
from rich.markup import escape

from acp_once.client import AcpClient, ClientSession, StdioLauncher
from acp_once.client.outbox import Submission
from acp_once.protocol import schema as s
from acp_once.protocol.errors import AcpError
from acp_once.rpc.errors import TransportError

__all__ = ["run_prompt"]


def _text(update: dict[str, Any]) -> str:
    content = update.get("content") or []
    if isinstance(content, dict):
        content = [content]
    return escape("".join(b.get("text", "") for b in content if isinstance(b, dict)))


def render(console: Console, update: dict[str, Any]) -> None:
    """Print one `session/update` `update` object as a line a person can read."""
    kind = update.get("sessionUpdate")
    if kind == "user_message":
        console.print(f"[bold cyan]you[/] [dim]({update.get('messageId')})[/] {_text(update)}")
    elif kind in ("agent_message", "agent_message_chunk"):
        console.print(f"[bold green]agent[/] {_text(update)}")
    elif kind == "tool_call_update":
        title = escape(str(update.get("title") or update.get("toolCallId")))
        console.print(f"[magenta]tool[/] {title}: {update.get('status', '')}")
    elif kind == "state_update":
        stop = update.get("stopReason")
        console.print(f"[dim]state {update.get('state')}{f' ({stop})' if stop else ''}[/]")
    elif kind is not None:
        console.print(f"[dim]{kind}[/]")


async def run_prompt(
    *, command: list[str], text: str, session_id: str | None, cwd: str, outbox: str, wait: float
) -> int:
    """Run the command; return the exit status (0 inserted, 1 refused or failed)."""
    console = Console(stderr=False, highlight=False)
    blocks = orjson.dumps([{"type": "text", "text": text}])
    recovered: dict[str, str] = {}
    done = anyio.Event()

    async def on_recovered(submission: Submission, message_id: str) -> None:
        recovered[submission.submission_id] = message_id

    try:
        async with AcpClient(
            StdioLauncher(command, env=dict(os.environ)), outbox=outbox, on_recovered=on_recovered
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

            async def on_update(n: s.UpdateSessionNotification) -> None:
                update = n.update.model_dump(by_alias=True, exclude_unset=True)
                render(console, update)
                if update.get("sessionUpdate") == "state_update" and update.get("stopReason"):
                    done.set()

            target.on_update(on_update)
            if pending:
                message_id = await target.prompt(text, idempotency_key=pending[0].idempotency_key)
                console.print(f"[bold]finished a pending submission:[/] {message_id}")
            else:
                message_id = await target.prompt(text)
                console.print(f"[bold]inserted as[/] {message_id}")
            if wait > 0:
                with anyio.move_on_after(wait):
                    await done.wait()
    except AcpError as exc:
        console.print(f"[bold red]refused[/] ({exc.code}): {escape(exc.message)}")
        return 1
    except (TransportError, OSError) as exc:
        console.print(f"[bold red]could not reach the agent:[/] {escape(str(exc))}")
        return 1
    return 0
