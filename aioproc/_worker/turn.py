"""One request at a time, in arrival order: the turn a persistent worker's calls take."""

from __future__ import annotations

import asyncio
import collections

__all__ = ["Turn"]


class Turn:
    """One request at a time, in arrival order (``asyncio.Lock``'s contract).

    Taken without a coroutine when free (``take_now``), the case of every
    call made one after the other; a waiter is handed the turn directly by
    ``release``, so nobody arriving meanwhile can overtake it.
    """

    __slots__ = ("_held", "_waiters")

    def __init__(self) -> None:
        self._held = False
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def locked(self) -> bool:
        return self._held

    def take_now(self) -> bool:
        if self._held or self._waiters:
            return False
        self._held = True
        return True

    def join(self) -> asyncio.Future[None] | None:
        """Take the turn now (None), or queue for it and return the place held.

        The caller must then ``wait`` for the place, or ``leave`` it.
        """
        if self.take_now():
            return None
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    async def wait(self, waiter: asyncio.Future[None] | None) -> None:
        """Wait until the place ``join`` returned reaches the turn.

        Cancellation: the place is left as ``leave`` does.
        """
        if waiter is None:
            return
        try:
            await waiter
        except asyncio.CancelledError:
            self.leave(waiter)
            raise

    def leave(self, waiter: asyncio.Future[None] | None) -> None:
        """Give up a place ``join`` returned: pass the turn on if it was ours."""
        if waiter is None or (waiter.done() and not waiter.cancelled()):
            self.release()
        else:
            try:
                self._waiters.remove(waiter)
            except ValueError:
                pass  # dropped by release() already

    async def take(self) -> None:
        """Wait for the turn.

        Cancellation: a waiter cancelled before its turn leaves the queue; one
        cancelled as the turn reached it passes the turn on.
        """
        await self.wait(self.join())

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the turn passes on: still held
                return
        self._held = False

    async def __aenter__(self) -> None:
        await self.take()

    async def __aexit__(self, *exc: object) -> None:
        self.release()
