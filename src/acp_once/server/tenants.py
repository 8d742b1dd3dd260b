"""Tenants: the tokens file of `acp-once serve --tokens FILE`.

One tenant per line, `name:token`; blank lines and lines starting with `#` are skipped;
spaces around the name and the token are ignored. A name is 1 to 64 characters of letters,
digits, `.`, `_`, `-` and `@` (it is stored with every session the tenant creates); a token
is anything non-empty without spaces inside. Names and tokens are unique within the file.

A connection authenticated with a tenant's token carries the tenant's name to the agent
(`AgentSideConnection.tenant`), and `SessionAgent` shows it only that tenant's sessions.
"""

from __future__ import annotations

import os
import re
from typing import Final

__all__ = ["TokensFileError", "load_tokens", "parse_tokens"]

_NAME: Final = re.compile(r"[A-Za-z0-9._@-]{1,64}")


class TokensFileError(ValueError):
    """A tokens file that cannot be used. The message names the file and the line, never a
    token."""


def parse_tokens(text: str, *, where: str = "tokens file") -> dict[str, str]:
    """The tenants of a tokens file's text, as {name: token}.

    Raises:
        TokensFileError: a line is not `name:token`, a name is not valid, a name or a token
            appears twice, or there is no tenant at all.
    """
    tenants: dict[str, str] = {}
    seen_tokens: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, colon, token = line.partition(":")
        name, token = name.strip(), token.strip()
        if not colon or not token or any(c.isspace() for c in token):
            raise TokensFileError(f"{where}, line {number}: expected name:token")
        if _NAME.fullmatch(name) is None:
            raise TokensFileError(
                f"{where}, line {number}: a tenant name is 1 to 64 letters, digits, '.', '_',"
                " '-' or '@'"
            )
        if name in tenants:
            raise TokensFileError(f"{where}, line {number}: tenant {name!r} appears twice")
        if token in seen_tokens:  # which tenant would it be? never guess
            raise TokensFileError(f"{where}, line {number}: this token is another tenant's")
        tenants[name] = token
        seen_tokens.add(token)
    if not tenants:
        raise TokensFileError(f"{where}: no tenant (lines name:token)")
    return tenants


def load_tokens(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read and parse the tokens file at `path` (see `parse_tokens`).

    Raises:
        TokensFileError: the file cannot be read or is not valid.
    """
    where = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokensFileError(f"{where}: cannot be read ({type(exc).__name__})") from None
    return parse_tokens(text, where=where)
