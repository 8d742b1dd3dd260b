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
from typing import TYPE_CHECKING

from acp_once.support.backoff import Backoff

if TYPE_CHECKING:
    from collections.abc import Iterable

    from acp_once.client.outbox import Submission

__all__ = ["DEFAULT_MAX_AGE", "Backoff", "is_stale", "plan_resend"]


DEFAULT_MAX_AGE = 3600.0
"""Seconds after which a pending submission is handed to the application: one hour."""


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
