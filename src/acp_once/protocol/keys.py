"""The `idempotencyKey` of `session/prompt` (v2 Idempotency Keys RFD).

A key is an opaque, case-sensitive string of 1 to 255 characters. "Character" means a Unicode
code point (D1), and a string holding a lone surrogate is not a valid key: it cannot be
stored or compared reliably. Any other value is invalid params (-32602); it is never treated as
if the key were omitted (R5, R6). Omitted and `null` both mean "no key" (R4).
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated

from pydantic import StringConstraints

__all__ = ["MAX_KEY_LENGTH", "IdempotencyKey", "check_key", "new_key"]

MAX_KEY_LENGTH = 255
"""The longest key the RFD allows, in code points."""

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_key(value: str) -> str:
    """Return `value` if it is a valid key.

    Raises:
        ValueError: the value is empty, longer than 255 code points, or holds a lone
            surrogate. The message never contains the key itself (keys are private).
    """
    if not 1 <= len(value) <= MAX_KEY_LENGTH:
        raise ValueError(f"idempotencyKey must be 1 to {MAX_KEY_LENGTH} characters")
    if not value.isascii() and _LONE_SURROGATE.search(value):  # ASCII has no surrogates
        raise ValueError("idempotencyKey must not contain lone surrogates")
    return value


IdempotencyKey = Annotated[
    str, StringConstraints(strict=True, min_length=1, max_length=MAX_KEY_LENGTH)
]
"""A validated key: strict `str` (numbers, booleans, objects and arrays are refused) of 1 to
255 code points. pydantic-core checks all of `check_key` itself, without calling back into
Python: it counts code points, and it refuses a string holding a lone surrogate
(`string_unicode`) because it cannot read it as Unicode."""


def new_key() -> str:
    """Return a fresh random key (a UUIDv4 string), as the RFD recommends clients use."""
    return str(uuid.uuid4())
