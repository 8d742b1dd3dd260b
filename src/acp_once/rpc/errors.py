"""Errors of the engine that have no JSON-RPC code: the transport failed, or time ran out.

    TransportError                   the outcome of a request is unknown
    ├── ConnectionClosed(ConnectionError)   the peer went away (process exited, socket dropped)
    └── FrameTooLarge                the peer's answer exceeded the frame limit
    RequestTimeout(TimeoutError)     no answer within the timeout (a $/cancel_request was sent)
    BatchRefused                     a batch we would send cannot be sent; nothing was sent

An answer the peer gave (an error response) is raised as the matching
`acp_once.protocol.errors.AcpError` subclass instead, so `except TransportError` and
`except AcpError` tell "we don't know what happened" from "the peer said no".
"""

from __future__ import annotations

__all__ = ["BatchRefused", "ConnectionClosed", "FrameTooLarge", "RequestTimeout", "TransportError"]


class TransportError(Exception):
    """The request's outcome is unknown: the peer may or may not have acted on it."""


class ConnectionClosed(TransportError, ConnectionError):
    """The connection ended before the answer arrived."""


class FrameTooLarge(TransportError):
    """The peer's answer was larger than the frame limit and was dropped."""


class RequestTimeout(TimeoutError):
    """No answer arrived in time. The engine sent `$/cancel_request` for it."""


class BatchRefused(Exception):
    """A batch was not sent: it was empty, the transport carries no batches, or the peer
    speaks a version without them. Nothing was sent; send each message alone."""
