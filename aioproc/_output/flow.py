"""Backpressure between the output readers and the buffers they feed.

Every consumer of tee'd output that buffers (the console writer, the queue of
an async ``CallbackSink``, an ``OutputStream``, a third-party sink) owns a
``Flow``.  It is *held* while the buffer is above its high-water mark and
*released* once it drained below its low-water mark; the readers
(``TeeProtocol``) watch the flows of their sinks (``Sink.flow``) and pause
their pipe transport while any of them is held, so a worker that outpaces
its consumers blocks on its own pipe instead of growing the supervisor's
memory.  ``Flow`` is public (``aioproc.sinks.Flow``): it is the whole of a
sink's part in backpressure.

A flow may have several holders (a ``ConsoleSink`` is held by each console
writer it uses that is full), and several watchers (one reader per worker
stream); it is blocked while it has a holder.

Backpressure is right, silence is not: a consumer nobody drains (an
``OutputStream`` read only after the group finished) would freeze its
workers without a word.  So a flow made for a sink carries a ``StallWatch``:
the readers it pauses report themselves to it, and when some stay paused
longer than its threshold, one warning names the sink, the workers and what
is pending (``Sink.describe_pending``).  A timer armed when the first
reader pauses and cancelled when the last resumes does this; nothing polls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable

from .._base.checks import check_duration

FlowWatcher = Callable[["Flow", bool], None]
"""Called with (the flow, whether it is now blocked) on every change."""

HIGH_WATER = 1 << 20
"""Bytes a consumer may buffer before the readers feeding it pause (1 MiB)."""

LOW_WATER = 256 << 10
"""Bytes below which a paused consumer lets the readers resume (256 KiB)."""

HARD_LIMIT = 64 << 20
"""Bytes past which a consumer drops lines (counted) instead of buffering them.

Only reachable when readers ignore backpressure: once a worker has exited
its pipe is read to the end so the log file is complete, and what a
detached descendant keeps writing could otherwise grow without bound."""

RECORD_OVERHEAD = 200
"""Bytes counted per queued line on top of its text: the Python objects around it."""

STALL_WARNING = 10.0
"""Seconds a consumer may keep workers paused before a warning names it.

