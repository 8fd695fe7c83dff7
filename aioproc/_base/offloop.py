"""One helper thread for the blocking work of starting and stopping groups.

``Popen`` returns only once the child has exec'd (it waits on an error
pipe), which on a busy machine can take a scheduler slice or more per
worker; making a group's log tree (one directory per rank) and pruning it,
and scanning ``/proc`` for what is left in stopped groups, cost milliseconds
per hundred workers.  Run on the loop, each of these held it far longer
than a service embedding aioproc can afford (no callback should hold it
over 5 ms).  They run here instead, in order, on one thread that exists
only while some start or stop holds it: the supervisor's thread count does
not grow with its workers, and an idle supervisor has no extra thread.
Neither the thread's start nor its end is waited for on the loop (see
``_Helper``).

``run_blocking``'s results come back to the loop in bounded batches
(``Delivery``): when a group of hundreds is closed, the helper thread
finishes one short job per stopped worker (its error file) far faster than
the loop resumes their callers, and handing every result over in the loop
iteration after it was posted would resume all those callers in one
iteration.
"""

from __future__ import annotations

import _thread
import asyncio
import collections
import concurrent.futures
import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

from .shield import shielded

T = TypeVar("T")
A = TypeVar("A")

_lock = threading.Lock()
_pool: _Helper | None = None
_users = 0

_Job = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class _Helper(Executor):
    """The helper thread: runs its jobs in order, and exits once retired and idle.

    Neither its start nor its end waits for it: ``Thread.start()`` blocks
    until the new thread has run, which takes a scheduler slice or more
    while exiting workers hold every CPU (a close's first job), and a join
    waits for the thread to be scheduled once more.  Either would hold the
    loop.  A short-lived starter thread does the waiting instead, jobs
    queue until the helper runs, and a retired helper leaves on its own as
    soon as its queue is empty (or is taken back by the next hold if it
    has not left yet).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._jobs: collections.deque[_Job] = collections.deque()
        self._retired = False
        self.exited = False
        self.thread = threading.Thread(target=self._run, name="aioproc-helper", daemon=True)
        _thread.start_new_thread(self._start, ())

    def _start(self) -> None:
        try:
            self.thread.start()
        except BaseException:  # no thread to be had: the starter runs the jobs itself
            self._run()

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args, **kwargs)``; its future, as an executor's."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self.exited:
                raise RuntimeError("the helper thread has exited")
            self._jobs.append((future, fn, args, kwargs))
            self._cond.notify()
        return future

    def retire(self) -> None:
        """Let the thread exit once its queue is empty (it is not waited for)."""
        with self._cond:
            self._retired = True
            self._cond.notify()

    def rehire(self) -> bool:
        """Keep a retired thread that has not left yet (True); False if it has."""
        with self._cond:
            if self.exited:
                return False
            self._retired = False
            return True

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.retire()
        if wait and self.thread.ident != threading.get_ident():
            with contextlib.suppress(RuntimeError):  # never started: nothing to join
                self.thread.join()

    def _run(self) -> None:
        cond, jobs = self._cond, self._jobs
        while True:
            with cond:
                while not jobs and not self._retired:
                    cond.wait()
                if not jobs:
                    self.exited = True
                    return
                future, fn, args, kwargs = jobs.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # the caller's to handle, as with an executor
                future.set_exception(e)
            else:
                future.set_result(result)
            del future, fn, args, kwargs  # a finished job's values are not kept alive


@contextlib.contextmanager
def helper() -> Iterator[Executor]:
    """The helper thread, kept while the block runs (nested holds share it).

    A group's launch holds it across all its ranks, so they reuse one
    thread; when the last hold is released the idle thread exits on its
    own (nothing waits for it).
    """
    global _pool, _users
    with _lock:
        if _pool is None or (_users == 0 and not _pool.rehire()):
            _pool = _Helper()
        pool = _pool
        _users += 1
    try:
        yield pool
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _pool is pool:
                pool.retire()


class Delivery:
    """Hands the helper thread's results to one loop, at most ``BATCH`` per iteration.

    The helper thread appends each finished job to a queue and wakes the
    loop only when the queue was idle: one ``call_soon_threadsafe`` per
    burst, not per job.  On the loop, ``_drain`` resolves at most ``BATCH``
    futures and, if more are queued, runs again in the next iteration, so
    the callers resumed by one iteration are bounded and other callbacks
    (timers, I/O) run in between.
    """

    BATCH = 4

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # weak: the registry below is keyed by the loop, which must stay collectable
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._done: collections.deque[_Outcome] = collections.deque()
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Delivery:
        """The loop's delivery, made on first use."""
        with _lock:
            delivery = _deliveries.get(loop)
            if delivery is None:
                delivery = _deliveries[loop] = cls(loop)
            return delivery

    def job(
        self, fn: Callable[..., T], args: tuple[object, ...]
    ) -> tuple[Callable[[], None], asyncio.Future[T]]:
        """A job for the helper thread, and the future its outcome resolves on the loop.

        Call it on the loop's thread.
        """
        loop = self._loop()
        assert loop is not None  # called on the running loop
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(*args)
            except BaseException as e:  # the caller's to handle, as with an executor
                self.post(future, None, e)
            else:
                self.post(future, result, None)

        return run, future

    def post(self, future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
        """Queue ``future``'s outcome (from any thread); wake the loop unless it is draining."""
        with self._lock:
            self._done.append((future, result, error))
            if self._scheduled:
                return
            self._scheduled = True
        loop = self._loop()
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more

    def _drain(self) -> None:
        for _ in range(self.BATCH):
            with self._lock:
                if not self._done:
                    self._scheduled = False
                    return
                future, result, error = self._done.popleft()
            if future.cancelled():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        loop = self._loop()
        if loop is not None:
            loop.call_soon(self._drain)  # the rest in the next iteration


_Outcome = tuple["asyncio.Future[Any]", Any, "BaseException | None"]

_deliveries: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Delivery] = (
    weakref.WeakKeyDictionary()
)


