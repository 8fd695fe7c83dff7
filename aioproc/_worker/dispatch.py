"""Which of a pool's positions take the next call, and who waits for one.

A coroutine call takes one of a position's ``max_concurrency`` slots, on
the least busy position that has one free (an idle one first, the one idle
longest); a sync call takes an idle position whole, as every call did
before coroutines ran in workers: a sync call has its worker to itself, so
cancelling it (which kills the worker) costs no other call.  A call that
finds no position queues, first come first served, until one is given
back: a sync call waiting for an idle position holds back the calls behind
it, so it is never starved.

With ``max_calls_per_worker`` each position counts the calls its worker
was handed (``take``, and ``count`` for the pool's ``run``): a worker handed
its last one takes no more, and once its calls are all back ``give_back``
says it is spent, for the pool to retire it; the position's count starts
afresh for the worker that replaces it.

With an ``idle_timeout`` an idle position is timed: once it has been idle
that long its number goes to ``expired``, for the pool's owner task to
retire its worker (a timer is a plain loop callback, where no task group
can be used).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable, KeysView

__all__ = ["Dispatch"]


class Dispatch:
    """The idle and busy positions of one pool and the calls waiting (see the module).

    Args:
        idle_timeout: seconds after which an idle position's number goes to
            ``expired``; None: never.
        max_concurrency: calls in flight on one position at most.
        max_calls: calls one worker is handed at most; None: no limit.
    """

    def __init__(
        self, idle_timeout: float | None, max_concurrency: int, max_calls: int | None = None
    ) -> None:
        self._idle_timeout = idle_timeout
        self._max_concurrency = max_concurrency
        self._max_calls = max_calls
        self.idle: collections.deque[int] = collections.deque()  # no call, first idle first
        self._load: dict[int, int] = {}  # calls in flight, per busy position
        self._whole: set[int] = set()  # busy positions a sync call holds
        self._left: dict[int, int] = {}  # calls each position's worker may still be handed
        # each waiter: the future its position resolves, and whether it is a coroutine call
        self._waiters: collections.deque[tuple[asyncio.Future[int], bool]] = collections.deque()
        self._timers: dict[int, asyncio.TimerHandle] = {}
        # positions whose idle timer fired (at most one entry per worker)
        self.expired: asyncio.Queue[int] = asyncio.Queue()
        self._stopped = False  # nothing is handed over or timed any more

    @property
    def busy(self) -> KeysView[int]:
        """The positions with calls in flight."""
        return self._load.keys()

    def load(self, i: int) -> int:
        """Calls in flight at position ``i``."""
        return self._load.get(i, 0)

    def queued(self) -> int:
        """How many calls wait for a position."""
        return sum(not fut.done() for fut, _ in self._waiters)

    def free(self, positions: Iterable[int]) -> None:
        """Make ``positions`` idle for the first time (their workers just started)."""
        for i in positions:
            if self._max_calls is not None:
                self._left[i] = self._max_calls
            self.idle.append(i)
            self._time(i)

    async def take(self, coroutine: bool) -> int:
        """A position for one call, now or once one is given back; hold it until ``give_back``.

        Cancellation: a waiter cancelled just as a position reached it gives
        it back, uncounted; one cancelled before leaves the queue.
        """
        if not self._waiters:
            idle = self.idle
            if idle and not self._left and not self._stopped:
                # the usual case: the position idle longest, no counts to keep
                first = idle.popleft()
                if self._timers:
                    timer = self._timers.pop(first, None)
                    if timer is not None:
                        timer.cancel()
                self._load[first] = 1
                if not coroutine:
                    self._whole.add(first)
                return first
            i = self._pick(coroutine)
            if i is not None:
                self._assign(i, coroutine)
                return i
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append((fut, coroutine))
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._untake(fut.result(), coroutine)  # handed over just as we were cancelled
            raise

    def give_back(self, i: int, coroutine: bool) -> bool:
        """One call at ``i`` ended: its slot goes to the waiters; no call left, ``i`` is idle.

        Returns:
            True when the worker at ``i`` is spent (handed its last call, and
            all are back): the caller retires it; the count starts afresh.
        """
        spent = self._drop(i, coroutine) and self._renew_if_spent(i)
        if self._waiters:
            self._serve()
        return spent

    def count(self, i: int) -> None:
        """The worker at ``i`` was handed a call outside ``take`` (the pool's ``run``)."""
        if i in self._left:
            self._left[i] -= 1

    def spent(self, i: int) -> bool:
        """Whether the worker at idle position ``i`` is spent; then its count starts afresh."""
        return i not in self._load and self._renew_if_spent(i)

    def stop(self) -> None:
        """From now on nothing is handed over nor timed (the pool is stopping)."""
        self._stopped = True

    def close(self, error: Callable[[], Exception]) -> None:
        """``stop``, cancel the timers, and fail every waiter with ``error()``."""
        self.stop()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for fut, _ in self._waiters:
            if not fut.done():
                fut.set_exception(error())
        self._waiters.clear()

    # ------------------------------------------------------------- internals

    def _open(self, i: int) -> bool:
        return self._left.get(i, 1) > 0

    def _pick(self, coroutine: bool) -> int | None:
        """The position the next call of this kind takes, or None if none can."""
        if self._stopped:
            return None
        for i in self.idle:  # no call in flight: the least busy there is
            if self._open(i):
                return i
        if not coroutine:
            return None  # a sync call takes an idle position only
        best, least = None, self._max_concurrency
        for i, n in self._load.items():
            if n < least and i not in self._whole and self._open(i):
                best, least = i, n
        return best

    def _assign(self, i: int, coroutine: bool) -> None:
        n = self._load.get(i, 0)
        if not n:
            self.idle.remove(i)
            timer = self._timers.pop(i, None)
            if timer is not None:
                timer.cancel()
        self._load[i] = n + 1
        if not coroutine:
            self._whole.add(i)
        if i in self._left:
            self._left[i] -= 1

    def _untake(self, i: int, coroutine: bool) -> None:
        """Undo ``_assign`` for a call that never went out (its waiter was cancelled)."""
        if i in self._left:
            self._left[i] += 1
        self._drop(i, coroutine)
        self._serve()

    def _drop(self, i: int, coroutine: bool) -> bool:
        """One call less at ``i``; True if it was the last one (the position is idle)."""
        if not coroutine:
            self._whole.discard(i)
        n = self._load.get(i, 0) - 1
        if n > 0:
            self._load[i] = n
            return False
        self._load.pop(i, None)
        if not self._stopped:
            self.idle.append(i)
            self._time(i)
        return True

    def _renew_if_spent(self, i: int) -> bool:
        if self._max_calls is None or self._left.get(i, 1) > 0:
            return False
        self._left[i] = self._max_calls  # for the worker that replaces it
        return True

    def _serve(self) -> None:
        """Hand positions to the waiters, first come first served, while the first can have one."""
        while self._waiters:
            fut, coroutine = self._waiters[0]
            if fut.done():  # cancelled, or failed by close()
                self._waiters.popleft()
                continue
            i = self._pick(coroutine)
            if i is None:
                return
            self._waiters.popleft()
            self._assign(i, coroutine)
            fut.set_result(i)

    def _time(self, i: int) -> None:
        if self._idle_timeout is None or self._stopped:
            return
        loop = asyncio.get_running_loop()
        self._timers[i] = loop.call_later(self._idle_timeout, self._expire, i)

    def _expire(self, i: int) -> None:
        self._timers.pop(i, None)
        self.expired.put_nowait(i)
