"""`acp-once prompt`: one prompt, its turn streamed readably as it arrives.

The agent is a command (run over stdio), a `ws://`/`wss://` URL (WebSocket) or an
`http(s)://` URL (Streamable HTTP), both as served by `acp-once serve`. An agent that speaks
ACP v1 works too: the prompt goes without a key, its turn is streamed the same way, and the
unaware-agent policy (`on_unaware`) says what a lost answer means (see `AcpClient`).

The exit status says how the submission ended: `EXIT_OK` (0) its turn ended (or was not
waited for), `EXIT_ERROR` (1) refused, unreachable or a bad argument found late, `EXIT_USAGE`
(2) the command line is wrong, `EXIT_INTERRUPTED` (3) the prompt was inserted but its turn
did not finish (`stopReason: "error"`: the agent restarted before it finished, or the turn
failed), `EXIT_NO_END` (4) inserted, and no end of its turn within `--wait`.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anyio
import anyio.from_thread
import anyio.lowlevel
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
from acp_once.client.outbox import KeyConflict, Submission
from acp_once.client.turns import INTERRUPTED_MESSAGE
from acp_once.protocol import schema as s
from acp_once.protocol.errors import AcpError
from acp_once.protocol.keys import check_key
from acp_once.rpc.errors import TransportError
from acp_once.support.backoff import Backoff

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_NO_END",
    "EXIT_OK",
    "EXIT_USAGE",
    "Renderer",
    "launcher_for",
    "permission_answerer",
    "run_prompt",
]

EXIT_OK = 0
"""The turn ended (or `--wait 0`: the prompt was inserted)."""
EXIT_ERROR = 1
"""Refused, unreachable, or an argument found wrong once running."""
EXIT_USAGE = 2
"""The command line is wrong (as for every command)."""
EXIT_INTERRUPTED = 3
"""The prompt was inserted, but its turn did not finish (`stopReason: "error"`)."""
EXIT_NO_END = 4
"""The prompt was inserted, and its turn did not end within `--wait`."""

Allow = Literal["once", "always", "deny"]
PERMISSION_TIMEOUT = 300.0
"""Seconds a question on the terminal waits for an answer before it is denied."""


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


def _plain(update: dict[str, Any]) -> str:
    content = update.get("content") or []
    if isinstance(content, dict):
        content = [content]
    return "".join(str(b.get("text", "")) for b in content if isinstance(b, dict))


def _text(update: dict[str, Any]) -> str:
    return escape(_plain(update))


class Renderer:
    """Prints a turn's updates as lines a person can read: the chunks of one agent message
    joined on one line, tool calls with their title (or kind) and status."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._open: str | None = None  # the message whose chunks are being printed on a line
        self._tools: dict[str, str] = {}  # toolCallId -> the title (or kind) seen for it
        # messageId -> the text its chunks printed: the whole message that follows them (the
        # streaming pattern of the agent guide) is not printed again
        self._streamed: dict[str, str] = {}

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
            if message:
                self._streamed[message] = self._streamed.get(message, "") + _plain(data)
            self.console.print(_text(data), end="", soft_wrap=True)
            return
        self._end_line()
        if kind == "user_message":
            self.console.print(f"[bold cyan]you[/] [dim]({data.get('messageId')})[/] {_text(data)}")
        elif kind == "agent_message":
            streamed = self._streamed.pop(str(data.get("messageId") or ""), None)
            if streamed is None or streamed != _plain(data):
                # new, or it replaces what its chunks said (the schema's upsert rule)
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


def _choose(request: s.RequestPermissionRequest, kinds: tuple[str, ...]) -> str | None:
    """The id of the first option of the first kind in `kinds` the request offers."""
    for kind in kinds:
        for option in request.options:
            if str(getattr(option.kind, "value", option.kind)) == kind:
                return option.option_id
    return None


def _answer(option_id: str | None) -> s.RequestPermissionResponse:
    outcome = (
        {"outcome": "selected", "optionId": option_id}
        if option_id is not None
        else {"outcome": "cancelled"}  # "not approved" when no reject option is offered
    )
    return s.RequestPermissionResponse.model_validate({"outcome": outcome})


