"""Exponential backoff with full jitter: how long to wait before the next attempt, and when
to give up. Pure: no I/O, no clock, no event loop (the caller sleeps)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Backoff"]


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
