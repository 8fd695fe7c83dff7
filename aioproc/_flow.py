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
"""

from __future__ import annotations

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


class Flow:
    """Whether one bounded buffer wants its producers to pause."""

    __slots__ = ("_holders", "_watchers")

    def __init__(self) -> None:
        self._holders: set[Hashable] = set()
        self._watchers: list[FlowWatcher] = []

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
