"""Structured agent events, delivered to callbacks and async iterators.

The agent publishes an ``AgentEvent`` for every worker start and exit, each
attempt's start and outcome, every scheduled restart (with its backoff
delay), watchdog expiries, signals and the final verdict.

Memory stays bounded however long the agent runs and however slow its
readers are: the history keeps the last ``HISTORY_SIZE`` events, and each
async-iterator reader has a buffer of ``STREAM_BUFFER`` events that drops its
oldest event when full (counted and announced to that reader with an
``events_dropped`` event).  Publishing never blocks and never waits for a
reader; callbacks run synchronously, so they must be quick.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..results import Usage

__all__ = ["AgentEvent", "EventHub", "EventStream"]

logger = logging.getLogger("aioproc")

# kinds
WORKER_STARTED = "worker_started"
WORKER_EXITED = "worker_exited"
ATTEMPT_STARTED = "attempt_started"
ATTEMPT_FAILED = "attempt_failed"
RESTART_SCHEDULED = "restart_scheduled"
WATCHDOG_FIRED = "watchdog_fired"
SIGNAL_RECEIVED = "signal_received"
GROUP_SUCCEEDED = "group_succeeded"
GROUP_FAILED = "group_failed"
GROUP_STOPPED = "group_stopped"
RENDEZVOUS_STARTED = "rendezvous_started"  # joining a round (several hosts)
RENDEZVOUS_COMPLETED = "rendezvous_completed"
WORLD_CHANGED = "world_changed"  # a host lost or arriving: the world is re-formed
EVENTS_DROPPED = "events_dropped"  # to one reader only, never in the history

HISTORY_SIZE = 1000
"""Events an agent keeps in ``event_history`` by default (the last ones)."""

STREAM_BUFFER = 1000
"""Events buffered for one ``agent.events()`` reader by default."""


@dataclass(frozen=True)
class AgentEvent:
    """One thing that happened to the worker group.

    Attributes:
        kind: one of ``worker_started``, ``worker_exited``,
            ``attempt_started``, ``attempt_failed``, ``restart_scheduled``,
            ``watchdog_fired``, ``signal_received``, ``group_succeeded``,
            ``group_failed``, ``group_stopped`` (ended by ``stop()``), and,
            for one async-iterator reader only, ``events_dropped``.
        time: wall-clock time (``time.time()``) it happened.
        role: the worker role.
        attempt: the restart count (``TORCHELASTIC_RESTART_COUNT``).
        local_rank, rank, pid: the worker concerned, if any.
        exitcode: exit code (negative: killed by that signal), for exits.
        signal: signal name for exits by signal and ``signal_received``.
        delay: backoff seconds, for ``restart_scheduled``.
        message: human-readable detail.
        dropped: events lost by this reader, for ``events_dropped``.
        usage: what the worker used (``aioproc.Usage``), for a
            ``worker_exited`` whose process was already reaped: the exits
            of workers a stop ended; None for a worker that exited on its
            own (its process is reaped later: ``RunResult.usage`` has it).
        oom: the kernel's OOM kill of the worker in words, for its
            ``worker_exited``; None otherwise.
    """

    kind: str
    role: str
    attempt: int
    time: float = field(default_factory=time.time)
    local_rank: int | None = None
    rank: int | None = None
    pid: int | None = None
    exitcode: int | None = None
    signal: str | None = None
    delay: float | None = None
    message: str = ""
    dropped: int | None = None
    usage: Usage | None = None
    oom: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set, JSON-ready (``usage`` as a dict of its figures)."""
        fields = {k: v for k, v in self.__dict__.items() if v is not None}
        if self.usage is not None:
            fields["usage"] = dataclasses.asdict(self.usage)
        return fields


class EventStream:
    """An async iterator over agent events with a bounded buffer (``agent.events()``).

    Publishing never waits for a reader: when the buffer is full the oldest
    buffered event is dropped.  Dropped events are counted in ``dropped`` and
    announced in order: the next event the reader gets is an
    ``events_dropped`` event whose ``dropped`` field says how many were lost
    there, followed by the events kept.  The stream ends when the agent's
    run ends.
    """

    def __init__(self, hub: EventHub, maxsize: int) -> None:
        self._hub = hub
        self.maxsize = maxsize
        self.dropped = 0
        """Events dropped so far because this reader fell behind."""
        self._buffer: collections.deque[AgentEvent] = collections.deque()
        self._unannounced = 0
        self._ended = False
        self._wakeup: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        state = "ended" if self._ended else "open"
        return (
            f"<EventStream {state} buffered={len(self._buffer)}/{self.maxsize} "
            f"dropped={self.dropped}>"
        )

    def _put(self, event: AgentEvent) -> None:
        if len(self._buffer) >= self.maxsize:
            self._buffer.popleft()
            self.dropped += 1
            self._unannounced += 1
        self._buffer.append(event)
        self._wake()

    def _end(self) -> None:
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> AgentEvent:
        while not self._buffer:
            if self._ended:
                self._hub._unsubscribe(self)
                raise StopAsyncIteration
            if self._wakeup is None or self._wakeup.done():
                self._wakeup = asyncio.get_running_loop().create_future()
            # asyncio.wait: a cancelled reader leaves the future to other readers
            await asyncio.wait({self._wakeup})
        if self._unannounced:
            n, self._unannounced = self._unannounced, 0
            after = self._buffer[0]
            return AgentEvent(
                kind=EVENTS_DROPPED,
                role=after.role,
                attempt=after.attempt,
                time=after.time,
                dropped=n,
                message=f"{n} event(s) dropped here: this reader fell behind "
                f"(buffer of {self.maxsize})",
            )
        return self._buffer.popleft()

    async def aclose(self) -> None:
        """Stop receiving events now (a stream nobody references is dropped anyway)."""
        self._ended = True
        self._buffer.clear()
        self._hub._unsubscribe(self)


class EventHub:
    """Fans events out to callbacks and subscribers; keeps a bounded history.

    Args:
        history_size: events kept in ``history`` (the oldest are forgotten).
    """

    def __init__(self, history_size: int = HISTORY_SIZE) -> None:
        self._callbacks: list[Callable[[AgentEvent], Any]] = []
        # weak: a stream its reader abandoned (``break``) costs nothing afterwards
        self._streams: weakref.WeakSet[EventStream] = weakref.WeakSet()
        self._closed = False
        self.history: collections.deque[AgentEvent] = collections.deque(maxlen=history_size)

    def add_callback(self, fn: Callable[[AgentEvent], Any]) -> None:
        self._callbacks.append(fn)

    def publish(self, event: AgentEvent) -> None:
        """Record ``event`` and hand it to every callback and stream; never blocks."""
        self.history.append(event)
        for fn in list(self._callbacks):
            try:
                fn(event)
            except Exception:
                logger.exception("agent event callback %r failed on %s", fn, event.kind)
        for stream in list(self._streams):
            stream._put(event)

    def close(self) -> None:
        """End every stream (after the events already buffered)."""
        self._closed = True
        for stream in list(self._streams):
            stream._end()

    def subscribe(self, maxsize: int = STREAM_BUFFER) -> EventStream:
        """Events from now on, until the agent's run ends."""
        stream = EventStream(self, maxsize)
        if self._closed:
            stream._end()
        self._streams.add(stream)
        return stream

    def _unsubscribe(self, stream: EventStream) -> None:
        self._streams.discard(stream)
