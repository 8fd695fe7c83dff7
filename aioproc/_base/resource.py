"""``await factory(...)`` or ``async with factory(...)``: one object for both; what is open.

``start_processes``, ``open_worker`` and ``open_pool`` return an
``OpenResource``: awaiting it starts the resource and returns it (the caller
closes it); ``async with`` also closes it when the block exits, however it
exits.

The handles a user opens (groups, pools, persistent workers, agents) say so
with ``handle_opened(handle)`` when they start and ``handle_closed(handle)``
when they are closed, so that a leak check (the pytest plugin's) can name each one left
open.  Nothing is recorded until a leak check asks for it with
``open_handles()``: until then each call costs one test of a global.  From
then on a handle is held by a weak reference, never kept alive by the
record, and one collected without being closed is still named.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
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


# ------------------------------------------------------------- open handles


@dataclass(frozen=True)
class _Entry:
    serial: int
    ref: weakref.ref[Any]
    description: str


class OpenHandles:
    """The handles opened and not closed yet, each numbered in the order it was opened.

    No lock: ``opened`` and ``closed`` run on the loops of any thread, and a
    weak reference's callback wherever the garbage collector runs (also in
    the middle of a method here, on the same thread), so every step is one
    dict or list operation, atomic as such.
    """

    def __init__(self) -> None:
        self._serials = itertools.count(1)
        self._open: dict[int, _Entry] = {}
        self._collected: list[tuple[int, str]] = []

    def mark(self) -> int:
        """A mark: ``since(mark)`` tells the handles opened after this call."""
        return next(self._serials)

    def add(self, handle: object) -> None:
        key = id(handle)

        def gone(ref: weakref.ref[Any]) -> None:
            entry = self._open.get(key)
            if entry is not None and entry.ref is ref:
                self._open.pop(key, None)
                self._collected.append((entry.serial, entry.description))

        entry = _Entry(next(self._serials), weakref.ref(handle, gone), _describe(handle))
        self._open[key] = entry

    def discard(self, handle: object) -> None:
        entry = self._open.get(id(handle))
        if entry is not None and entry.ref() is handle:
            self._open.pop(id(handle), None)

    def since(self, mark: int) -> tuple[list[object], list[str]]:
        """The handles opened after ``mark`` and not closed, and forget them.

        Returns:
            The ones still alive, oldest first, and the descriptions (a
            handle's type and name) of those garbage-collected without being
            closed.
        """
        alive: list[tuple[int, object]] = []
        for key, entry in self._open.copy().items():
            handle = entry.ref()
            if entry.serial > mark and handle is not None:
                alive.append((entry.serial, handle))
                self._open.pop(key, None)
        collected, self._collected = self._collected, []
        alive.sort(key=lambda pair: pair[0])
        return (
            [handle for _, handle in alive],
            [description for serial, description in sorted(collected) if serial > mark],
        )


def _describe(handle: object) -> str:
    """``PContext 'trainer'``: what stays true of a handle once it is gone."""
    name = getattr(handle, "name", None)
    return f"{type(handle).__name__} {name!r}" if isinstance(name, str) else repr(handle)


_open_handles: OpenHandles | None = None
_open_handles_made = threading.Lock()


def handle_opened(handle: object) -> None:
    """``handle`` is open: a leak check names it until ``handle_closed(handle)``."""
    if _open_handles is not None:
        _open_handles.add(handle)


def handle_closed(handle: object) -> None:
    """``handle`` was closed (a second call, or one for a handle never opened, does nothing)."""
    if _open_handles is not None:
        _open_handles.discard(handle)


def open_handles() -> OpenHandles:
    """The record of open handles, kept from the first call on (for a leak check)."""
    global _open_handles
    with _open_handles_made:
        if _open_handles is None:
            _open_handles = OpenHandles()
    return _open_handles


def opening(start: Callable[[], Awaitable[T]]) -> Callable[[], Awaitable[T]]:
    """``start``, whose handle is ``handle_opened`` once it has started."""

    async def start_and_note() -> T:
        handle = await start()
        handle_opened(handle)
        return handle

    return start_and_note
