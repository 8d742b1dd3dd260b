"""The assertion helpers of a contract suite: checks that raise `ContractViolation`, and the
runner that collects every check's failure instead of stopping at the first."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable

__all__ = ["ContractViolation", "equal", "expect", "raises", "run_checks"]

_F = TypeVar("_F")


class ContractViolation(AssertionError):
    """A backend broke the contract its suite checks."""


def expect(condition: bool, message: str) -> None:
    """Raise `ContractViolation(message)` unless `condition` holds."""
    if not condition:
        raise ContractViolation(message)


def equal(actual: object, expected: object, what: str) -> None:
    """Raise `ContractViolation`, naming `what` and both values, unless they are equal."""
    if actual != expected:
        raise ContractViolation(f"{what}: expected {expected!r}, got {actual!r}")


async def raises(
    expected: type[BaseException], call: Awaitable[object], what: str
) -> BaseException:
    """Await `call` and return the `expected` exception it raises.

    Raises:
        ContractViolation: `call` returned without raising.
    """
    try:
        await call
    except expected as exc:
        return exc
    raise ContractViolation(f"{what}: expected {expected.__name__}, nothing was raised")


async def run_checks(
    checks: Iterable[Callable[[_F], Awaitable[None]]], factory: _F
) -> list[tuple[str, Exception]]:
    """Run every check with `factory`; return the failures as (check name, error)."""
    failures: list[tuple[str, Exception]] = []
    for check in checks:
        try:
            await check(factory)
        except Exception as exc:  # a failing check must not stop the others
            failures.append((getattr(check, "__name__", repr(check)), exc))
    return failures
