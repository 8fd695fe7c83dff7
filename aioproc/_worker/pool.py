"""A pool of persistent workers: the body of ``aioproc.pool.WorkerPool``.

Each position of the pool holds one worker at a time, started by
``start.start_worker`` with the pool's one ``WorkerOptions``: the first
ones when the pool opens, a replacement when one dies, is recycled after
``max_calls_per_worker`` calls or was retired after ``idle_timeout``.
``submit`` hands a call to a position (``dispatch``: a sync call to an idle
one, a coroutine call to the least busy one with a free slot; first come,
first served), ``run`` to every position.
"""

# Ownership
# ---------
#
# A pool outlives the call that opened it (``pool = await open_pool(...)``
# returns it to the caller), so the pool's task group cannot live in the
# caller's task.  It lives in one task of the pool's own, the *owner*,
# created when the pool opens and awaited when it closes.  Everything the
# pool does in the background runs in that task group: every worker start
# (the first ones and the replacements), every retirement (recycled, idle,
# crashed).  Callers never start workers themselves: ``submit``/``run``
# ask the owner for a start and wait for its outcome, so a cancelled caller
# can never strand a half-started worker; the worker still lands in its
# position and is closed with the pool.
#
# Closing asks the owner to finish: it cancels the starts in flight (a
# cancelled start kills what it launched), closes every live worker, and
# leaves its task group once the last retirement is done.  ``aclose()``
# returns only then, so when it returns no interpreter and no guardian of
# the pool is left, whatever was starting, retiring or running at the time.
#
# What each start is given (slots, placements, CPUs, the template) is
# ``supply.Supply``; which positions are free, and who waits for one,
# ``dispatch.Dispatch``.

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.abc

from .._base.checks import check_duration
from .._base.loops import check_loop
from .._base.owner import Owner
from .._base.resource import OpenResource, handle_closed, handle_opened
from .._base.shield import shielded
from .._errors.failure import BrokenWorkerError
from .._group.resources import CpusArg
from .._metrics import hooks as _hooks
from .dispatch import Dispatch
from .options import WorkerOptions, worker_cpus
from .process import Undelivered, WorkerProcess
from .records import PoolCall, PoolStart, PoolStats
from .start import start_worker
from .supply import Supply

__all__ = ["WorkerPool", "open_workers"]

logger = logging.getLogger("aioproc")


