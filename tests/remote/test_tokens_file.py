"""The tokens file of `acp-once serve --tokens FILE` (`acp_once.server.tenants`): what it
accepts, and refusals that name the line, never a token."""

from __future__ import annotations

from pathlib import Path

import pytest

from acp_once.server.tenants import TokensFileError, load_tokens, parse_tokens


def test_names_tokens_comments_and_blank_lines() -> None:
    text = "# who may connect\n\n  alice : tok-a  \nbob:tok:with:colons\n   # indented comment\n"
    assert parse_tokens(text) == {"alice": "tok-a", "bob": "tok:with:colons"}


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("alice secret-1\n", "line 1: expected name:token"),
        ("alice:\n", "line 1: expected name:token"),
        ("# c\nalice:secret 1\n", "line 2: expected name:token"),
        ("al ice:secret-1\n", "line 1: a tenant name"),
        (":secret-1\n", "line 1: a tenant name"),
        ("alice:secret-1\nalice:secret-2\n", "line 2: tenant 'alice' appears twice"),
        ("alice:secret-1\nbob:secret-1\n", "line 2: this token is another tenant's"),
        ("# nobody\n\n", "no tenant"),
    ],
)
def test_refusals_name_the_line_and_never_a_token(text: str, said: str) -> None:
    with pytest.raises(TokensFileError) as info:
        parse_tokens(text, where="t")
    assert said in str(info.value)
    assert "secret" not in str(info.value)


def test_an_unreadable_file_is_a_tokens_file_error(tmp_path: Path) -> None:
    with pytest.raises(TokensFileError, match="cannot be read"):
        load_tokens(tmp_path / "missing")
    (tmp_path / "bin").write_bytes(b"alice:\xff\xfe\n")
    with pytest.raises(TokensFileError, match="cannot be read"):
        load_tokens(tmp_path / "bin")
