"""Property tests for `idempotencyKey` validation (RFD "The idempotencyKey parameter"; digest D1).

A key is any string of 1 to 255 code points without lone surrogates, kept exactly as sent.
Everything else is invalid params and is never treated as "no key"; `null` and absence both
mean no key.

Privacy: pydantic's `str(ValidationError)` includes the rejected input, so it would leak the
key. The engine must never put `str(ValidationError)` (or `repr`) on the wire or in logs; it
builds its `-32602` from `errors(include_input=False, include_url=False)`, which these tests
check never contains the key text.
"""

from __future__ import annotations

import json
import string
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import ValidationError

from acp_once.protocol.keys import MAX_KEY_LENGTH, check_key
from acp_once.protocol.schema import PromptRequest

SESSION_ID = "5f0c2a9e-3b1d-4e8f-9a27-6c4d1b0e7f35"
PROMPT = [{"type": "text", "text": "Run the database migration"}]
MARKER = "KEY-MARKER-7f3a"
"""Distinctive text put into keys so a leak into an error is easy to spot."""

# Any code point except the surrogate block U+D800..U+DFFF (category Cs).
VALID_CHAR = st.characters(exclude_categories=["Cs"])
SURROGATE = st.characters(categories=["Cs"])
VALID_KEY = st.text(VALID_CHAR, min_size=1, max_size=MAX_KEY_LENGTH)
WHITESPACE_KEY = st.text(
    st.sampled_from(" \t\n\r\x0b\x0c\u00a0\u2003\u3000"), min_size=1, max_size=MAX_KEY_LENGTH
)
TOO_LONG_KEY = st.text(VALID_CHAR, min_size=MAX_KEY_LENGTH + 1, max_size=2 * MAX_KEY_LENGTH)
JSON_SCALAR = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
NOT_A_STRING = (
    st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.booleans()
    | st.lists(JSON_SCALAR, max_size=4)
    | st.lists(st.none(), min_size=1, max_size=3)
    | st.dictionaries(st.text(max_size=5), JSON_SCALAR, max_size=3)
    | st.binary(min_size=1, max_size=8)
)


def params(**extra: Any) -> dict[str, Any]:
    return {"sessionId": SESSION_ID, "prompt": PROMPT, **extra}


# Accepted keys.


@given(VALID_KEY)
@example("K")
@example("k")
@example(" ")
@example("x" * MAX_KEY_LENGTH)
@example("\U0001f600" * MAX_KEY_LENGTH)  # 255 code points, 510 UTF-16 units
@example("e\u0301")  # decomposed: must not become the NFC "é"
@example("\x00")
def test_any_valid_key_is_accepted_unchanged(key: str) -> None:
    assert check_key(key) == key
    request = PromptRequest.model_validate(params(idempotencyKey=key))
    assert request.idempotency_key == key
    dumped = request.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert dumped["idempotencyKey"] == key
    assert PromptRequest.model_validate_json(json.dumps(dumped)).idempotency_key == key


@given(WHITESPACE_KEY)
def test_whitespace_only_keys_are_accepted_untrimmed(key: str) -> None:
    assert check_key(key) == key
    assert PromptRequest.model_validate(params(idempotencyKey=key)).idempotency_key == key


# ASCII only: `str.swapcase` keeps ASCII lengths (it turns "ß" into "SS").
@given(st.text(st.sampled_from(string.ascii_letters + string.digits), max_size=254))
def test_case_is_preserved_and_significant(tail: str) -> None:
    key = "K" + tail
    original = PromptRequest.model_validate(params(idempotencyKey=key)).idempotency_key
    swapped = PromptRequest.model_validate(params(idempotencyKey=key.swapcase())).idempotency_key
    assert original == key
    assert swapped == key.swapcase()
    assert original != swapped


# No key.


@pytest.mark.parametrize("message", [params(), params(idempotencyKey=None)])
def test_null_and_absent_both_mean_no_key(message: dict[str, Any]) -> None:
    assert PromptRequest.model_validate(message).idempotency_key is None
    assert PromptRequest.model_validate_json(json.dumps(message)).idempotency_key is None


# Rejected keys.


def assert_rejected(value: object) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        PromptRequest.model_validate(params(idempotencyKey=value))
    errors = info.value.errors(include_input=False, include_url=False)
    assert [error["loc"] for error in errors] == [("idempotencyKey",)]
    return info.value


