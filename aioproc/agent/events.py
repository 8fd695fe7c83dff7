"""Structured agent events, delivered to callbacks and async iterators.

The agent publishes an ``AgentEvent`` for every worker start and exit, each
attempt's start and outcome, every scheduled restart (with its backoff
delay), watchdog expiries, signals and the final verdict.  Publishing never
blocks: every subscriber has its own unbounded queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AgentEvent", "EventHub"]

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


@dataclass(frozen=True)
class AgentEvent:
    """One thing that happened to the worker group.

    Attributes:
        kind: one of ``worker_started``, ``worker_exited``,
            ``attempt_started``, ``attempt_failed``, ``restart_scheduled``,
            ``watchdog_fired``, ``signal_received``, ``group_succeeded``,
            ``group_failed``.
        time: wall-clock time (``time.time()``) it happened.
        role: the worker role.
        attempt: the restart count (``TORCHELASTIC_RESTART_COUNT``).
        local_rank, rank, pid: the worker concerned, if any.
        exitcode: exit code (negative: killed by that signal), for exits.
        signal: signal name for exits by signal and ``signal_received``.
        delay: backoff seconds, for ``restart_scheduled``.
        message: human-readable detail.
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

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class EventHub:
    """Fans events out to callbacks and subscribers."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[AgentEvent], Any]] = []
        self._queues: list[asyncio.Queue[AgentEvent | None]] = []
        self._closed = False
        self.history: list[AgentEvent] = []

    def add_callback(self, fn: Callable[[AgentEvent], Any]) -> None:
        self._callbacks.append(fn)

    def publish(self, event: AgentEvent) -> None:
        self.history.append(event)
        for fn in list(self._callbacks):
            try:
                fn(event)
            except Exception:
                logger.exception("agent event callback %r failed on %s", fn, event.kind)
        for q in self._queues:
            q.put_nowait(event)

    def close(self) -> None:
        self._closed = True
        for q in self._queues:
            q.put_nowait(None)

    def subscribe(self) -> AsyncIterator[AgentEvent]:
        """Events from now on, until the agent's run ends."""
        q: asyncio.Queue[AgentEvent | None] = asyncio.Queue()
        if self._closed:
            q.put_nowait(None)
        self._queues.append(q)
        return self._iterate(q)

    async def _iterate(self, q: asyncio.Queue[AgentEvent | None]) -> AsyncIterator[AgentEvent]:
        try:
            while (event := await q.get()) is not None:
                yield event
        finally:
            if q in self._queues:
                self._queues.remove(q)
