"""Frames for the fuzz suite, each with the answer JSON-RPC says it must get.

A `Case` builds its frame from an id the test makes unique (so a second answer, or one with a
wrong id, cannot hide among the others) and says what must come back: exactly one answer with
that id, exactly one with `id: null` (a parse error, a request whose id is unusable), or nothing
(notifications, responses, invalid notifications). A batch (D21) holds entries made by the same
strategies, each with an id of its own, and must get one array holding exactly the answers its
entries would get alone (a nested array: -32600 with `id: null`), or nothing when none would.
`Case.expected(id)` lists the ids a frame's answers must carry; `answer_ids` reads them back
from what came (an object or an array).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from hypothesis import strategies as st

from tests.protocol.test_encoding import _TEXT, ODD_VALUES

Expect = Literal["id", "null", "none", "batch"]

METHODS = st.sampled_from(
    [
        "initialize",
        "session/new",
        "session/list",
        "session/resume",
        "session/prompt",
        "session/close",
        "session/delete",
        "session/cancel",
        "session/set_config_option",
        "$/cancel_request",
        "session/update",
        "no/such_method",
        "",
    ]
) | _TEXT.map(lambda t: "session/" + t)
# keys the schema knows, so the wrong values reach validation of real fields
KEYS = (
    st.sampled_from(
        ["sessionId", "cwd", "prompt", "idempotencyKey", "requestId", "protocolVersion", "_meta"]
    )
    | _TEXT
)
PARAMS = st.dictionaries(KEYS, ODD_VALUES, max_size=4)
NOT_OBJECTS = ODD_VALUES.filter(lambda v: not isinstance(v, dict))
BAD_IDS = st.sampled_from([None, 1.5, True, False, [1], {"a": 1}, 2**63, -(2**63) - 1, 2**100])
# an id suffix of odd characters (lone surrogates included): the id must come back unchanged
ID_TEXT = _TEXT


def _dumps(value: Any) -> bytes:
    # ensure_ascii: lone surrogates are written escaped, as a peer would send them
    return json.dumps(value, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _parses(frame: bytes) -> bool:
    def refuse(name: str) -> Any:
        raise ValueError(name)

    try:
        json.loads(frame, parse_constant=refuse)
    except (ValueError, RecursionError):
        return False
    return True


@dataclass(frozen=True)
class Case:
    kind: str
    build: Callable[[Any], bytes]
    expect: Expect
    entries: tuple[Case, ...] = ()
    """A batch's entries (`expect` "batch")."""

    def frame(self, id: Any) -> bytes:
        return self.build(id)

    def expected(self, id: Any) -> list[Any]:
        """The ids of the answers this frame must get (None for `id: null`), in any order."""
        if self.expect == "batch":
            return [
                answer
                for k, entry in enumerate(self.entries)
                for answer in entry.expected(entry_id(id, k))
            ]
        if self.expect == "none":
            return []
        return [id if self.expect == "id" else None]


def entry_id(id: Any, k: int) -> Any:
    """The id of a batch's `k`-th entry: unique among all ids of a test."""
    return f"{id}/{k}"


def answer_ids(value: Any) -> list[Any]:
    """The ids of the answers in a received frame: one object, or a batch's array of them."""
    if isinstance(value, list):
        assert value, "an empty array is never an answer"
        return [answer["id"] for answer in value]
    assert isinstance(value, dict)
    return [value["id"]]


def _request(method: str, params: Any, envelope: str) -> Case:
    def build(id: Any) -> bytes:
        msg: dict[str, Any] = {"id": id, "method": method}
        if envelope == "ok":
            msg["jsonrpc"] = "2.0"
        elif envelope == "wrong":
            msg["jsonrpc"] = "1.0"
        if params is not ...:
            msg["params"] = params
        return _dumps(msg)

    return Case("request", build, "id")


REQUESTS = st.builds(
    _request,
    METHODS,
    st.just(...) | PARAMS | NOT_OBJECTS,
    st.sampled_from(["ok", "ok", "ok", "wrong", "missing"]),
)
BAD_ID_REQUESTS = st.builds(
    lambda bad, method: Case(
        "bad id", lambda _: _dumps({"jsonrpc": "2.0", "id": bad, "method": method}), "null"
    ),
    BAD_IDS,
    METHODS,
) | st.builds(
    lambda method: Case(
        "method not a string",
        lambda id: _dumps({"jsonrpc": "2.0", "id": id, "method": method}),
        "null",
    ),
    NOT_OBJECTS.filter(lambda v: v is not None and not isinstance(v, str)),
)
NOTIFICATIONS = st.builds(
    lambda method, params: Case(
        "notification",
        lambda _: _dumps({"jsonrpc": "2.0", "method": method, "params": params}),
        "none",
    ),
    METHODS,
    PARAMS | NOT_OBJECTS.filter(lambda v: v is not None),
)
RESPONSES = st.builds(
    lambda result, error: Case(
        "response",
        lambda id: _dumps(
            {"jsonrpc": "2.0", "id": id, "result": result}
            if error is None
            else {"jsonrpc": "2.0", "id": id, "error": error}
        ),
        "none",
    ),
    ODD_VALUES,
    st.none() | PARAMS,
)
NON_OBJECTS = st.builds(
    lambda value: Case("not an object", lambda _: _dumps(value), "null"),
    # a non-empty array is a batch: BATCHES makes those
    NOT_OBJECTS.filter(lambda v: not (isinstance(v, list) and v)),
)
NESTED_ARRAYS = st.builds(
    lambda value: Case("nested array", lambda _: _dumps(value), "null"),
    st.lists(NOT_OBJECTS, max_size=2),
)
GARBAGE = (
    st.binary(min_size=1, max_size=64)
    .filter(lambda b: b"\n" not in b and bool(b.strip()) and not _parses(b))
    .map(lambda b: Case("garbage", lambda _: b, "null"))
)


def _deep(n: int) -> Case:
    def build(id: Any) -> bytes:
        nested = b"[" * n + b"]" * n
        head = b'{"jsonrpc":"2.0","id":%s,"method":"session/list"' % _dumps(id)
        return head + b',"params":{"a":%s}}' % nested

    return Case("deep", build, "id")


# deeper than orjson reads (1,024) the stdlib parses, as far as the stack of the moment allows:
# where parsing ends depends on the caller, so the cases stay below it (beyond it, a parse
# error, tests/rpc/test_hostile_frames.py)
DEEP = st.integers(min_value=1, max_value=900).map(_deep)
ENTRIES = st.one_of(
    REQUESTS, BAD_ID_REQUESTS, NOTIFICATIONS, RESPONSES, NON_OBJECTS, NESTED_ARRAYS, DEEP
)


def _batch(entries: list[Case]) -> Case:
    def build(id: Any) -> bytes:
        frames = [entry.frame(entry_id(id, k)) for k, entry in enumerate(entries)]
        return b"[" + b",".join(frames) + b"]"

    return Case("batch", build, "batch", tuple(entries))


BATCHES = st.lists(ENTRIES, min_size=1, max_size=5).map(_batch)
CASES = st.one_of(
    REQUESTS, BAD_ID_REQUESTS, NOTIFICATIONS, RESPONSES, NON_OBJECTS, GARBAGE, DEEP, BATCHES
)
