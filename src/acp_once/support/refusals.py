"""What an HTTP status refusing a connection means, in a few words (the WebSocket upgrade's and
the Streamable HTTP POST's alike), so every error that reports one names the likely cause."""

from __future__ import annotations

__all__ = ["describe_refusal"]

_CAUSES = {
    400: "the server could not read the request",
    401: "missing or wrong bearer token",
    403: "forbidden: an Origin or Host the server does not allow",
    404: "no ACP endpoint at this path (acp-once serves at /acp)",
    405: "no ACP endpoint at this path (acp-once serves at /acp)",
    503: "the server is full or shutting down",
}


def describe_refusal(status: int) -> str:
    """`HTTP STATUS: cause` for a status that refused a connection (`HTTP STATUS` alone for a
    status without a known cause)."""
    cause = _CAUSES.get(status)
    return f"HTTP {status}: {cause}" if cause else f"HTTP {status}"