def test_empty_key_is_rejected_not_treated_as_absent() -> None:
    assert_rejected("")
    with pytest.raises(ValueError, match="1 to 255"):
        check_key("")


@given(TOO_LONG_KEY)
@example("x" * (MAX_KEY_LENGTH + 1))
@example("\U0001f600" * (MAX_KEY_LENGTH + 1))
def test_keys_over_255_code_points_are_rejected(key: str) -> None:
    assert_rejected(key)
    with pytest.raises(ValueError, match="1 to 255"):
        check_key(key)


@given(NOT_A_STRING)
@example(0)
@example(1.0)
@example(True)
@example(False)
@example([None])
@example({})
@example([])
def test_non_string_keys_are_rejected(value: object) -> None:
    assert_rejected(value)


@given(NOT_A_STRING.filter(lambda value: not isinstance(value, bytes)))
def test_non_string_keys_are_rejected_from_json(value: object) -> None:
    # NaN and infinities go out as `NaN`/`Infinity`; pydantic's JSON parser reads them as
    # floats, so they too fail on the key, not on the document.
    with pytest.raises(ValidationError) as info:
        PromptRequest.model_validate_json(json.dumps(params(idempotencyKey=value)))
    errors = info.value.errors(include_input=False, include_url=False)
    assert [error["loc"] for error in errors] == [("idempotencyKey",)]


@given(
    st.text(VALID_CHAR, max_size=100),
    SURROGATE,
    st.text(VALID_CHAR, max_size=100),
)
@example("", "\ud800", "")
@example("abc", "\udfff", "def")
def test_keys_with_a_lone_surrogate_are_rejected(prefix: str, surrogate: str, suffix: str) -> None:
    key = prefix + surrogate + suffix
    assert_rejected(key)
    with pytest.raises(ValueError, match="surrogate"):
        check_key(key)


@given(st.text(VALID_CHAR, max_size=50), SURROGATE)
def test_lone_surrogate_escapes_in_json_are_rejected(prefix: str, surrogate: str) -> None:
    # `\udXXX` escapes decode to a lone surrogate with the stdlib parser, which the model then
    # rejects. pydantic's own JSON parser (like orjson) refuses the whole document instead.
    raw = json.dumps(params(idempotencyKey=prefix + surrogate))
    assert "\\ud" in raw
    assert_rejected(json.loads(raw)["idempotencyKey"])
    with pytest.raises(ValidationError):
        PromptRequest.model_validate_json(raw)


# Privacy: errors built without the input never carry the key.


def error_text(err: ValidationError) -> str:
    # `ctx` may hold the raised exception object; render it the way an engine might.
    return json.dumps(err.errors(include_input=False, include_url=False), default=str)


BAD_MARKED_KEY = st.one_of(
    st.text(VALID_CHAR, min_size=MAX_KEY_LENGTH, max_size=MAX_KEY_LENGTH + 50).map(
        lambda tail: MARKER + tail
    ),
    st.tuples(st.text(VALID_CHAR, max_size=20), SURROGATE).map(
        lambda parts: MARKER + parts[0] + parts[1]
    ),
    st.text(VALID_CHAR, max_size=20).map(lambda tail: [MARKER + tail]),
    st.text(VALID_CHAR, max_size=20).map(lambda tail: {"key": MARKER + tail}),
    st.text(VALID_CHAR, max_size=20).map(lambda tail: {MARKER + tail: 1}),
)


@given(BAD_MARKED_KEY)
def test_errors_without_input_never_contain_the_key(value: object) -> None:
    err = assert_rejected(value)
    assert MARKER not in error_text(err)


@given(
    st.one_of(
        st.text(VALID_CHAR, min_size=MAX_KEY_LENGTH, max_size=MAX_KEY_LENGTH + 50).map(
            lambda tail: MARKER + tail
        ),
        st.tuples(st.text(VALID_CHAR, max_size=20), SURROGATE).map(
            lambda parts: MARKER + parts[0] + parts[1]
        ),
    )
)
def test_check_key_messages_never_contain_the_key(key: str) -> None:
    with pytest.raises(ValueError) as info:
        check_key(key)
    assert MARKER not in str(info.value)
