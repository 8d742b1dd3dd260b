"""`acp-once status URL`: the nodes of a cluster, from one node's `GET /ops/status`."""

from __future__ import annotations

from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

__all__ = ["show_status"]

_COLUMNS = (
    ("node", "node"),
    ("instance", "instance"),
    ("alive", "alive"),
    ("sessions owned", "sessions_owned"),
    ("prompts queued", "prompts_queued"),
    ("prompts held", "prompts_held"),
    ("dedup hits", "dedup_hits"),
    ("inserted", "inserted"),
    ("taken over", "leases_taken_over"),
)


def show_status(url: str, *, token: str | None, console: Console | None = None) -> int:
    """Print the table of `url`'s `/ops/status`; return the exit status (0, or 1 on failure).

    Never prints the token.
    """
    console = console or Console(width=120)  # whole ids and figures, also in a pipe
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        answer = httpx.get(f"{url.rstrip('/')}/ops/status", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        console.print(f"cannot reach {url}: {type(exc).__name__}")
        return 1
    if answer.status_code != 200:
        console.print(f"{url}/ops/status answered {answer.status_code}")
        return 1
    body: dict[str, Any] = answer.json()
    table = Table(title=f"nodes seen by {body.get('node', '?')} ({url})")
    for title, _ in _COLUMNS:
        table.add_column(title, overflow="fold")
    for node in body.get("nodes", []):
        table.add_row(*(_cell(node.get(name)) for _, name in _COLUMNS))
    console.print(table)
    return 0


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return str(value)
