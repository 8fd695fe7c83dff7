"""What a persistent worker's calls wait for: the turn of its sync requests, its call slots.

``Turn``: one sync request (call or ping) at a time, in arrival order.
``Slots``: at most ``max_concurrency`` calls in flight, the others wait in
arrival order.  Both hand what is released straight to the first waiter,
so nobody arriving meanwhile overtakes it, and both are taken without a
coroutine when free, the case of every call made one after the other.
"""

from __future__ import annotations

import asyncio
import collections

__all__ = ["Slots", "Turn"]


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


class Slots:
    """At most ``limit`` holders at once; the others wait in arrival order.

    ``asyncio.Semaphore``'s contract with ``Turn``'s hand-over: a released
    slot goes to the first waiter (``used`` stays), and a waiter cancelled
    as the slot reached it passes it on.
    """

    __slots__ = ("_waiters", "limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def take_now(self) -> bool:
        if self.used >= self.limit or self._waiters:
            return False
        self.used += 1
        return True

    async def take(self) -> None:
        """Wait for a slot.

        Cancellation: a waiter cancelled before its slot came leaves the
        queue; one cancelled as it came passes it on.
        """
        if self.take_now():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()
            else:
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on: still used
                return
        self.used -= 1
