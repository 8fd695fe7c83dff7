"""Backpressure between the output readers and the buffers they feed.

Every consumer of tee'd output that buffers (the console writer, the queue of
an async ``CallbackSink``, an ``OutputStream``) owns a ``Flow``.  It is
*held* while the buffer is above its high-water mark and *released* once it
drained below its low-water mark; the readers (``TeeProtocol``) watch the
flows of their sinks and pause their pipe transport while any of them is
held, so a worker that outpaces its consumers blocks on its own pipe instead
of growing the supervisor's memory.

A flow may have several holders (a ``ConsoleSink`` is held by each console
writer it uses that is full), and several watchers (one reader per worker
stream); it is blocked while it has a holder.

Backpressure is right, silence is not: a consumer nobody drains (an
``OutputStream`` read only after the group finished) would freeze its
workers without a word.  So a flow may carry a ``StallWatch``: the readers
it pauses report themselves to it, and when some stay paused longer than
its threshold, one warning names the consumer, the workers and what is
pending.  A timer armed when the first reader pauses and cancelled when the
last resumes does this; nothing polls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable

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
    """Whether one bounded buffer wants its producers to pause."""

    __slots__ = ("_holders", "_watchers", "stall")

    def __init__(self, stall: StallWatch | None = None) -> None:
        self._holders: set[Hashable] = set()
        self._watchers: list[FlowWatcher] = []
        self.stall = stall
        """Told by the readers when this flow pauses them (see ``StallWatch``)."""

    @property
    def blocked(self) -> bool:
        return bool(self._holders)

    def hold(self, holder: Hashable) -> None:
        """Block on behalf of ``holder`` (idempotent per holder)."""
        was = bool(self._holders)
        self._holders.add(holder)
        if not was:
            self._notify(True)

    def release(self, holder: Hashable) -> None:
        """Drop ``holder``'s block; unblocks once no holder is left."""
        if holder not in self._holders:
            return
        self._holders.discard(holder)
        if not self._holders:
            self._notify(False)

    def watch(self, watcher: FlowWatcher) -> None:
        """Call ``watcher`` on every change (and now, if currently blocked)."""
        self._watchers.append(watcher)
        if self._holders:
            watcher(self, True)

    def unwatch(self, watcher: FlowWatcher) -> None:
        try:
            self._watchers.remove(watcher)
        except ValueError:
            pass

    def _notify(self, blocked: bool) -> None:
        for watcher in list(self._watchers):
            watcher(self, blocked)


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
