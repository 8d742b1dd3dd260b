"""Why a served agent could not be reached, in one line naming the cause: a refused token
(401), a forbidden Origin or Host (403), a URL without the ACP endpoint's path (404), nothing
listening (connection refused); `acp-once prompt` and `acp-once check` say it the same way."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["unreachable"]

_STATUS = re.compile(r"HTTP (\d{3})")
_REFUSED = re.compile(
    r"Connection refused|Connect call failed|Errno 111|ECONNREFUSED|"
    r"ConnectError: All connection attempts failed"
)


def _texts(exc: BaseException, noted: str | None) -> list[str]:
    texts: list[str] = [noted] if noted else []
    current: BaseException | None = exc
    while current is not None and len(texts) < 8:
        texts.append(f"{type(current).__name__}: {current}" if not str(current) else str(current))
        current = current.__cause__ or current.__context__
    return texts


def unreachable(exc: BaseException, noted: str | None = None, *, url: str | None = None) -> str:
    """One line saying why the agent at `url` could not be reached, from `exc` and its causes
    and what the launcher `noted` (an HTTP launcher's `last_failure`)."""
    texts = _texts(exc, noted)
    for text in texts:
        found = _STATUS.search(text)
        if found is None:
            continue
        status = found.group(1)
        if status == "401":
            return f"the server refused the token (HTTP {status}): check --token or ACP_ONCE_TOKEN"
        if status == "403":
            return (
                f"the server forbade the connection (HTTP {status}): an Origin or Host it does "
                "not allow (serve --allow-origin / --allow-host)"
            )
        if status in ("404", "405"):
            parts = urlsplit(url or "ws://HOST:PORT/")
            return (
                f"no ACP endpoint at the path {parts.path or '/'!r} (HTTP {status}): agents "
                f"served by acp-once listen at /acp, e.g. {parts.scheme}://{parts.netloc}/acp"
            )
        return text
    if any(_REFUSED.search(text) for text in texts) or _refused(exc):
        where = urlsplit(url).netloc if url else ""
        return f"connection refused: nothing listens at {where or 'that address'}"
    return next((t for t in texts if t), type(exc).__name__)


def _refused(exc: BaseException) -> bool:
    current: BaseException | None = exc
    for _ in range(8):
        if current is None:
            return False
        if isinstance(current, ConnectionRefusedError):
            return True
        current = current.__cause__ or current.__context__
    return False
