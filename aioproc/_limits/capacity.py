"""``Capacity``: a budget of process slots that groups share, granted strictly in order.

A scheduler running many groups on one machine reserves a group's ranks
before starting it.  Requests are served first come, first served: a large
request at the head of the queue holds back later small ones even when
they would fit, so a big group is never starved by a stream of small ones.
The price is that slots may sit idle while the head waits; that is the
point of a fair queue.

Each waiter waits on a future of its own, resolved by whoever frees the
slots it needs: nothing polls, and a release wakes exactly the waiters that
now fit.  A waiter cancelled before its grant leaves the queue (and the
ones behind it may fit now); one cancelled after its grant, before it ran,
hands the slots straight back.  Either way it holds nothing.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from .._base import public_module
from .._metrics import hooks as _hooks


class Capacity:
    """A budget of ``total`` process slots, shared by every group that reserves from it.

    Use one per event loop; it is not thread-safe.

    Args:
        total: how many slots exist (e.g. processes the machine can hold).
        name: what the metrics call it (``aioproc_capacity_*{capacity=name}``).

    Raises:
        TypeError: ``total`` is not an int, or ``name`` not a str.
        ValueError: ``total`` is not positive, or ``name`` is empty.

    Example:
        ```python
        capacity = aioproc.Capacity(16)
        async with capacity.reserve(4):
            await aioproc.run(train, nprocs=4)
        ```
    """

    def __init__(self, total: int, *, name: str = "default") -> None:
        self._total = _check_slots("Capacity(total)", total)
        if not isinstance(name, str) or not name:
            raise (TypeError if not isinstance(name, str) else ValueError)(
                f"Capacity(name) must be a non-empty str, got {name!r}"
            )
        self.name = name
        self._in_use = 0
        self._queue: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._changed()

    def __repr__(self) -> str:
        return f"<Capacity {self._in_use}/{self._total} in use, {len(self._queue)} waiting>"

    def _changed(self) -> None:
        # the figures go to the metrics as they change: nothing samples them
        rec = _hooks.current
        if rec.enabled:
            rec.capacity(self.name, self._total, self._in_use, len(self._queue))

    @property
    def total(self) -> int:
        """How many slots exist."""
        return self._total

    @property
    def in_use(self) -> int:
        """How many slots are held now."""
        return self._in_use

    @property
    def waiting(self) -> int:
        """How many requests wait for slots."""
        return len(self._queue)

    async def acquire(self, k: int = 1) -> None:
        """Wait until ``k`` slots are free and every earlier request was served; take them.

        Args:
            k: how many slots.

        Raises:
            TypeError: ``k`` is not an int.
            ValueError: ``k`` is not positive or exceeds ``total``.

        Cancellation: a cancelled call holds no slot: it leaves the
        queue, or returns slots granted an instant before, and wakes the
        requests behind it that now fit.
        """
        k = _check_slots("k", k)
        if k > self._total:
            raise ValueError(f"cannot reserve {k} slots from a Capacity of {self._total}")
        if not self._queue and self._in_use + k <= self._total:
            self._in_use += k
            self._changed()
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (k, future)
        self._queue.append(entry)
        self._changed()
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self.release(k)  # granted, but the waiter never ran: give them back
            else:
                if entry in self._queue:  # a release may have dropped it already
                    self._queue.remove(entry)
                self._grant()  # a large head leaving may let the next ones fit
            raise

    def release(self, k: int = 1) -> None:
        """Give back ``k`` slots taken by ``acquire``; waiters that now fit are granted.

        Raises:
            TypeError: ``k`` is not an int.
            ValueError: ``k`` is not positive.
            RuntimeError: more slots than are held.
        """
        k = _check_slots("k", k)
        if k > self._in_use:
            raise RuntimeError(f"cannot release {k} slots: only {self._in_use} are in use")
        self._in_use -= k
        self._grant()

    @asynccontextmanager
    async def reserve(self, k: int = 1) -> AsyncIterator[None]:
        """``async with capacity.reserve(k):`` holds ``k`` slots for the block.

        Raises:
            TypeError: ``k`` is not an int.
            ValueError: ``k`` is not positive or exceeds ``total``.

        Cancellation: as ``acquire``; the slots are released however the
        block exits.
        """
        await self.acquire(k)
        try:
            yield
        finally:
            self.release(k)

    def _grant(self) -> None:
        """Hand slots to the waiters at the head of the queue, in order, while they fit."""
        while self._queue:
            k, future = self._queue[0]
            if future.done():  # cancelled; its waiter has not run yet
                self._queue.popleft()
                continue
            if self._in_use + k > self._total:
                break
            self._queue.popleft()
            self._in_use += k
            future.set_result(None)
        self._changed()


def _check_slots(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


# imported by users from the package itself: named so wherever it is reached from
public_module("aioproc", Capacity)
