"""``await factory(...)`` or ``async with factory(...)``: one object for both.

``start_processes``, ``open_worker`` and ``open_pool`` return an
``OpenResource``: awaiting it starts the resource and returns it (the caller
closes it); ``async with`` also closes it when the block exits, however it
exits.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from types import TracebackType
from typing import Any, Generic, TypeVar

from .loops import running_loop

T = TypeVar("T")


class OpenResource(Generic[T]):
    """Starts a resource with ``open()``; closes it with ``close(resource, exc)``."""

    def __init__(
        self,
        open: Callable[[], Awaitable[T]],
        close: Callable[[T, BaseException | None], Awaitable[None]],
        what: str = "this call",
    ) -> None:
        self._open = open
        self._close = close
        self._what = what
        self._resource: T | None = None

    def __getattr__(self, name: str) -> Any:
        # only reached for names this object lacks: e.g. ``pc.wait`` on an
        # un-awaited ``start_processes(...)``
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"{self._what} returned an awaitable, which has no attribute {name!r}: "
            f"did you forget await? Use `x = await {self._what}` or "
            f"`async with {self._what} as x:`"
        )

    def __await__(self) -> Generator[Any, None, T]:
        running_loop(self._what)
        return self._open().__await__()

    async def __aenter__(self) -> T:
        running_loop(self._what)
        self._resource = await self._open()
        return self._resource

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._resource is not None:
            await self._close(self._resource, exc)
