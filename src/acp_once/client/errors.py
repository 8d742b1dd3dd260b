"""The errors `AcpClient` adds to `AcpError` and `TransportError` (exported by
`acp_once.client`)."""

from __future__ import annotations

from acp_once.protocol.errors import RequestCancelled
from acp_once.rpc.errors import TransportError

__all__ = ["AgentRefused", "OutcomeUnknown", "PromptCancelled"]


class PromptCancelled(RequestCancelled):
    """The prompt was withdrawn or cancelled before insertion (-32800); nothing was inserted."""


class OutcomeUnknown(TransportError):
    """The outcome is unknown and the client may not resend on its own."""


class AgentRefused(Exception):
    """The client will not work with this agent: its `initialize` answer is neither ACP v1 nor
    v2, or it speaks v1 and the unaware-agent policy is "refuse". The message says which."""
