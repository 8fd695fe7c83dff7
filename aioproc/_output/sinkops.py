"""Plumbing shared by the sinks and the output readers: error reports, bounded queues."""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import weakref
from collections.abc import Awaitable, Sequence
from typing import Any, Generic, TypeVar

from .flow import HARD_LIMIT, HIGH_WATER, LOW_WATER, RECORD_OVERHEAD, Flow
from .sink import Sink

logger = logging.getLogger("aioproc")

_reported: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
_reported_ids: dict[int, set[str]] = {}  # sinks that cannot be weakly referenced


def report_sink_error(sink: object, what: str) -> None:
    """Log the exception being handled, once per sink and method.

    Called from an ``except`` block.  Later failures of the same sink and
    method are logged at debug level only: a sink raising on every line
    must not flood the log.
    """
    try:
        seen = _reported.setdefault(sink, set())
    except TypeError:
        seen = _reported_ids.setdefault(id(sink), set())
    if what in seen:
        logger.debug("sink %r failed again in %s", sink, what, exc_info=True)
        return
    seen.add(what)
    logger.error(
        "sink %r raised in %s; ignored (the workers, log files and other sinks are "
        "unaffected; later failures of this sink are not logged)",
        sink,
        what,
        exc_info=True,
    )


T = TypeVar("T")

FAIR_SLICE = 0.002
"""Seconds a consumer of a ``LineQueue`` may run without letting the loop in."""


class LineQueue(Generic[T]):
    """A FIFO of records, bounded by their size in bytes, with backpressure.

    Past ``HIGH_WATER`` its flow is held (the readers pause); below
    ``LOW_WATER`` released.  Past ``HARD_LIMIT`` (readers that ignore
    backpressure: a worker's last output after it exited) records are
    dropped and counted in ``dropped``.  ``end()`` adds an end marker that is
    never dropped.  ``flow``: the flow it holds (a sink's own, which names
    the sink in stall warnings); None: one of its own.
    """

    def __init__(self, flow: Flow | None = None) -> None:
        self._items: collections.deque[tuple[T | None, int]] = collections.deque()
        self._cost = 0
        self.size = 0
        """Text bytes of the records queued."""
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.flow = Flow() if flow is None else flow
        self.dropped = 0
        self._resumed = 0.0  # loop time a get() last suspended (see get())

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T, size: int) -> bool:
        """Append ``item`` of ``size`` text bytes; False (dropped) past the hard limit."""
        cost = size + RECORD_OVERHEAD
        if self._cost + cost > HARD_LIMIT:
            self.dropped += 1
            return False
        self._items.append((item, cost))
        self._cost += cost
        self.size += size
        if self._cost >= HIGH_WATER:
            self.flow.hold(self)
        self._wake()
        return True

    def end(self) -> None:
        self._items.append((None, 0))
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    async def get(self) -> T | None:
        """The next record; None for the end marker.

        A consumer that keeps up never waits, and would then never let the
        loop run while a flood of lines is queued: after ``FAIR_SLICE``
        seconds without suspending, ``get`` yields once.
        """
        loop = asyncio.get_running_loop()
        if self._items and loop.time() - self._resumed > FAIR_SLICE:
            await asyncio.sleep(0)  # a fair turn for the loop, not a wait for a state
            self._resumed = loop.time()
        while not self._items:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._wake()  # pass the wake-up on to another getter
                raise
            self._resumed = loop.time()
        item, cost = self._items.popleft()
        self._cost -= cost
        if item is not None:
            self.size -= cost - RECORD_OVERHEAD
        if self._cost < LOW_WATER:
            self.flow.release(self)
        return item

    def clear(self) -> list[T]:
        """Remove and return every record (not end markers)."""
        items = [item for item, _ in self._items if item is not None]
        self._items.clear()
        self._cost = self.size = 0
        self.flow.release(self)
        return items


def discard(pending: Awaitable[Any] | None) -> None:
    """Close an awaitable that will never be awaited (no 'never awaited' warning)."""
    close = getattr(pending, "close", None)
    if inspect.iscoroutine(pending) and close is not None:
        close()


# -------------------------------------------------------------------- close

SINK_CLOSE_DEADLINE = 5.0
"""Seconds ``close_sinks`` waits in total for the sinks of a group to drain."""

_CANCEL_GRACE = 0.5
"""Seconds a sink's cancelled ``aclose()`` gets to unwind before it is left behind."""


async def close_sinks(sinks: Sequence[Sink], deadline: float | None = None) -> None:
    """Close every sink, giving them ``deadline`` seconds in total to drain.

    ``deadline`` defaults to ``SINK_CLOSE_DEADLINE`` (5 s).
    The sinks are closed concurrently.  Past the deadline, the ``aclose()``
    calls still running are cancelled and what the sinks still buffer is
    dropped; the number of lines lost is logged in one warning.  A sink
    whose ``aclose()`` raises is logged (``report_sink_error``).  Never
    raises for a sink's sake, so the caller's cleanup always completes.

    Cancellation: cancelling this cancels the ``aclose()`` calls, drops
    what is buffered and re-raises; callers run it shielded.
    """
    if not sinks:
        return
    if deadline is None:
        deadline = SINK_CLOSE_DEADLINE
    loop = asyncio.get_running_loop()
    tasks = {
        loop.create_task(_aclose(sink), name=f"aioproc-close-{sink!r}"): sink for sink in sinks
    }
    try:
        _, pending = await asyncio.wait(tasks, timeout=max(deadline, 0.0))
    except BaseException:
        pending = {t for t in tasks if not t.done()}
        _give_up(tasks, pending)
        raise
    late = _give_up(tasks, pending)
    if pending:
        _, stuck = await asyncio.wait(pending, timeout=_CANCEL_GRACE)
        for task in stuck:
            logger.error("sink %r did not stop when cancelled; left behind", tasks[task])
    if late:
        logger.warning(
            "%d line(s) of worker output were dropped: sink(s) %s had not taken them "
            "when the group closed (they get %g s to drain; a console that accepts "
            "nothing is given up sooner); the log files have every line",
            sum(n for _, n in late),
            ", ".join(repr(s) for s, _ in late),
            deadline,
        )


def _give_up(
    tasks: dict[asyncio.Task[None], Sink], pending: set[asyncio.Task[None]]
) -> list[tuple[Sink, int]]:
    """Cancel the pending closes, drop every sink's leftovers; lines lost per sink."""
    for task in pending:
        task.cancel()
    late: list[tuple[Sink, int]] = []
    for sink in tasks.values():
        try:
            n = sink.drop_pending()
        except Exception:
            report_sink_error(sink, "drop_pending()")
            continue
        if n:
            late.append((sink, n))
    return late


async def _aclose(sink: Sink) -> None:
    try:
        await sink.aclose()
    except Exception:
        report_sink_error(sink, "aclose()")
