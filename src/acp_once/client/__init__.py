"""The client side of ACP v2.

    from acp_once.client import AcpClient, StdioLauncher

    async with AcpClient(StdioLauncher(["acp-once", "agent"]), outbox="sqlite:pending.db") as c:
        session = await c.new_session("/home/me/project")
        message_id = await session.prompt("Run the database migration")
        result = await session.prompt("Now deploy it").finished()   # waits for the turn's end

* `AcpClient` and its `ClientSession`s: a key for every submission, a durable outbox
  (`open_outbox`, `Submission`), reconnect with `Backoff`, resume, resend by retry class;
  `PromptCancelled`, `OutcomeUnknown` and `AgentRefused` are the errors it adds. It speaks
  ACP v2, and v1 to agents that answer `initialize` with v1. `ClientSession.prompt`
  returns a `PromptHandle`: awaited, the `messageId` at insertion; `finished()`, the
  `TurnResult` (stop reason, the agent's messages); `updates()`, the turn's `SessionUpdate`s.
* The launchers it reaches the agent with: `StdioLauncher`, `WebSocketLauncher`,
  `HttpLauncher`, or anything that satisfies `Launcher`.
* The raw connection, for clients that do their own retrying: subclass `Client` and serve it
  with `ClientSideConnection`, whose `.agent` (`AgentPeer`) makes typed calls to the agent.
"""

from acp_once.client.connection import AgentPeer, ClientSideConnection
from acp_once.client.interface import Client
from acp_once.client.launchers import HttpLauncher, Launcher, StdioLauncher, WebSocketLauncher
from acp_once.client.outbox import Outbox, Submission, open_outbox
from acp_once.client.resilient import (
    AcpClient,
    AgentRefused,
    ClientSession,
    OutcomeUnknown,
    PromptCancelled,
)
from acp_once.client.turns import PromptHandle, SessionUpdate, TurnResult
from acp_once.support.backoff import Backoff

__all__ = [
    "AcpClient",
    "AgentPeer",
    "AgentRefused",
    "Backoff",
    "Client",
    "ClientSession",
    "ClientSideConnection",
    "HttpLauncher",
    "Launcher",
    "OutcomeUnknown",
    "Outbox",
    "PromptCancelled",
    "PromptHandle",
    "SessionUpdate",
    "StdioLauncher",
    "Submission",
    "TurnResult",
    "WebSocketLauncher",
    "open_outbox",
]