async def run_blocking(fn: Callable[..., T], /, *args: object) -> T:
    """Run ``fn(*args)`` on the helper thread and return its result.

    The result reaches the loop through ``Delivery``: a burst of finished
    jobs resumes at most ``Delivery.BATCH`` callers per loop iteration.

    Cancellation: ``fn`` runs to completion even if the caller is cancelled
    (a half-made log tree or a half-read ``/proc`` helps nobody); the
    cancellation is re-raised once it has returned.
    """
    job, future = Delivery.of(asyncio.get_running_loop()).job(fn, args)
    with helper() as pool:
        pool.submit(job)
        return await shielded(future)


async def run_detached(fn: Callable[[], T], abandon: Callable[[], None]) -> T:
    """Run ``fn()`` on a thread of its own and return its result.

    For long copies (a large value into shared memory) that should neither
    hold the loop nor queue behind, or hold up, the helper thread's starts
    and stops.  The thread exists only while ``fn`` runs.

    Cancellation: the caller is released at once; ``fn`` runs to completion
    on its thread and ``abandon()`` is called after it (on the loop, or on
    the thread once the loop has closed), so what ``fn`` uses is released
    only when nothing uses it any more.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    abandoned = delivered = released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            abandon()

    def finish(result: Any, error: BaseException | None) -> None:
        nonlocal delivered
        # cancelling the caller cancels ``future`` at once, before the
        # caller's except clause runs: either way nobody takes the result
        if abandoned or future.done():
            release()
        else:
            delivered = True
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

    def work() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as e:  # the caller's to handle
            error = e
        try:
            loop.call_soon_threadsafe(finish, result, error)
        except RuntimeError:  # the loop has closed: nobody waits
            abandon()

    thread = threading.Thread(target=work, name="aioproc-copy", daemon=True)
    thread.start()
    try:
        result = await future
    except asyncio.CancelledError:
        if delivered:
            release()  # finished, but its caller is gone
        else:
            abandoned = True  # ``finish`` releases when ``fn`` returns
        raise
    thread.join()  # it has posted its result: it is returning
    return result


class Batched(Generic[A, T]):
    """``fn(arg)`` for many callers, run together: one helper-thread job per burst.

    When a group's workers exit together, each exit's blocking call (its
    error file) would otherwise be a job of its own: a hand-over to the
    helper thread and back per worker, and a queue of them that delays
    whatever the stop sends there next (the ``/proc`` scan).  Calls made
    while a job runs are run by that job, one after the other; results
    come back through ``Delivery``, as ``run_blocking``'s do.
    """

    def __init__(self, fn: Callable[[A], T]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._queue: list[tuple[A, asyncio.Future[T], Delivery]] = []
        self._running = False
        _batched.add(self)

    def _after_fork(self) -> None:
        # the job and its thread do not exist in a forked child
        self._lock = threading.Lock()
        self._queue = []
        self._running = False

    async def __call__(self, arg: A) -> T:
        """``fn(arg)`` on the helper thread.

        Cancellation: as ``run_blocking``: the call runs to completion and
        the cancellation is re-raised once it has returned.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with helper() as pool:  # held until the result is in: the job ends before the thread
            with self._lock:
                self._queue.append((arg, future, Delivery.of(loop)))
                start, self._running = not self._running, True
            if start:
                pool.submit(self._drain)
            return await shielded(future)

    def _drain(self) -> None:
        while True:
            with self._lock:
                batch, self._queue = self._queue, []
                if not batch:
                    self._running = False
                    return
            for arg, future, delivery in batch:
                try:
                    result = self._fn(arg)
                except BaseException as e:  # the caller's to handle
                    delivery.post(future, None, e)
                else:
                    delivery.post(future, result, None)


def _after_fork_in_child() -> None:
    # the thread does not exist in a forked child: it starts its own
    global _pool, _users, _lock
    _pool, _users, _lock = None, 0, threading.Lock()
    _deliveries.clear()  # their locks may have been held by a thread that is gone
    for batched in list(_batched):
        batched._after_fork()


_batched: weakref.WeakSet[Batched[Any, Any]] = weakref.WeakSet()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
