"""Opening a resource either way a caller likes: `await` it, or `async with` it, and the
`async with` of an object that closes itself with `aclose()`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Generator

__all__ = ["AsyncClosing", "Opening"]

_T = TypeVar("_T")


class Opening(Generic[_T]):
    """The result of an `open(...)`: await it, or use it as an async context manager.

        store = await SqliteStore.open(path)      # explicit lifecycle: await store.aclose()
        async with SqliteStore.open(path) as store:
            ...

    `open_` makes the resource; `close` releases it when the `async with` block ends (an
    awaited opening leaves the closing to the caller).
    """

    __slots__ = ("_close", "_open", "_opened")

    def __init__(
        self,
        open_: Callable[[], Awaitable[_T]],
        close: Callable[[_T], Awaitable[None]],
    ) -> None:
        self._open = open_
        self._close = close
        self._opened: _T | None = None

    def __await__(self) -> Generator[Any, None, _T]:
        return self._open().__await__()

    async def __aenter__(self) -> _T:
        self._opened = await self._open()
        return self._opened

    async def __aexit__(self, *exc_info: object) -> None:
        opened, self._opened = self._opened, None
        if opened is not None:
            await self._close(opened)


class AsyncClosing:
    """A base class for an object that is open once made: `async with` it, and it is closed
    with `aclose()` when the block ends."""

    __slots__ = ()

    async def aclose(self) -> None:
        """Release the resources; idempotent. Subclasses override it."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
