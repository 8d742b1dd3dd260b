"""Whatever `decode` reads from the wire, the encoders write again (or refuse cleanly)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acp_once.protocol import jsonrpc
from acp_once.protocol.errors import InvalidParams

# Any code point, lone surrogates included: JSON text may carry them as `\udXXX` escapes.
_ANY_CHAR = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
_TEXT = st.text(_ANY_CHAR, max_size=8)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT
)
ODD_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=12,
)
IDS = st.integers(min_value=-(2**63), max_value=2**63 - 1) | _TEXT
DEPTHS = st.integers(min_value=1, max_value=1_200)


def frame(id: Any, method: str, params_text: str) -> bytes:
    head = json.dumps({"jsonrpc": "2.0", "id": id, "method": method})[:-1]
    return f'{head},"params":{{"v":{params_text}}}}}'.encode("ascii")


def check_round_trip(msg: jsonrpc.Message) -> None:
    assert isinstance(msg, jsonrpc.Request)
    try:
        encoded = jsonrpc.encode_result(msg.id, msg.params)
    except jsonrpc.Unencodable:
        pass  # deeper than an encoder goes: the engine answers -32603 instead
    else:
        assert json.loads(encoded) == {"jsonrpc": "2.0", "id": msg.id, "result": msg.params}
    # an error answer is always written, echoing whatever the request held
    error = {"code": -32602, "message": msg.method, "data": msg.params}
    answer = json.loads(jsonrpc.encode_error(msg.id, error))
    assert answer["id"] == msg.id and answer["error"]["code"] == -32602


@settings(max_examples=300, deadline=None)
@given(IDS, _TEXT, ODD_VALUES)
def test_every_decoded_request_is_encoded_again(id: Any, method: str, value: Any) -> None:
    msg = jsonrpc.decode(frame(id, method, json.dumps(value, ensure_ascii=True)))
    check_round_trip(msg)


@settings(max_examples=30, deadline=None)
@given(IDS, DEPTHS)
def test_deep_nesting_is_decoded_and_answered_or_refused_as_a_parse_error(
    id: Any, depth: int
) -> None:
    msg = jsonrpc.decode(frame(id, "m", "[" * depth + "]" * depth))
    if isinstance(msg, jsonrpc.Invalid):
        assert msg.code == -32700  # deeper than the parser goes
        return
    check_round_trip(msg)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_json_constants_are_a_parse_error_even_beside_a_surrogate(constant: str) -> None:
    msg = jsonrpc.decode(frame("\ud800", "m", f'["\\ud800", {constant}]'))
    assert isinstance(msg, jsonrpc.Invalid) and msg.code == -32700


def test_an_error_that_cannot_be_encoded_is_still_answered() -> None:
    class Opaque:
        pass

    plain = json.loads(jsonrpc.encode_error("\ud800", InvalidParams("bad", data={"x": Opaque()})))
    assert plain == {"jsonrpc": "2.0", "id": "\ud800", "error": {"code": -32602, "message": "bad"}}
    relayed = json.loads(jsonrpc.encode_error(1, {"code": Opaque(), "message": None}))
    assert relayed["error"] == {"code": -32603, "message": "Internal error"}
    with pytest.raises(jsonrpc.Unencodable):
        jsonrpc.encode_result(1, {"url": Opaque()})
