"""The agent side: write an `Agent` (every method yourself) or a `SessionAgent` (only the turn).

    from acp_once.agent import SessionAgent, Turn, TurnContext, serve_stdio

`SessionAgent` gives sessions, held prompts and idempotency keys on a `SessionStore`;
`PromptKeys` gives the key rules to an `Agent` over storage of its own; a `Coordinator`
(`acp_once.cluster.PostgresCoordinator`) shares sessions between several processes, which
otherwise stay in this one (`LocalCoordinator` is kept as a deprecated name for that
default). The submodule `acp_once.agent.updates` builds the `session/update` kinds a turn
emits (`updates.agent_message_chunk("Hi", message_id=...)`, `updates.tool_call(...)`...).
`run_turn` returns a `StopReason` ("end_turn", ...) or an `extension("_yours")`; tool kinds
and statuses are typed the same way (`acp_once.protocol.vocabulary`), so a type checker
catches a misspelling.
"""

from acp_once.agent.connection import AgentSideConnection, CallContext, ClientPeer
from acp_once.agent.coordinator import Coordinator, LocalCoordinator
from acp_once.agent.interface import Agent
from acp_once.agent.keys import PromptKeys
from acp_once.agent.runtime import STRICT_ENV, SessionAgent, Turn, TurnContext
from acp_once.agent.serve import serve, serve_stdio
from acp_once.protocol.vocabulary import Extension, StopReason, extension

__all__ = [
    "STRICT_ENV",
    "Agent",
    "AgentSideConnection",
    "CallContext",
    "Extension",
    "ClientPeer",
    "Coordinator",
    "LocalCoordinator",
    "PromptKeys",
    "SessionAgent",
    "StopReason",
    "Turn",
    "TurnContext",
    "extension",
    "serve",
    "serve_stdio",
]