_KINDS: dict[str, tuple[str, ...]] = {
    "once": ("allow_once", "allow_always"),
    "always": ("allow_always", "allow_once"),
    "deny": ("reject_once", "reject_always"),
}


async def _read_line(timeout: float) -> str | None:
    """One line from stdin, or None at end of input or after `timeout` seconds. The read runs
    in a daemon thread: one left waiting does not keep the process alive."""
    got = anyio.Event()
    line: list[str | None] = [None]
    token = anyio.lowlevel.current_token()

    def read() -> None:
        try:
            text = sys.stdin.readline()
            line[0] = text if text else None
        except (OSError, ValueError):
            line[0] = None
        # RuntimeError: the event loop is gone, nobody waits any more
        with contextlib.suppress(RuntimeError):
            anyio.from_thread.run_sync(got.set, token=token)

    threading.Thread(target=read, name="permission-input", daemon=True).start()
    with anyio.move_on_after(timeout):
        await got.wait()
    return line[0]


def permission_answerer(
    allow: Allow | None, console: Console, errors: Console, *, interactive: bool
) -> Callable[[s.RequestPermissionRequest], Awaitable[s.RequestPermissionResponse]]:
    """How `prompt` answers the agent's permission requests: by `allow` ("once", "always",
    "deny") when given; else by asking on the terminal when `interactive`; else denied, which
    is said on `errors` (stderr). Each request and its answer are printed on `console`."""

    async def answer(request: s.RequestPermissionRequest) -> s.RequestPermissionResponse:
        console.print(f"[yellow]permission requested:[/] {escape(request.title)}", soft_wrap=True)
        choice: str | None
        if allow is not None:
            choice = _choose(request, _KINDS[allow])
            how = f"--allow {allow}"
        elif interactive:
            for n, option in enumerate(request.options, 1):
                console.print(f"  {n}. {escape(option.name)}")
            console.print("choose a number (anything else denies): ", end="")
            line = await _read_line(PERMISSION_TIMEOUT)
            picked = (line or "").strip()
            index = int(picked) - 1 if picked.isdigit() else -1
            if 0 <= index < len(request.options):
                choice = request.options[index].option_id
            else:
                choice = _choose(request, _KINDS["deny"])
            how = "on the terminal"
        else:
            choice = _choose(request, _KINDS["deny"])
            how = "the default"
            errors.print(
                f"permission request {request.title!r} denied: stdin is not a terminal "
                "(answer with --allow once|always|deny)",
                soft_wrap=True,
                markup=False,
                highlight=False,
            )
        name = next((o.name for o in request.options if o.option_id == choice), "denied")
        console.print(f"[yellow]permission:[/] {escape(name)} ({how})")
        return _answer(choice)

    return answer


async def _follow(turn: PromptHandle, renderer: Renderer, console: Console) -> int:
    async for update in turn.updates():
        renderer.update(update)
    renderer.finish()
    result = await turn.finished()
    reason = result.stop_reason or (
        "not reported (the turn ended before this run saw it)"
        if turn.from_history
        else "not reported"
    )
    console.print(f"[bold]stop reason:[/] {escape(reason)}")
    if result.stop_reason == "error":
        message = str((result.error or {}).get("message", ""))
        if message == INTERRUPTED_MESSAGE:
            what = "the prompt was inserted, but its turn was interrupted:"
        else:
            what = "the prompt was inserted, but its turn failed:"
        console.print(f"[bold red]{what}[/] {escape(message)}", soft_wrap=True)
        return EXIT_INTERRUPTED
    return EXIT_OK


