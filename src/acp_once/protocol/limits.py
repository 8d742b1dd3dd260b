"""Which strings an agent accepts from the wire before it stores or looks up anything.

The JSON decoder (through the engine's stdlib fallback) lets through strings no store can
keep: a lone surrogate is not Unicode (SQLite and orjson refuse to encode it), PostgreSQL's
`text` refuses NUL, and its btree indexes refuse an entry over ~2,700 bytes (`cwd` is indexed
with the update time and the session id). Each of these was a driver error answered -32603
with an ERROR traceback; checked here first, they are invalid params (-32602) on every store,
and nothing is written.

Pure functions, no I/O. Each raises `ValueError` with a message that names the field but never
quotes the value (it may be a path or a prompt: private).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

__all__ = [
    "MAX_ID_LENGTH",
    "MAX_PATH_BYTES",
    "check_id",
    "check_json_strings",
    "check_path",
]

MAX_PATH_BYTES = 2048
"""The longest path (`cwd`, `additionalDirectories`) accepted, in UTF-8 bytes: leaves room in
PostgreSQL's btree entry limit (2,704 bytes on 8 KiB pages) for the update time and session id
indexed beside `cwd`, whatever the characters (a code-point limit would allow 4x the bytes)."""

MAX_ID_LENGTH = 255
"""The longest session id accepted, in code points (ours are 37 ASCII characters)."""

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(value: str, field: str) -> None:
    # ASCII (the common case) holds neither surrogates nor anything but one byte per character
    if value.isascii():
        if "\x00" in value:
            raise ValueError(f"{field} must not contain NUL characters")
        return
    if _LONE_SURROGATE.search(value):
        raise ValueError(f"{field} must not contain lone surrogates")
    if "\x00" in value:
        raise ValueError(f"{field} must not contain NUL characters")


def check_path(value: str, field: str = "cwd") -> str:
    """Return `value` if it is an acceptable path: no lone surrogate, no NUL, at most
    `MAX_PATH_BYTES` UTF-8 bytes.

    Raises:
        ValueError: it is not.
    """
    _check_text(value, field)
    # after the surrogate check: encoding a lone surrogate would raise
    if len(value) > MAX_PATH_BYTES // 4 and len(value.encode()) > MAX_PATH_BYTES:
        raise ValueError(f"{field} must be at most {MAX_PATH_BYTES} bytes (UTF-8)")
    return value


def check_id(value: str, field: str = "sessionId") -> str:
    """Return `value` if it is an acceptable id: 1 to `MAX_ID_LENGTH` code points, no lone
    surrogate, no NUL.

    Raises:
        ValueError: it is not.
    """
    if not 1 <= len(value) <= MAX_ID_LENGTH:
        raise ValueError(f"{field} must be 1 to {MAX_ID_LENGTH} characters")
    _check_text(value, field)
    return value


def check_json_strings(value: Any, field: str = "prompt") -> bytes:
    """Encode `value` (JSON data) with orjson and return the bytes; refuse it if any string in
    it (a key or a value, at any depth) holds a lone surrogate.

    One encoding does the check: orjson refuses such strings itself, at C speed, so a prompt
    costs no walk in Python. NUL is allowed: JSON escapes it, and stores keep JSON as bytes.
    Values JSON has no type for (a pydantic `AnyUrl`) are written as their `str`, as pydantic's
    JSON mode writes them; that mode itself is no check: it writes a lone surrogate in a key
    as U+FFFD, silently changing what is stored.

    Raises:
        ValueError: a string holds a lone surrogate, or an integer is past 64 bits (orjson
            writes neither, and the stored copy is replayed through it).
    """
    try:
        return orjson.dumps(value, default=str)
    except orjson.JSONEncodeError:
        raise ValueError(
            f"{field} must hold no lone surrogates and no integers beyond 64 bits"
        ) from None
