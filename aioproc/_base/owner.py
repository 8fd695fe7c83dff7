"""The one shape of owned concurrent work: a task group held by a task of its own.

The handles users open (a group of workers, a pool, a cluster, a tail) are
opened in one task and closed in another, and often outlive both, so their
work cannot live in the caller's task group.  Each holds an ``Owner``
instead: ``start`` runs the handle's body in a fresh task, inside an anyio
task group whose children the body starts; ``request_close`` tells the body
to end (the first request's value wins); ``close`` requests and waits,
shielded; ``wait`` waits.  The group ends only when every child has, and an
error escaping the body (a bug in the handle) is re-raised by ``wait``,
never hidden.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import anyio
import anyio.abc

from .shield import shielded

T = TypeVar("T")

Body = Callable[[anyio.abc.TaskGroup], Awaitable[None]]


class Owner(Generic[T]):
    """The task that owns a handle's concurrent work (see the module docstring).

    ``T`` is what a close request carries (a signal and a grace period, or
    ``None``).  The owner is started once; before that it owns nothing and
    closing it does nothing.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.group: anyio.abc.TaskGroup | None = None
        """The task group, while the body runs (children are started here)."""
        self._task: asyncio.Task[None] | None = None
        self._request: asyncio.Future[T] | None = None
        self._opened: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        if self._task is None:
            state = "new"
        elif self._task.done():
            state = "done"
        else:
            state = "closing" if self.close_requested else "running"
        return f"<Owner {self.name} {state}>"

    @property
    def started(self) -> bool:
        """True once ``start`` was called."""
        return self._task is not None

    @property
    def done(self) -> bool:
        """True once the owner task has ended (every child with it)."""
        return self._task is not None and self._task.done()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the owner runs on (``None`` before ``start``)."""
        return self._task.get_loop() if self._task is not None else None

    @property
    def close_requested(self) -> bool:
        """True once a close was requested."""
        return self._request is not None and self._request.done()

    def start(
        self,
        body: Body,
        *,
        on_error: Callable[[], Awaitable[None]] | None = None,
        after: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Start the owner task: ``body(group)`` runs inside the task group.

        Args:
            body: the handle's work; it starts children in the group, and
                usually ends by awaiting :meth:`closing` and stopping them.
            on_error: run shielded when anything escapes the group, before
                it propagates (e.g. kill every worker at once).
            after: run shielded once the group has ended, however it ended.

        Raises:
            RuntimeError: the owner was started before.
        """
        if self._task is not None:
            raise RuntimeError(f"{self!r} was started before")
        loop = asyncio.get_running_loop()
        self._request = loop.create_future()
        self._opened = loop.create_future()
        self._task = loop.create_task(self._own(body, on_error, after), name=self.name)

    async def _own(
        self,
        body: Body,
        on_error: Callable[[], Awaitable[None]] | None,
        after: Callable[[], Awaitable[None]] | None,
    ) -> None:
        assert self._opened is not None
        try:
            async with anyio.create_task_group() as group:
                self.group = group
                self._opened.set_result(None)
                await body(group)
        except BaseException:
            if on_error is not None:
                with anyio.CancelScope(shield=True):
                    await on_error()
            raise
        finally:
            self.group = None
            if not self._opened.done():
                self._opened.set_result(None)  # nobody waits for a group that never opened
            if after is not None:
                with anyio.CancelScope(shield=True):
                    await after()

    async def opened(self) -> None:
        """Wait until the body runs (its task group can take children).

        Cancellation: the owner goes on; the caller closes it.
        """
        assert self._opened is not None, "start() first"
        await asyncio.shield(self._opened)

    def request_close(self, value: T) -> bool:
        """Ask the body to end with ``value``; False if a close was requested already.

        A later request does not replace the first one's value (the caller
        may act on it otherwise, e.g. bring a deadline forward).
        """
        if self._request is None or self._request.done():
            return False
        self._request.set_result(value)
        return True

    async def closing(self, default: T) -> T:
        """Inside the body: wait for a close request and return its value.

        Returns ``default`` instead when the owner task itself is cancelled
        (the loop shutting down with the handle still open), so the body
        goes on to stop what it owns.
        """
        assert self._request is not None
        try:
            return await asyncio.shield(self._request)
        except asyncio.CancelledError:
            return default

    def cancel(self) -> None:
        """Cancel the body and every child now (an abandoned close)."""
        if self._task is not None:
            self._task.cancel()

    async def wait(self) -> None:
        """Wait until the owner task has ended; re-raise what escaped it.

        Cancellation: the owner goes on; callers that must see the end run
        this shielded (as :meth:`close` does).
        """
        if self._task is None:
            return
        await asyncio.wait({self._task})
        if not self._task.cancelled():
            error = self._task.exception()
            if error is not None:
                raise error  # a bug in the handle itself: never hidden

    async def close(self, value: T) -> None:
        """Request a close with ``value`` and wait for the owner to end.

        Every caller waits for the one close.

        Cancellation: shielded; a cancellation arriving meanwhile is
        re-raised once the owner has ended.  It is bounded by what the body
        does once asked to close.
        """
        self.request_close(value)
        await shielded(self.wait())
