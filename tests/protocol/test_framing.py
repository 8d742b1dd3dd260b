"""Property tests for the NDJSON framer: any split reassembles the same frames; limits hold."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from acp_once.protocol.framing import FrameEvent, LineFramer, OversizedFrame, sniff_request_id

# Lines without newlines; they may be empty or whitespace-only (those are skipped).
lines = st.lists(st.binary(max_size=80).map(lambda b: b.replace(b"\n", b"")), max_size=20)


def _expected(frames: list[bytes], limit: int) -> list[FrameEvent]:
    out: list[FrameEvent] = []
    for raw in frames:
        line = raw[:-1] if raw.endswith(b"\r") else raw
        if len(raw) > limit:
            out.append(OversizedFrame(size=len(raw), head=raw[:1024]))
        elif line.strip():
            out.append(line)
    return out


def _feed_split(data: bytes, cuts: list[int], limit: int) -> list[FrameEvent]:
    framer = LineFramer(limit)
    events: list[FrameEvent] = []
    points = sorted({c % (len(data) + 1) for c in cuts})
    start = 0
    for point in [*points, len(data)]:
        events.extend(framer.feed(data[start:point]))
        start = point
    events.extend(framer.close())
    return events


@settings(max_examples=300)
@given(frames=lines, cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_any_split_gives_the_same_frames(frames: list[bytes], cuts: list[int]) -> None:
    data = b"".join(f + b"\n" for f in frames)
    assert _feed_split(data, cuts, 1 << 20) == _expected(frames, 1 << 20)


@settings(max_examples=300)
@given(
    frames=lines,
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
    limit=st.integers(min_value=1, max_value=60),
)
def test_frames_over_the_limit_are_reported_never_kept(
    frames: list[bytes], cuts: list[int], limit: int
) -> None:
    data = b"".join(f + b"\n" for f in frames)
    events = _feed_split(data, cuts, limit)
    assert events == _expected(frames, limit)
    for event in events:
        if isinstance(event, bytes):
            assert len(event) <= limit


@given(frames=lines)
def test_unterminated_last_frame_is_delivered_at_close(frames: list[bytes]) -> None:
    data = b"\n".join(frames)  # no trailing newline
    framer = LineFramer()
    events = framer.feed(data) + framer.close()
    assert events == _expected(frames, 1 << 20)


def test_crlf_is_accepted() -> None:
    framer = LineFramer()
    assert framer.feed(b'{"a":1}\r\n{"b":2}\n') == [b'{"a":1}', b'{"b":2}']


def test_oversized_frame_keeps_its_head_and_the_next_frame_arrives() -> None:
    framer = LineFramer(100)
    big = b'{"jsonrpc":"2.0","id":42,"method":"x","params":{"blob":"' + b"a" * 5000 + b'"}}'
    events = framer.feed(big[:70]) + framer.feed(big[70:3000]) + framer.feed(big[3000:] + b"\n{}\n")
    assert len(events) == 2
    oversized = events[0]
    assert isinstance(oversized, OversizedFrame)
    assert oversized.size == len(big)
    assert sniff_request_id(oversized.head) == 42
    assert events[1] == b"{}"


def test_sniff_request_id_ignores_nested_ids() -> None:
    assert sniff_request_id(b'{"jsonrpc":"2.0","method":"m","params":{"id":5}') is None
    assert sniff_request_id(b'{"id":"abc","method":"m"') == "abc"
    assert sniff_request_id(b'{"id":"a\\"b","method":"m"') == 'a"b'
    assert sniff_request_id(b'{"id":1.5,"method":"m"') is None
    assert sniff_request_id(b"[1,2]") is None


@given(st.binary(max_size=200))
def test_sniff_never_raises(head: bytes) -> None:
    result = sniff_request_id(head)
    assert result is None or isinstance(result, int | str)


def test_an_oversized_frame_is_addressed_to_any_int64_id() -> None:
    """Found by the fuzz suite: ids of 19 digits (10**18 and up, still int64) were not read."""
    from acp_once.protocol.framing import sniff_request_id

    for id in (10**18, 2**63 - 1, -(2**63)):
        assert sniff_request_id(b'{"id":%d,"jsonrpc":"2.0","params":{' % id) == id
    assert sniff_request_id(b'{"id":%d,"jsonrpc":"2.0"' % 2**63) is None  # beyond int64
