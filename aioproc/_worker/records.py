"""What a pool keeps track of: a worker start in flight, a call in flight, ``PoolStats``."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from .process import Sent, WorkerProcess, coroutine_call, describe

__all__ = ["PoolCall", "PoolStart", "PoolStats"]


class PoolStart:
    """One start of a worker at one position, run by the pool's owner task.

    Any number of callers wait for ``finished`` (never cancelled by a
    waiter's cancellation: waiters use ``asyncio.wait``), then read
    ``worker`` or ``error``.
    """

    def __init__(self) -> None:
        self.scope = anyio.CancelScope()  # cancelled when the pool closes
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.worker: WorkerProcess | None = None
        self.error: BaseException | None = None

    async def outcome(self) -> WorkerProcess:
        """Wait for the start to end; its worker, or what made it fail.

        Cancellation: cancelling the waiter leaves the start running (the
        pool keeps the worker).
        """
        await asyncio.wait({self.finished})
        if self.error is not None:
            raise self.error
        assert self.worker is not None
        return self.worker


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """What a pool is doing at one moment (``WorkerPool.stats()``).

    Every position of the pool is in at most one of ``starting``, ``busy``
    and ``idle``; the ``size - starting - busy - idle`` others have no
    worker right now (retired after ``idle_timeout``, or dead and not yet
    replaced): they start one on their next call.

    Attributes:
        size: the number of worker positions.
        busy: positions running a call (``submit`` or ``run``).
        idle: positions whose live worker waits for a call.
        starting: positions whose worker is starting: the first start,
            a replacement, or a restart after ``idle_timeout``.
        queued: ``submit`` calls waiting for a free position.
        restarts: workers started after the first ones, since the pool
            opened: replacing one that died, was killed by a cancelled or
            timed-out call, or was recycled after ``max_calls_per_worker``
            calls, and restarting one retired after ``idle_timeout``.
            Counted when the start begins.
        completed: calls that returned a value (each worker's part of a
            ``run`` counts as one).
        failed: calls that raised: ``fn``'s own exception,
            ``BrokenWorkerError``, ``TimeoutError``, or the pool closing
            under them.  Cancelled calls count in neither.
    """

    size: int
    busy: int
    idle: int
    starting: int
    queued: int
    restarts: int
    completed: int
    failed: int


class PoolCall:
    """One request to the pool, and where it got to (for timeouts).

    It is encoded by the worker at each attempt: large arguments travel in
    shared-memory segments that are closed once sent.
    """

    __slots__ = ("args", "coroutine", "fn", "kwargs", "name", "position", "progress", "worker")

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.name = describe(fn)
        self.fn = fn
        self.coroutine = coroutine_call(fn)  # scheduled (and cancelled) as a coroutine call
        self.args = args
        self.kwargs = kwargs
        self.position: int | None = None  # the position it holds, once it has one
        self.worker: WorkerProcess | None = None  # the worker it was handed to
        self.progress = Sent()  # whether its request went out to that worker

    def timed_out(self, limit: float, slots: Sequence[tuple[str, object]], size: int) -> str:
        """The message of this call's ``TimeoutError``: what it was doing when time ran out."""
        what = f"pool call {self.name} timed out after timeout={limit:g} s"
        w = self.worker
        if w is not None and not w.alive:
            return f"{what}; worker {w.name} (pid {w.pid}) running it was killed and is replaced"
        if w is not None and self.progress.sent:
            return (
                f"{what}; its coroutine was cancelled in worker {w.name} (pid {w.pid}), "
                "which keeps serving"
            )
        if w is not None:
            return f"{what} before worker {w.name} took it; it never ran"
        if self.position is not None:
            name = slots[self.position][0]
            return f"{what} while worker {name} was starting; it never ran"
        return f"{what} waiting for a free worker (all {size} busy); it never ran"