The default of the ``stall_warning`` argument of the sinks that buffer
(``ConsoleSink``, ``CallbackSink``, ``OutputStream``)."""

logger = logging.getLogger("aioproc")


class Flow:
    """A sink's valve: while it is held, the workers feeding the sink pause.

    A sink that buffers what it is given (a queue a task of its own
    drains, a socket with a bounded send buffer) makes one flow and keeps
    it in its ``flow`` attribute (``Sink.flow``).  The output readers of
    every group the sink is given to watch it: while it is held they stop
    reading the workers' pipes, so each worker blocks on its own full pipe,
    nothing is lost and the supervisor's memory stays bounded; once it is
    released they read on.  The sink holds it when its buffer passes a
    high-water mark and releases it when the buffer drained below a lower
    one.  Lines already read when the flow is held still arrive (at most a
    read's worth per stream), and so does what a worker left in its pipe
    when it exited: the log files must get every byte.

    A flow made for a sink (``Flow(sink)``) also watches how long it holds
    workers back: past ``stall_warning`` seconds, one warning on the
    ``aioproc`` logger names the sink (its ``repr``), the workers it holds
    back, what it has pending (``sink.describe_pending()``) and ``hint``;
    an info line says when they resume.

    Use it on the event loop thread (where sinks are called), as
    everything in a sink.

    Args:
        sink: the sink it belongs to, named by the stall warning; ``None``:
            a flow of its own (an inner buffer's), which never warns.
        stall_warning: seconds the sink may keep workers paused before the
            warning (default ``STALL_WARNING``, 10 s); ``None``: never.
        hint: what the user can do about a stall, closing the warning.

    Raises:
        TypeError, ValueError: ``stall_warning`` is not a number of seconds
            >= 0 or None; ``hint`` is not a str.

    Usage::

        class Uploader(Sink):
            def __init__(self) -> None:
                self.flow = Flow(self, hint="the upload is slower than the workers")
                ...

            def lines(self, rank, stream, prefix, lines):
                self._queue.extend(lines)
                if len(self._queue) > 10_000:
                    self.flow.hold()  # the workers pause

            async def _upload(self):  # a task of the sink's own
                ...
                if len(self._queue) < 1_000:
                    self.flow.release()  # they read on
    """

    __slots__ = ("_holders", "_stall", "_watchers")

    def __init__(
        self,
        sink: object = None,
        *,
        stall_warning: float | None = STALL_WARNING,
        hint: str = "the sink is slower than the workers' output",
    ) -> None:
        after = check_duration("stall_warning", stall_warning, allow_none=True)
        if not isinstance(hint, str):
            raise TypeError(f"hint must be a str, got {hint!r}")
        self._holders: set[Hashable] = set()
        self._watchers: list[FlowWatcher] = []
        self._stall = None if sink is None else StallWatch(sink, _pending_of(sink), hint, after)

    def __repr__(self) -> str:
        return f"<Flow {'held' if self._holders else 'open'}>"

    @property
    def blocked(self) -> bool:
        """True while the flow is held (by any holder)."""
        return bool(self._holders)

    def hold(self, holder: Hashable = None) -> None:
        """Pause the workers feeding the sink, on behalf of ``holder``.

        Idempotent per holder: holding twice needs one release.

        Args:
            holder: who holds it (any hashable, default ``None``); a sink
                with several buffers holds once per full buffer, and the
                flow stays held until each has released.
        """
        was = bool(self._holders)
        self._holders.add(holder)
        if not was:
            self._notify(True)

    def release(self, holder: Hashable = None) -> None:
        """Drop ``holder``'s hold; the workers read on once no holder is left.

        Releasing a holder that does not hold it does nothing.
        """
        if holder not in self._holders:
            return
        self._holders.discard(holder)
        if not self._holders:
            self._notify(False)

    def watch(self, watcher: FlowWatcher) -> None:
        """Call ``watcher(flow, blocked)`` on every change (and now, if held).

        The output readers watch their sinks' flows; a sink made of inner
        buffers may watch theirs too and hold its own flow while one is held.
        """
        self._watchers.append(watcher)
        if self._holders:
            watcher(self, True)

    def unwatch(self, watcher: FlowWatcher) -> None:
        """Stop calling ``watcher`` (not watching: nothing)."""
        try:
            self._watchers.remove(watcher)
        except ValueError:
            pass

    def _notify(self, blocked: bool) -> None:
        for watcher in list(self._watchers):
            watcher(self, blocked)


def stall_of(flow: Flow) -> StallWatch | None:
    """The stall watch of ``flow`` (what the readers report their pauses to), if any."""
    return flow._stall


def _pending_of(sink: object) -> Callable[[], str]:
    """What the stall warning says ``sink`` holds: its ``describe_pending()``."""
    describe = getattr(sink, "describe_pending", None)
    if not callable(describe):
        return lambda: "holds lines it has not taken yet"
    return lambda: str(describe())


def format_size(n: int) -> str:
    """``n`` bytes for a person: ``512 bytes``, ``64.0 KiB``, ``1.0 MiB``."""
    if n < 1024:
        return f"{n} bytes"
    if n < 1 << 20:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1 << 20):.1f} MiB"


_NAMED = 8
"""Paused workers named in a stall warning; the rest are counted."""


class StallWatch:
    """Warns once when one consumer keeps its workers paused too long.

    A reader calls ``paused`` while the consumer's flow holds it back and
    ``resumed`` once it does not any more (the flow released it, or its
    worker exited and it reads regardless).  An episode runs from the first
    reader paused to the last resumed: its first ``paused`` arms a timer of
    ``after`` seconds, its last ``resumed`` cancels it.  If the timer fires,
    one warning names the consumer, what it holds, the paused workers and
    what to do; when a warned episode ends, an info line says how long it
    lasted.

    Args:
        sink: the consumer, named by its ``repr``.
        pending: says what it holds, e.g. ``"holds 1.0 MiB (900 lines) unread"``.
        hint: what the user can do, appended to the warning.
        after: the threshold in seconds; ``None`` never warns.
    """

    __slots__ = (
        "_after",
        "_hint",
        "_named",
        "_pending",
        "_readers",
        "_since",
        "_sink",
        "_timer",
    )

    def __init__(
        self, sink: object, pending: Callable[[], str], hint: str, after: float | None
    ) -> None:
        self._sink = sink
        self._pending = pending
        self._hint = hint
        self._after = after
        self._readers: dict[Hashable, str] = {}  # paused reader -> "trainer/1 (stdout)"
        self._timer: asyncio.TimerHandle | None = None
        self._since = 0.0
        self._named = ""  # the workers a warning of this episode named

    def paused(self, reader: Hashable, label: str) -> None:
        """``reader`` (called ``label`` in the warning) is held back by this consumer."""
        if self._after is None or reader in self._readers:
            return
        self._readers[reader] = label
        if len(self._readers) == 1:
            loop = asyncio.get_running_loop()
            self._since = loop.time()
            self._named = ""
            self._timer = loop.call_later(self._after, self._fire, loop)

    def resumed(self, reader: Hashable) -> None:
        """``reader`` is not held back by this consumer any more."""
        if self._readers.pop(reader, None) is None or self._readers:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._named:
            logger.info(
                "output of %s resumed after %.1f s paused by sink %s",
                self._named,
                asyncio.get_running_loop().time() - self._since,
                self._safely(lambda: repr(self._sink), "?"),
            )
            self._named = ""

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if not self._readers:
            return
        labels = list(dict.fromkeys(self._readers.values()))
        one = len(labels) == 1
        named = ", ".join(labels[:_NAMED])
        if len(labels) > _NAMED:
            named += f" and {len(labels) - _NAMED} more"
        self._named = f"{'worker' if one else 'workers'} {named}"
        logger.warning(
            "output of %s has been paused for %.1f s: sink %s %s; %s until the sink "
            "takes more (%s)",
            self._named,
            loop.time() - self._since,
            self._safely(lambda: repr(self._sink), "?"),
            self._safely(self._pending, "holds unread lines"),
            "the worker blocks on its pipe" if one else "the workers block on their pipes",
            self._hint,
        )

    @staticmethod
    def _safely(describe: Callable[[], str], fallback: str) -> str:
        try:
            return describe()
        except Exception:  # a sink's repr must not break the readers
            logger.debug("describing a stalled sink failed", exc_info=True)
            return fallback
