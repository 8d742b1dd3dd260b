"""Tagged unions (`ContentBlockText | ... | ContentBlockOther`) validate left to right.

`scripts/generate_models.py` marks them so: pydantic then stops at the first member that
accepts an input instead of trying all of them. These tests pin what that must not change:
every input lands in the same class as under pydantic's default "smart" mode, and anything
that is no known block still becomes `...Other` with its payload kept.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter

from acp_once.protocol import schema as s

SMART: TypeAdapter[Any] = TypeAdapter(
    s.ContentBlockText
    | s.ContentBlockImage
    | s.ContentBlockAudio
    | s.ContentBlockResourceLink
    | s.ContentBlockResource
    | s.ContentBlockOther
)
PROMPT: TypeAdapter[s.PromptRequest] = TypeAdapter(s.PromptRequest)

BLOCKS: list[dict[str, Any]] = [
    {"type": "text", "text": "hello"},
    {"type": "text", "text": "hi", "annotations": {"priority": 0.5, "audience": ["user"]}},
    {"type": "text", "text": "extra fields stay", "_meta": {"a": 1}, "x-vendor": True},
    {"type": "image", "data": "aGk=", "mimeType": "image/png"},
    {"type": "audio", "data": "aGk=", "mimeType": "audio/wav"},
    {"type": "resource_link", "uri": "file:///a.txt", "name": "a.txt"},
    {"type": "resource", "resource": {"uri": "file:///a.txt", "text": "body"}},
    {"type": "_vendor_block", "payload": [1, 2, 3]},
    {"type": "future_kind"},
    {"type": "text"},  # no text: not a valid text block, so an unknown block
    {"type": "text", "text": 42},  # the wrong type: the same
    {"type": "image", "mimeType": "image/png"},  # no data
]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: str(b.get("type")))
def test_a_block_lands_in_the_same_class_as_under_smart_mode(block: dict[str, Any]) -> None:
    expected = SMART.validate_python(block)
    prompt = PROMPT.validate_python({"sessionId": "sess_1", "prompt": [block]})
    got = prompt.prompt[0]
    assert type(got) is type(expected)
    assert got.model_dump(by_alias=True, exclude_unset=True) == expected.model_dump(
        by_alias=True, exclude_unset=True
    )


def test_unknown_blocks_keep_their_payload() -> None:
    block = {"type": "_vendor_block", "payload": [1, 2, 3]}
    got = PROMPT.validate_python({"sessionId": "sess_1", "prompt": [block]}).prompt[0]
    assert isinstance(got, s.ContentBlockOther)
    assert got.model_dump(by_alias=True, exclude_unset=True) == block


def test_known_tags_never_fall_through_to_other_when_valid() -> None:
    for block in BLOCKS[:7]:
        got = PROMPT.validate_python({"sessionId": "sess_1", "prompt": [block]}).prompt[0]
        assert not isinstance(got, s.ContentBlockOther), block
