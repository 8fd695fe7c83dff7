"""Which of a pool's positions are free, and who waits for one.

A call takes a free position (the one freed longest ago) or queues, first
come first served, until one is given back; a position is busy from
``take`` until ``give_back``.  With an ``idle_timeout`` a free position is
timed: once it has been free that long its number goes to ``expired``, for
the pool's owner task to retire its worker (a timer is a plain loop
callback, where no task group can be used).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable

__all__ = ["Dispatch"]


class Dispatch:
    """The free and busy positions of one pool and the calls waiting (see the module)."""

    def __init__(self, idle_timeout: float | None) -> None:
        self._idle_timeout = idle_timeout
        self.idle: collections.deque[int] = collections.deque()  # free, first freed first
        self.busy: set[int] = set()
        self._waiters: collections.deque[asyncio.Future[int]] = collections.deque()
        self._timers: dict[int, asyncio.TimerHandle] = {}
        # positions whose idle timer fired (at most one entry per worker)
        self.expired: asyncio.Queue[int] = asyncio.Queue()
        self._stopped = False  # nothing is handed over or timed any more

    def queued(self) -> int:
        """How many calls wait for a position."""
        return sum(not fut.done() for fut in self._waiters)

    def free(self, positions: Iterable[int]) -> None:
        """Make ``positions`` free for the first time (their workers just started)."""
        for i in positions:
            self.idle.append(i)
            self._time(i)

    async def take(self) -> int:
        """A free position, now or once one is given back; busy until ``give_back``.

        Cancellation: a waiter cancelled just as a position reached it gives
        it back; one cancelled before leaves the queue.
        """
        if self.idle:
            i = self.idle.popleft()
        else:
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                i = await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self.give_back(fut.result())  # handed over just as we were cancelled
                raise
        timer = self._timers.pop(i, None)
        if timer is not None:
            timer.cancel()
        self.busy.add(i)
        return i

    def give_back(self, i: int) -> None:
        """Position ``i`` is free again: to the first waiter, else to the idle list."""
        self.busy.discard(i)
        if self._stopped:
            return
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(i)
                return
        self.idle.append(i)
        self._time(i)

    def stop(self) -> None:
        """From now on nothing is handed over nor timed (the pool is stopping)."""
        self._stopped = True

    def close(self, error: Callable[[], Exception]) -> None:
        """``stop``, cancel the timers, and fail every waiter with ``error()``."""
        self.stop()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(error())
        self._waiters.clear()

    def _time(self, i: int) -> None:
        if self._idle_timeout is None or self._stopped:
            return
        loop = asyncio.get_running_loop()
        self._timers[i] = loop.call_later(self._idle_timeout, self._expire, i)

    def _expire(self, i: int) -> None:
        self._timers.pop(i, None)
        self.expired.put_nowait(i)