class WorkerPool:
    """A fixed-size set of persistent workers; built by ``open_pool``."""

    def __init__(
        self,
        slots: Sequence[tuple[str, Mapping[str, str]]],
        options: WorkerOptions,
        *,
        name: str,
        max_calls_per_worker: int | None,
        idle_timeout: float | None,
        cpus: Sequence[CpusArg],
    ) -> None:
        self.name = name
        self._slots = slots  # (name, env) of each worker position
        self._options = options
        self._supply = Supply([name for name, _ in slots], options, cpus)
        self._dispatch = Dispatch(idle_timeout, options.max_concurrency, max_calls_per_worker)
        # read once: metrics enabled later count from the next pool on
        self._rec = _hooks.current
        self._workers: list[WorkerProcess | None] = [None] * len(slots)
        self._starts: dict[int, PoolStart] = {}  # position -> its start in flight
        self._restarts = 0
        self._completed = 0
        self._failed = 0
        # the owner task and its task group: set by _open, for the pool's lifetime
        self._owner: Owner[None] = Owner(f"aioproc pool owner ({self.size} workers)")
        self._errors: list[Exception] = []  # from closing workers; raised by aclose()
        self._closed = False

    def __repr__(self) -> str:
        live = sum(w is not None and w.alive for w in self._workers)
        busy = len(self._dispatch.busy)
        state = " closed" if self._closed else ""
        return f"<WorkerPool size={len(self._slots)} live={live} busy={busy}{state}>"

    @property
    def size(self) -> int:
        return len(self._slots)

    def pids(self) -> list[int | None]:
        """Pid of the worker at each position (``None`` where none is running)."""
        return [w.pid if w is not None and w.alive else None for w in self._workers]

    def stats(self) -> PoolStats:
        """Counts of busy, idle and starting workers, queued calls, restarts and outcomes."""
        busy = idle = 0
        for i, w in enumerate(self._workers):
            if i in self._starts:
                continue
            if i in self._dispatch.busy or (w is not None and w.busy):
                busy += 1
            elif w is not None and w.alive:
                idle += 1
        return PoolStats(
            size=self.size,
            busy=busy,
            idle=idle,
            starting=len(self._starts),
            queued=self._dispatch.queued(),
            restarts=self._restarts,
            completed=self._completed,
            failed=self._failed,
        )

    # ------------------------------------------------------------ lifecycle

    async def _open(self) -> WorkerPool:
        """Start every worker (concurrently); on failure none is left running.

        Raises:
            Exception: what made a worker's start fail, as soon as one
                fails (see ``open_pool``).

        Cancellation: every worker started or starting is stopped (shielded,
        bounded) before the cancellation propagates.
        """
        if self._owner.started:
            raise RuntimeError(f"{self!r} was already opened")
        # all or nothing, also when cancelled; the owner gives it back at its end
        await self._supply.reserve()
        # No await before the try: once the owner exists, it is always closed.
        starts = [self._new_start(i) for i in range(self.size)]
        self._owner.start(self._own, after=self._supply.release)
        try:
            pending = {s.finished for s in starts}
            while pending:
                # report a failure at once, without waiting for slower starts
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for s in starts:
                    if s.error is not None:
                        raise s.error
        except BaseException:
            await shielded(self._close())
            raise
        self._dispatch.free(range(self.size))
        handle_opened(self)  # until aclose(): a leak check names a pool left open
        return self

    async def _own(self, tg: anyio.abc.TaskGroup) -> None:
        """The owner's body: every start and retirement runs in its task group."""
        for i, start in list(self._starts.items()):  # the first ones, made by _open
            tg.start_soon(self._run_start, i, start)
        retiring = anyio.CancelScope()
        tg.start_soon(self._retire_idle, retiring)
        # also when the owner itself is cancelled (the loop shutting down)
        await self._owner.closing(None)
        retiring.cancel()
        self._stop_everything(tg)

    async def _retire_idle(self, scope: anyio.CancelScope) -> None:
        """Retire the workers whose idle timer fired, from inside the task group.

        The timer is a plain loop callback, where the task group cannot be
        used (anyio needs a task to tell which event loop runs it), so it
        only queues the position; this task does the rest.
        """
        with scope:
            while True:
                i = await self._dispatch.expired.get()
                if i in self._dispatch.idle and not self._closed:
                    self._retire(i)  # stays in the idle list: restarted on its next use

    def _stop_everything(self, tg: anyio.abc.TaskGroup) -> None:
        self._closed = True
        self._dispatch.stop()
        for start in self._starts.values():
            start.scope.cancel()  # a cancelled start kills what it launched
        for i, w in enumerate(self._workers):
            if w is not None:
                self._workers[i] = None
                tg.start_soon(self._stop_worker, w)

    def _new_start(self, i: int) -> PoolStart:
        start = PoolStart()
        if self._owner.started:  # else: one of the first starts, made by _open
            self._restarts += 1
        self._starts[i] = start
        if self._owner.group is not None:  # else: the owner starts it when it begins
            self._owner.group.start_soon(self._run_start, i, start)
        return start

    async def _run_start(self, i: int, start: PoolStart) -> None:
        """Start the worker at ``i``; it belongs to the pool the moment it exists."""
        name, env = self._slots[i]
        try:
            with start.scope:
                if self._closed:  # closed before this start began: launch nothing
                    return
                # A template that died between its last fork and this one (its
                # exit not noticed yet) makes the fork try a fresh one
                # (``_func.fork``); the next start finds it broken.
                template = await self._supply.live_template()
                # the worker owns them: closed with it, or if this start fails
                resources = self._supply.resources(i)
                worker = await start_worker(name, self._options, env, template, resources)
                # no await from here on: the worker is never without an owner
                start.worker = worker
                if not self._closed:
                    self._workers[i] = worker
        except Exception as e:
            start.error = e
        finally:
            if self._starts.get(i) is start:
                del self._starts[i]
            if start.worker is None and start.error is None:
                start.error = RuntimeError(f"{self!r} was closed while worker {name} started")
            start.finished.set_result(None)
            if start.worker is not None and self._closed:
                # finished just as the pool closed: nobody else will close it
                await self._stop_worker(start.worker)

    async def _stop_worker(self, w: WorkerProcess) -> None:
        """Close one worker (retired, replaced, or the pool closing); shielded, bounded."""
        try:
            await w.aclose()
        except Exception as e:  # e.g. a ForcedKillWarning turned into an error
            self._errors.append(e)

    async def _ensure(self, i: int) -> WorkerProcess:
        """The live worker at position ``i``, starting one if needed.

        Cancellation: the start goes on in the pool (which keeps the worker).
        """
        w = self._workers[i]
        if w is not None and w.alive:
            return w
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if w is not None:
            self._retire(i)  # dead: reaped and its guardian dismissed by the pool
        start = self._starts.get(i) or self._new_start(i)
        return await start.outcome()

    def _retire(self, i: int) -> None:
        """Stop the worker at ``i`` in the pool's task group (recycled, idle, dead)."""
        w = self._workers[i]
        self._workers[i] = None
        if w is not None and self._owner.group is not None:
            self._owner.group.start_soon(self._stop_worker, w)

    def _recycle_if_spent(self, i: int) -> None:
        """After ``run``: retire the worker at ``i`` if it died, or is spent and idle."""
        w = self._workers[i]
        if w is None or self._closed:
            return
        if not w.alive or self._dispatch.spent(i):
            self._retire(i)  # crashed, killed or recycled: replaced on next use

    # ---------------------------------------------------------- scheduling

    async def _acquire(self, coroutine: bool) -> int:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        return await self._dispatch.take(coroutine)

    def _release(self, i: int, coroutine: bool) -> None:
        w = self._workers[i]
        if not self._closed and w is not None and not w.alive:
            self._retire(i)  # crashed or killed: replaced on next use
        # before a waiter handed the position can look at its worker (a later
        # loop iteration), a spent one is retired: the next call starts a fresh one
        if self._dispatch.give_back(i, coroutine) and not self._closed:
            self._retire(i)

    async def submit(
        self, fn: Callable[..., Any], /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` on one worker and return its value.

        A sync function runs on an idle worker, which it has to itself; a
        coroutine function (``async def``) runs on the worker's event loop,
        on the least busy worker with fewer than ``max_concurrency`` calls
        in flight, so many run at once (see ``WorkerProcess.call``).  Calls
        that find no worker wait, first come first served.

        ``timeout`` belongs to the pool, not to ``fn``: like the options of
        ``concurrent.futures``' ``Executor.map(..., timeout=)`` or dask's
        ``Client.submit(..., retries=)``, it is keyword-only and every other
        keyword goes to ``fn``.  To give ``fn`` a keyword named ``timeout``,
        bind it: ``pool.submit(functools.partial(fn, timeout=5), x)``.

        A call whose worker turns out to have died while idle, before it
        read the request, runs on a fresh worker instead (once); a worker
        that read the request and died fails the call: it never runs twice.

        Args:
            fn: a picklable callable (lambdas and closures too).
            *args: positional arguments for ``fn``.
            timeout: seconds from this call until the value is back, all
                included: waiting for a free worker, (re)starting it and the
                call itself.  ``None`` (the default): no limit.
            **kwargs: keyword arguments for ``fn``.

        Raises:
            Exception: what ``fn`` raised (with the worker's traceback).
            BrokenWorkerError: the worker died during the call; it is
                replaced for later calls.
            TimeoutError: ``timeout`` passed.  A call still waiting for a
                worker (or for its worker to start) never runs; a running
                coroutine is cancelled in its worker, which keeps serving; a
                running sync call cannot be withdrawn, so its worker is
                killed (its whole process group) and replaced.  The message
                names ``fn``, the timeout and what happened.
            TypeError, ValueError: ``fn``, its arguments or ``timeout`` are
                unusable; raised before a worker is involved.
            RuntimeError: the pool is closed, or was closed before the call
                got a worker, or while its coroutine ran.

        Cancellation: a running coroutine call is cancelled in its worker
        and the cancellation completes once the coroutine ended there (see
        ``WorkerProcess.call``); cancelling a running sync call kills its
        worker, which the pool replaces.  Cancelled while waiting for a
        worker, the call never runs; cancelled while its worker is
        (re)starting, the start goes on and the pool keeps the worker.
        """
        check_loop(self._owner.loop, self)
        limit = check_duration("submit(timeout=...)", timeout, allow_none=True, allow_negative=True)
        if limit is not None and limit <= 0:
            raise ValueError(f"submit(timeout=...) must be > 0 seconds, got {timeout!r}")
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        call = PoolCall(fn, args, kwargs)
        rec = self._rec
        # The call's latency is read on the clock its timeout runs on, the
        # loop's: uvloop's lags time.monotonic() by up to a millisecond, so a
        # timeout measured on the latter could read shorter than itself.
        began = anyio.current_time()
        timed_out = False
        try:
            if limit is None:
                value = await self._submit(call)
            else:
                with anyio.CancelScope(deadline=_deadline(began, limit)) as scope:
                    value = await self._submit(call)
                if scope.cancelled_caught:
                    timed_out = True  # the pool's timeout, not a TimeoutError fn raised
                    raise TimeoutError(call.timed_out(limit, self._slots, self.size))
        except Exception as e:
            self._failed += 1
            if rec.enabled:
                outcome = "timeout" if timed_out else _outcome(e)
                rec.pool_call(self.name, outcome, anyio.current_time() - began)
            raise
        except asyncio.CancelledError:
            if rec.enabled:
                rec.pool_call(self.name, "cancelled", anyio.current_time() - began)
            raise
        self._completed += 1
        if rec.enabled:
            rec.pool_call(self.name, "succeeded", anyio.current_time() - began)
        return value

    async def _submit(self, call: PoolCall) -> Any:
        i = await self._acquire(call.coroutine)
        call.position = i
        try:
            return await self._call_at(i, call)
        finally:
            self._release(i, call.coroutine)

    async def _call_at(self, i: int, call: PoolCall) -> Any:
        """Make ``call`` on the worker at ``i``; again on a fresh one if it never ran there.

        A worker that died while idle may not be noticed before the request
        is written to it; it reports ``Undelivered`` once its exit is seen
        (see ``Channel.dropped_by_peer``), and its replacement gets the
        request.  Only once: a second worker dying unread fails the call.

        Cancellation: as ``submit``.
        """
        for attempt in (1, 2):
            call.worker = w = await self._ensure(i)
            call.progress.sent = False
            try:
                return await w._call(call.fn, call.args, call.kwargs, call.progress)
            except Undelivered:
                if attempt == 2 or self._closed:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``fn`` on every worker; return the values ordered by worker.

        A worker found dead before it read the request is replaced and the
        request goes to the new one, as for ``submit``.

        Raises:
            Exception: the first error in worker order (after every worker
                finished its call), with that worker's traceback.

        Cancellation: as for ``submit``: a coroutine ``fn`` is cancelled in
        every worker still running it; a sync one kills those workers.
        """
        check_loop(self._owner.loop, self)
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        call_args, call_kwargs = tuple(args), dict(kwargs or {})
        rec = self._rec
        began = time.monotonic() if rec.enabled else 0.0

        async def one(i: int) -> Any:
            self._dispatch.count(i)
            try:
                value = await self._call_at(i, PoolCall(fn, call_args, call_kwargs))
            except Exception as e:
                self._failed += 1
                if rec.enabled:
                    rec.pool_call(self.name, _outcome(e), time.monotonic() - began)
                raise
            except asyncio.CancelledError:
                if rec.enabled:
                    rec.pool_call(self.name, "cancelled", time.monotonic() - began)
                raise
            self._completed += 1
            if rec.enabled:
                rec.pool_call(self.name, "succeeded", time.monotonic() - began)
            return value

        results = await asyncio.gather(*(one(i) for i in range(self.size)), return_exceptions=True)
        for i in range(self.size):
            if i not in self._dispatch.busy:
                self._recycle_if_spent(i)
        for value in results:
            if isinstance(value, BaseException):
                raise value
        return list(results)

    async def aclose(self) -> None:
        """Stop every worker: a terminate request, ``grace_period`` seconds, then SIGKILL.

        Starts in flight are cancelled (what they launched is killed),
        waiting and running calls fail, and every retirement still going on
        is waited for: when ``aclose()`` returns, none of the pool's
        processes is left.  Idempotent: a second call waits for the first.

        Raises:
            Exception: what closing a worker raised (e.g. a
                ``ForcedKillWarning`` that a warnings filter turned into an
                error), once everything is closed; when several did, the
                first, and the others are logged.

        Cancellation: shielded and bounded.
        """
        check_loop(self._owner.loop, self)
        handle_closed(self)
        await shielded(self._close())
        errors, self._errors = self._errors, []
        for e in errors[1:]:
            logger.error("closing %r also failed", self, exc_info=e)
        if errors:
            raise errors[0]

    shutdown = aclose
    """TensorFlow's ``MultiProcessPoolRunner.shutdown()``, awaited: an alias of ``aclose``."""

    async def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._dispatch.close(lambda: RuntimeError(f"{self!r} was closed"))
        self._owner.request_close(None)
        await self._owner.wait()  # every closer waits for the one close


def open_workers(
    slots: Sequence[tuple[str, Mapping[str, str]]],
    options: WorkerOptions,
    *,
    name: str,
    max_calls_per_worker: int | None,
    idle_timeout: float | None,
    cpus: CpusArg,
) -> OpenResource[WorkerPool]:
    """What ``open_pool`` returns: the pool of ``slots`` (``(name, env)`` each).

    Raises:
        TypeError, ValueError: a bad value of the pool's own options, named.
    """
    if max_calls_per_worker is not None and (
        isinstance(max_calls_per_worker, bool)
        or not isinstance(max_calls_per_worker, int)
        or max_calls_per_worker <= 0
    ):
        raise ValueError(
            f"max_calls_per_worker must be a positive int, got {max_calls_per_worker!r}"
        )
    idle = check_duration("idle_timeout", idle_timeout, allow_none=True)
    if idle is not None and idle <= 0:
        raise ValueError(f"idle_timeout must be > 0, got {idle_timeout!r}")
    pool = WorkerPool(
        slots,
        options,
        name=name,
        max_calls_per_worker=max_calls_per_worker,
        idle_timeout=idle,
        cpus=worker_cpus(cpus, len(slots)),
    )
    return OpenResource(lambda: _started(pool), _closed, "open_pool(...)")


async def _started(pool: WorkerPool) -> WorkerPool:
    return await pool._open()


async def _closed(pool: WorkerPool, exc: BaseException | None) -> None:
    await pool.aclose()


def _deadline(began: float, seconds: float) -> float:
    """The first time on the loop's clock at which ``seconds`` have passed since ``began``.

    ``began + seconds`` may round to a float a hair below that instant, and a
    latency read as ``now - began`` at it would then be shorter than ``seconds``.
    """
    deadline = began + seconds
    while deadline - began < seconds:
        deadline = math.nextafter(deadline, math.inf)
    return deadline


def _outcome(error: Exception) -> str:
    """The metrics outcome of a pool call that raised ``error`` (not the pool's timeout)."""
    return "broken" if isinstance(error, BrokenWorkerError) else "failed"
