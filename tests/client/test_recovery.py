"""The recovery policy: backoff bounds and determinism, staleness, the resend plan."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from acp_once.client.outbox import Submission
from acp_once.client.recovery import DEFAULT_MAX_AGE, Backoff, is_stale, plan_resend


def _sub(seq: int, session_id: str = "s", created_at: float = 1000.0) -> Submission:
    return Submission(
        submission_id=f"id{seq}",
        session_id=session_id,
        idempotency_key=f"key{seq}",
        prompt=b"[]",
        created_at=created_at,
        seq=seq,
        attempts=0,
    )


def _bound(base: float, factor: float, cap: float, attempt: int) -> float:
    """min(cap, base * factor**attempt), where factor**attempt may exceed a float."""
    if base == 0.0:
        return 0.0
    try:
        return min(cap, base * factor**attempt)
    except OverflowError:
        return cap


# -- Backoff ------------------------------------------------------------------------------------


@given(
    base=st.floats(min_value=0.0, max_value=100.0),
    factor=st.floats(min_value=1.0, max_value=10.0),
    cap=st.floats(min_value=0.0, max_value=3600.0),
    attempt=st.integers(min_value=0, max_value=5000),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_delay_stays_within_the_exponential_ceiling(
    base: float, factor: float, cap: float, attempt: int, seed: int
) -> None:
    backoff = Backoff(base=base, factor=factor, cap=cap, rng=random.Random(seed))
    delay = backoff.next_delay(attempt)
    assert 0.0 <= delay <= _bound(base, factor, cap, attempt)
    assert backoff.ceiling(attempt) == _bound(base, factor, cap, attempt)


def test_the_same_seed_gives_the_same_delays() -> None:
    first = Backoff(base=1.0, factor=2.0, cap=60.0, rng=random.Random(7))
    second = Backoff(base=1.0, factor=2.0, cap=60.0, rng=random.Random(7))
    delays = [first.next_delay(n) for n in range(10)]
    assert delays == [second.next_delay(n) for n in range(10)]
    assert len(set(delays)) == 10  # jittered, not a fixed schedule


def test_delays_grow_then_stop_at_the_cap() -> None:
    backoff = Backoff(base=1.0, factor=2.0, cap=10.0)
    assert [backoff.ceiling(n) for n in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff.ceiling(10**6) == 10.0  # no OverflowError for a long outage


def test_full_jitter_spreads_over_the_whole_range() -> None:
    backoff = Backoff(base=8.0, factor=2.0, cap=8.0, rng=random.Random(1))
    delays = [backoff.next_delay(3) for _ in range(2000)]
    assert min(delays) < 0.5
    assert max(delays) > 7.5
    assert 3.5 < sum(delays) / len(delays) < 4.5  # uniform on [0, 8]


def test_max_attempts_counts_the_first_attempt() -> None:
    backoff = Backoff(max_attempts=3, rng=random.Random(0))
    assert [backoff.should_retry(n) for n in range(4)] == [True, True, False, False]
    assert len(list(backoff.delays())) == 2  # two waits between three attempts
    assert list(Backoff(max_attempts=1).delays()) == []


def test_without_max_attempts_it_retries_forever() -> None:
    backoff = Backoff(max_attempts=None, rng=random.Random(0))
    assert backoff.should_retry(10**9)
    delays = backoff.delays()
    assert len([next(delays) for _ in range(100)]) == 100


def test_a_zero_base_never_waits() -> None:
    backoff = Backoff(base=0.0, factor=10.0, cap=5.0)
    assert backoff.next_delay(10**6) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base": -1.0}, "base"),
        ({"base": math.nan}, "base"),
        ({"factor": 0.5}, "factor"),
        ({"cap": math.inf}, "cap"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_bad_backoff_settings_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Backoff(**kwargs)  # type: ignore[arg-type]


def test_a_negative_attempt_is_refused() -> None:
    with pytest.raises(ValueError, match="attempt"):
        Backoff().next_delay(-1)
    with pytest.raises(ValueError, match="attempt"):
        Backoff().should_retry(-1)


# -- is_stale -----------------------------------------------------------------------------------


def test_stale_means_older_than_max_age() -> None:
    sub = _sub(1, created_at=1000.0)
    assert DEFAULT_MAX_AGE == 3600.0
    assert not is_stale(sub, 1000.0 + 3600.0)  # exactly the max age: still fresh
    assert is_stale(sub, 1000.0 + 3600.5)
    assert not is_stale(sub, 1000.0 + 60.0, max_age=120.0)
    assert is_stale(sub, 1000.0 + 121.0, max_age=120.0)
    assert not is_stale(sub, 500.0)  # created "in the future": the clock went back
    assert not is_stale(sub, 1e12, max_age=math.inf)


def test_a_bad_max_age_is_refused() -> None:
    with pytest.raises(ValueError, match="max_age"):
        is_stale(_sub(1), 0.0, max_age=-1.0)
    with pytest.raises(ValueError, match="max_age"):
        plan_resend([], 0.0, max_age=math.nan)


# -- plan_resend --------------------------------------------------------------------------------


def test_plan_orders_by_session_then_seq() -> None:
    # Sessions in order of their oldest submission: b (seq 1), a (seq 2), c (seq 5).
    subs = [_sub(4, "a"), _sub(1, "b"), _sub(6, "b"), _sub(2, "a"), _sub(5, "c"), _sub(3, "b")]
    resend, hand_over = plan_resend(subs, now=1010.0)
    assert [(s.session_id, s.seq) for s in resend] == [
        ("b", 1),
        ("b", 3),
        ("b", 6),
        ("a", 2),
        ("a", 4),
        ("c", 5),
    ]
    assert hand_over == []


def test_plan_hands_stale_submissions_to_the_application() -> None:
    old = _sub(1, "a", created_at=0.0)
    fresh = _sub(2, "b", created_at=9000.0)
    resend, hand_over = plan_resend([fresh, old], now=10000.0)
    assert resend == [fresh]
    assert hand_over == [old]
    resend, hand_over = plan_resend([fresh, old], now=10000.0, max_age=math.inf)
    assert resend == [old, fresh]
    assert hand_over == []


def test_plan_holds_later_submissions_behind_a_stale_one() -> None:
    """Resending a2 alone would insert it before a1, out of the order the user typed them."""
    a1 = _sub(1, "a", created_at=0.0)  # stale
    a2 = _sub(2, "a", created_at=9000.0)  # fresh, but after a1 in its session
    b1 = _sub(3, "b", created_at=9500.0)
    resend, hand_over = plan_resend([a1, a2, b1], now=10000.0)
    assert resend == [b1]
    assert hand_over == [a1, a2]


def test_plan_of_nothing_is_nothing() -> None:
    assert plan_resend([], now=0.0) == ([], [])


@given(
    st.lists(
        st.tuples(st.sampled_from("abcd"), st.floats(min_value=0.0, max_value=7200.0)),
        max_size=30,
    ),
    st.permutations(range(30)),
)
def test_plan_keeps_every_submission_once_and_each_session_in_order(
    entries: list[tuple[str, float]], shuffle: list[int]
) -> None:
    subs = [_sub(seq, session, created) for seq, (session, created) in enumerate(entries)]
    shuffled = [subs[i] for i in shuffle if i < len(subs)]
    resend, hand_over = plan_resend(shuffled, now=7200.0)
    assert sorted(resend + hand_over, key=lambda s: s.seq) == subs
    for part in (resend, hand_over):
        sessions: list[str] = []
        for sub in part:
            if not sessions or sessions[-1] != sub.session_id:
                assert sub.session_id not in sessions  # each session is one contiguous run
                sessions.append(sub.session_id)
        for session in sessions:
            seqs = [s.seq for s in part if s.session_id == session]
            assert seqs == sorted(seqs)
    for session in "abcd":
        held = [s.seq for s in hand_over if s.session_id == session]
        sent = [s.seq for s in resend if s.session_id == session]
        assert not held or not sent or max(sent) < min(held)  # nothing sent past a held one
        assert all(not is_stale(s, 7200.0) for s in resend)
