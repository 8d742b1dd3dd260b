"""The client's recovery policy, as pure functions: no I/O, no clock, no event loop.

* `Backoff`: how long to wait before the next attempt (exponential backoff with full
  jitter), and when to give up.
* `is_stale`: a submission held for longer than `max_age` (an hour by default) is not resent
  on its own but handed to the application, which may show it to the user (R16, RFD "How
  long a key lasts": by then the agent may have discarded the message and forgotten the key).
* `plan_resend`: after a restart, which pending submissions to resend, in which order, and
  which to hand to the application.

The recovery loop that uses them (reconnect, `initialize`, `session/resume`, then resend with
the same key, R11, R15, R33) lives with the client; the submissions come from
`acp_once.client.outbox`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from acp_once.client.outbox import Submission

__all__ = ["DEFAULT_MAX_AGE", "Backoff", "is_stale", "plan_resend"]

DEFAULT_MAX_AGE = 3600.0
"""Seconds after which a pending submission is handed to the application: one hour."""


def _check_finite(name: str, value: float, *, minimum: float) -> None:
    if not (math.isfinite(value) and value >= minimum):
        raise ValueError(f"{name} must be a finite number >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter: wait a uniform random time in [0, ceiling].

    The ceiling after the failed attempt number `attempt` (counting from 0) is
    `min(cap, base * factor ** attempt)`. "Full jitter" spreads the retries of many clients
    that lost the same agent at the same moment.

        backoff = Backoff(base=0.5, factor=2.0, cap=30.0, max_attempts=None)
        for attempt in itertools.count():
            try:
                return await connect()
            except TransportError:
                if not backoff.should_retry(attempt):
                    raise
                await anyio.sleep(backoff.next_delay(attempt))

    Args:
        base: the ceiling after the first failure, in seconds (>= 0).
        factor: how much the ceiling grows per failure (>= 1).
        cap: the largest ceiling, in seconds (>= 0).
        max_attempts: the most attempts in all, the first one included (>= 1); None retries
            without end.
        rng: the source of the jitter; pass `random.Random(seed)` for deterministic tests.
    """

    base: float = 0.5
    factor: float = 2.0
    cap: float = 30.0
    max_attempts: int | None = None
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_finite("base", self.base, minimum=0.0)
        _check_finite("factor", self.factor, minimum=1.0)
        _check_finite("cap", self.cap, minimum=0.0)
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1 or None, got {self.max_attempts}")

    def ceiling(self, attempt: int) -> float:
        """The largest delay after the failed attempt `attempt`: min(cap, base*factor**attempt)."""
        if attempt < 0:
            raise ValueError(f"attempt must not be negative, got {attempt}")
        if self.base == 0.0:
            return 0.0
        try:
            grown = self.base * self.factor**attempt
        except OverflowError:
            return self.cap
        return min(self.cap, grown)

    def next_delay(self, attempt: int) -> float:
        """A random delay in [0, ceiling(attempt)] to wait after the failed attempt `attempt`.

        `attempt` counts from 0: after the first attempt fails pass 0. For a submission,
        whose `attempts` counts the attempts made, that is `attempts - 1`.
        """
        ceiling = self.ceiling(attempt)
        return min(ceiling, self.rng.uniform(0.0, ceiling))  # uniform may round above b

    def should_retry(self, attempt: int) -> bool:
        """Whether another attempt may follow the failed attempt `attempt` (from 0)."""
        if attempt < 0:
            raise ValueError(f"attempt must not be negative, got {attempt}")
        return self.max_attempts is None or attempt + 1 < self.max_attempts

    def delays(self) -> Iterator[float]:
        """The delays between attempts, one per retry allowed (endless without max_attempts)."""
        attempt = 0
        while self.should_retry(attempt):
            yield self.next_delay(attempt)
            attempt += 1


def _check_max_age(max_age: float) -> None:
    if math.isnan(max_age) or max_age < 0:
        raise ValueError(f"max_age must be >= 0, got {max_age!r}")


def is_stale(submission: Submission, now: float, max_age: float = DEFAULT_MAX_AGE) -> bool:
    """Whether the submission was created more than `max_age` seconds before `now`.

    A stale submission is not resent on its own but handed to the application (R16). A
    `created_at` in the future (the clock went back) counts as fresh. `max_age=math.inf`
    makes nothing stale.
    """
    _check_max_age(max_age)
    return now - submission.created_at > max_age


def plan_resend(
    submissions: Iterable[Submission], now: float, max_age: float = DEFAULT_MAX_AGE
) -> tuple[list[Submission], list[Submission]]:
    """Split pending submissions into (to resend now, to hand to the application).

    Both lists are in resend order: grouped by session, each session's submissions in their
    original order (`seq`), the sessions ordered by their oldest pending submission. Sessions
    are independent, so a loop may also resend the sessions concurrently, each in order.

    A submission goes to the application when it is stale (`is_stale`), and so does every
    later submission of the same session: resending those on their own would insert them
    before the older, held one, out of the order the user typed them. The application
    decides for each (resend with the same key, or discard).
    """
    _check_max_age(max_age)
    ordered = sorted(submissions, key=lambda s: s.seq)
    first_seq: dict[str, int] = {}
    for submission in ordered:
        first_seq.setdefault(submission.session_id, submission.seq)
    ordered.sort(key=lambda s: (first_seq[s.session_id], s.seq))

    resend: list[Submission] = []
    hand_over: list[Submission] = []
    held_sessions: set[str] = set()
    for submission in ordered:
        if submission.session_id in held_sessions or is_stale(submission, now, max_age):
            held_sessions.add(submission.session_id)
            hand_over.append(submission)
        else:
            resend.append(submission)
    return resend, hand_over