def _pending_for(
    pending: list[Submission], blocks: bytes, session_id: str | None, key: str | None
) -> Submission | None:
    """The pending submission a rerun of this command finishes: the one with this key (and
    session), else, without a key, the oldest one with this text (and session)."""
    for sub in pending:
        if session_id is not None and sub.session_id != session_id:
            continue
        if (sub.idempotency_key == key) if key is not None else (sub.prompt == blocks):
            return sub
    return None


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
    key: str | None = None,
    allow: Allow | None = None,
    interactive: bool | None = None,
) -> int:
    """Send `text` to `agent` (see `launcher_for`) and print its turn; return the exit status
    (`EXIT_OK`, `EXIT_ERROR`, `EXIT_USAGE`, `EXIT_INTERRUPTED`, `EXIT_NO_END`: see the module
    docstring). Failures are one line on stdout, never a traceback.

    The submission is finished, not made again, when an earlier run left it pending in the
    outbox (killed before its answer): the one with `key`, or without a key the one with this
    text. `key` (with `session_id`) names the submission: a rerun with the same key is the
    same submission, inserted once, and the session's history (replayed from the start) says
    whether its turn is over and how it ended. Permission requests are answered by `allow`,
    else on the terminal when `interactive` (default: stdin is a terminal), else denied.

    Against an ACP v1 agent the turn is always followed (its answer comes at its end; with
    `wait` 0, for as long as it runs), and a pending submission of a killed run is not
    finished but dropped: v1 has no keys, so this run's prompt is a new one."""
    console = Console(stderr=False, highlight=False)
    errors = Console(stderr=True, highlight=False)
    if key is not None:
        try:
            check_key(key)
        except ValueError as exc:
            console.print(f"[bold red]bad --key:[/] {escape(str(exc))}", soft_wrap=True)
            return EXIT_USAGE
    if interactive is None:
        interactive = sys.stdin.isatty()
    launcher: Launcher | None = None
    blocks = orjson.dumps([{"type": "text", "text": text}])
    status = EXIT_OK
    try:
        launcher = launcher_for(agent, token)
        # a stdio agent that exits is started again; a server that is gone is not waited for
        backoff = Backoff(max_attempts=5) if not isinstance(launcher, StdioLauncher) else None
        async with AcpClient(
            launcher,
            outbox=outbox,
            backoff=backoff,
            on_unaware=on_unaware,
            on_permission=permission_answerer(allow, console, errors, interactive=interactive),
            # this command finishes its own pending submission; others wait for their rerun
            recover_pending=False,
        ) as client:
            pending = _pending_for(await client.outbox.pending(), blocks, session_id, key)
            if not client.keyed:  # ACP v1: no key, and no answer before the turn ends
                if pending is not None:
                    await client.discard(pending)
                if session_id is not None:
                    target = await client.resume_session(session_id, cwd)
                else:
                    target = await client.new_session(cwd)
                console.print(f"[dim]session {target.session_id}[/]")
                return await _prompt_v1(target, text, console, wait, dropped=pending is not None)
            if pending is not None:
                # it may be inserted, and its turn over: the replayed history says
                target = await client.resume_session(pending.session_id, cwd, history=True)
                key = pending.idempotency_key
            elif session_id is not None:
                target = await client.resume_session(session_id, cwd, history=key is not None)
            else:
                target = await client.new_session(cwd)
            console.print(f"[dim]session {target.session_id}[/]")
            turn = target.prompt(text, idempotency_key=key)
            message_id = await turn
            if pending is not None:
                console.print(f"[bold]finished a pending submission:[/] {message_id}")
            elif turn.from_history and key is not None:
                console.print(
                    f"[bold]inserted earlier as[/] {message_id} (the same key)", soft_wrap=True
                )
            elif turn.from_history:  # its answer was lost: the resend got the recorded id
                console.print(
                    f"[bold]inserted as[/] {message_id} (answered after a reconnect)",
                    soft_wrap=True,
                )
            else:
                console.print(f"[bold]inserted as[/] {message_id}")
            if wait > 0:
                renderer = Renderer(console)
                with anyio.move_on_after(wait) as scope:
                    status = await _follow(turn, renderer, console)
                if scope.cancelled_caught:
                    renderer.finish()
                    console.print(f"[bold red]the turn did not end within {wait:g} s[/]")
                    status = EXIT_NO_END
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
    except KeyConflict as exc:
        console.print(f"[bold red]bad --key:[/] {escape(str(exc))}", soft_wrap=True)
        return EXIT_USAGE
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
    return EXIT_NO_END
