"""Envelope decoding: every malformed shape maps to the right error, and nothing raises."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from acp_once.protocol import jsonrpc
from acp_once.protocol.errors import (
    INVALID_PARAMS,
    INVALID_REQUEST,
    PARSE_ERROR,
    RESOURCE_NOT_FOUND,
    AcpError,
    SessionNotFound,
    error_from_wire,
)


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (b'{"jsonrpc":"2.0","id":1,"method":"m"}', jsonrpc.Request(1, "m", None)),
        (b'{"jsonrpc":"2.0","id":"a","method":"m","params":{}}', jsonrpc.Request("a", "m", {})),
        (b'{"jsonrpc":"2.0","method":"n","params":{"x":1}}', jsonrpc.Notification("n", {"x": 1})),
        (b'{"jsonrpc":"2.0","id":3,"result":null}', jsonrpc.Response(3, None)),
        (
            b'{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"x"}}',
            jsonrpc.ErrorResponse(None, {"code": -32700, "message": "x"}),
        ),
    ],
)
def test_valid_messages(frame: bytes, expected: jsonrpc.Message) -> None:
    assert jsonrpc.decode(frame) == expected


@pytest.mark.parametrize(
    ("frame", "code", "id", "answer"),
    [
        (b"{not json", PARSE_ERROR, None, True),
        (b"[]", INVALID_REQUEST, None, True),
        (b"42", INVALID_REQUEST, None, True),
        (b'{"id":1,"method":"m"}', INVALID_REQUEST, 1, True),
        (b'{"jsonrpc":"2.0","id":null,"method":"m"}', INVALID_REQUEST, None, True),
        (b'{"jsonrpc":"2.0","id":1.5,"method":"m"}', INVALID_REQUEST, None, True),
        (b'{"jsonrpc":"2.0","id":true,"method":"m"}', INVALID_REQUEST, None, True),
        (b'{"jsonrpc":"2.0","id":1,"method":5}', INVALID_REQUEST, None, True),
        (b'{"jsonrpc":"2.0","id":1,"method":"m","params":[1]}', INVALID_REQUEST, 1, True),
        (b'{"jsonrpc":"2.0","method":"m","params":"x"}', INVALID_REQUEST, None, False),
        (b'{"jsonrpc":"2.0","id":1}', INVALID_REQUEST, 1, True),
        (b'{"jsonrpc":"2.0","id":{},"result":1}', INVALID_REQUEST, None, False),
    ],
)
def test_invalid_messages(frame: bytes, code: int, id: object, answer: bool) -> None:
    msg = jsonrpc.decode(frame)
    assert isinstance(msg, jsonrpc.Invalid)
    assert (msg.code, msg.id, msg.answer) == (code, id, answer)


def test_a_non_empty_array_is_a_batch_of_raw_entries() -> None:
    # D21: the entries are classified one by one, each as if it had come alone
    msg = jsonrpc.decode(b' [{"jsonrpc":"2.0","id":1,"method":"m"}, 17]')
    assert msg == jsonrpc.Batch([{"jsonrpc": "2.0", "id": 1, "method": "m"}, 17])


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"jsonrpc": "2.0", "id": 1, "method": "m"}, jsonrpc.Request(1, "m", None)),
        ({"jsonrpc": "2.0", "method": "n"}, jsonrpc.Notification("n", None)),
        ({"jsonrpc": "2.0", "id": 2, "result": 3}, jsonrpc.Response(2, 3)),
        # D40: what is not an object, or no kind of message, is answered in the array
        (17, jsonrpc.Invalid(INVALID_REQUEST, "A batch entry must be a JSON object")),
        ([], jsonrpc.Invalid(INVALID_REQUEST, "A batch entry must be a JSON object")),
        ({"foo": "boo"}, jsonrpc.Invalid(INVALID_REQUEST, 'jsonrpc must be "2.0"')),
        (
            {"jsonrpc": "2.0", "id": "x"},
            jsonrpc.Invalid(INVALID_REQUEST, "Not a request, notification or response", "x"),
        ),
        # an invalid notification stays unanswered, as it would alone (R48)
        (
            {"jsonrpc": "2.0", "method": "n", "params": 1},
            jsonrpc.Invalid(INVALID_REQUEST, "params must be an object", answer=False),
        ),
        # so does an invalid response
        (
            {"jsonrpc": "2.0", "id": None, "result": 1},
            jsonrpc.Invalid(INVALID_REQUEST, "Response id is invalid", answer=False),
        ),
    ],
)
def test_batch_entries(entry: object, expected: jsonrpc.Message) -> None:
    assert jsonrpc.decode_entry(entry) == expected


def test_encode_batch_joins_messages_into_one_array() -> None:
    frames = [jsonrpc.encode_result(1, {}), jsonrpc.encode_error(None, {"code": 1, "message": ""})]
    assert orjson.loads(jsonrpc.encode_batch(frames)) == [orjson.loads(f) for f in frames]


def test_lone_surrogate_is_valid_json_not_a_parse_error() -> None:
    frame = b'{"jsonrpc":"2.0","id":1,"method":"m","params":{"k":"\\ud800"}}'
    msg = jsonrpc.decode(frame)
    assert isinstance(msg, jsonrpc.Request)
    assert msg.params == {"k": "\ud800"}


@given(st.binary(max_size=300))
def test_decode_never_raises(frame: bytes) -> None:
    assert jsonrpc.decode(frame) is not None


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda children: st.lists(children) | st.dictionaries(st.text(), children),
        max_leaves=20,
    )
)
def test_decode_any_json_value_never_raises(value: object) -> None:
    assert jsonrpc.decode(json.dumps(value).encode()) is not None


def test_encoders_round_trip() -> None:
    assert jsonrpc.decode(jsonrpc.encode_request(5, "m", {"a": 1})) == jsonrpc.Request(
        5, "m", {"a": 1}
    )
    assert jsonrpc.decode(jsonrpc.encode_notification("n", None)) == jsonrpc.Notification("n", None)
    assert jsonrpc.decode(jsonrpc.encode_result("x", [1])) == jsonrpc.Response("x", [1])
    err = jsonrpc.decode(jsonrpc.encode_error(None, SessionNotFound("s1")))
    assert err == jsonrpc.ErrorResponse(
        None,
        {"code": RESOURCE_NOT_FOUND, "message": "Session not found", "data": {"sessionId": "s1"}},
    )


def test_error_from_wire_maps_codes() -> None:
    assert isinstance(
        error_from_wire({"code": RESOURCE_NOT_FOUND, "message": "m", "data": {"sessionId": "s"}}),
        SessionNotFound,
    )
    unknown = error_from_wire({"code": -31999, "message": "custom"})
    assert type(unknown) is AcpError
    assert unknown.code == -31999
    assert error_from_wire({"code": INVALID_PARAMS, "message": "bad"}).code == INVALID_PARAMS
    assert error_from_wire("nonsense").code == -32603
