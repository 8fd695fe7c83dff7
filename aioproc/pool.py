"""Pools of persistent workers (TensorFlow's ``MultiProcessPoolRunner``, async).

``pool.run(fn)`` broadcasts: ``fn`` runs on every worker and the values come
back ordered by worker.  ``pool.submit(fn, *args)`` runs on one idle worker.
Workers keep their pids across calls; a worker that dies is replaced (only
its in-flight call fails, with ``BrokenWorkerError``), and workers can be
recycled after ``max_calls_per_worker`` calls or retired after
``idle_timeout`` seconds without work (then restarted on demand).
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._cm import OpenResource
from ._shield import shielded
from ._validate import check_duration, check_env
from .worker import WorkerProcess, _start_worker

__all__ = ["WorkerPool", "open_pool"]

ClusterSpec = Mapping[str, Sequence[str] | int]


class WorkerPool:
    """A fixed-size set of persistent workers; built by ``open_pool``."""

    def __init__(
        self,
        slots: list[tuple[str, dict[str, str]]],
        initializer: Callable[..., Any] | None,
        initargs: tuple[Any, ...],
        init_timeout: float,
        shutdown_timeout: float,
        max_calls_per_worker: int | None,
        idle_timeout: float | None,
    ) -> None:
        self._slots = slots  # (name, env) of each worker position
        self._initializer = initializer
        self._initargs = initargs
        self._init_timeout = init_timeout
        self._shutdown_timeout = shutdown_timeout
        self._max_calls = max_calls_per_worker
        self._idle_timeout = idle_timeout
        self._workers: list[WorkerProcess | None] = [None] * len(slots)
        self._idle: collections.deque[int] = collections.deque()
        self._idle_timers: dict[int, asyncio.TimerHandle] = {}
        self._waiters: collections.deque[asyncio.Future[int]] = collections.deque()
        self._busy: set[int] = set()
        self._starting: dict[int, asyncio.Task[WorkerProcess]] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._closed = False

    def __repr__(self) -> str:
        live = sum(w is not None and w.alive for w in self._workers)
        return f"<WorkerPool size={len(self._slots)} live={live} busy={len(self._busy)}>"

    @property
    def size(self) -> int:
        return len(self._slots)

    def pids(self) -> list[int | None]:
        """Pid of the worker at each position (``None`` where none is running)."""
        return [w.pid if w is not None and w.alive else None for w in self._workers]

    # ------------------------------------------------------------ lifecycle

    async def _ensure(self, i: int) -> WorkerProcess:
        """The live worker at position ``i``, starting one if needed."""
        w = self._workers[i]
        if w is not None and w.alive:
            return w
        if w is not None:
            self._retire(i)  # dead: reap it and its guardian in the background
        task = self._starting.get(i)
        if task is None:
            name, env = self._slots[i]
            task = asyncio.get_running_loop().create_task(
                _start_worker(
                    name,
                    self._initializer,
                    self._initargs,
                    self._init_timeout,
                    self._shutdown_timeout,
                    env,
                )
            )
            self._starting[i] = task

            def forget(_: asyncio.Task[WorkerProcess], i: int = i) -> None:
                self._starting.pop(i, None)

            task.add_done_callback(forget)
        w = await asyncio.shield(task)
        self._workers[i] = w
        return w

    async def start(self) -> None:
        """Start every worker (concurrently); on failure none is left running."""
        try:
            await asyncio.gather(*(self._ensure(i) for i in range(self.size)))
        except BaseException:
            await shielded(self._close())
            raise
        self._idle.extend(range(self.size))
        for i in range(self.size):
            self._arm_idle(i)

    def _retire(self, i: int) -> None:
        """Stop the worker at ``i`` in the background (recycled or idle too long)."""
        w = self._workers[i]
        self._workers[i] = None
        if w is not None:
            task = asyncio.get_running_loop().create_task(w.aclose())
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    def _arm_idle(self, i: int) -> None:
        if self._idle_timeout is None:
            return
        loop = asyncio.get_running_loop()
        self._idle_timers[i] = loop.call_later(self._idle_timeout, self._idle_expired, i)

    def _idle_expired(self, i: int) -> None:
        self._idle_timers.pop(i, None)
        if i in self._idle and not self._closed:
            self._retire(i)  # stays in the idle list: restarted on its next use

    # ---------------------------------------------------------- scheduling

    async def _acquire(self) -> int:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._idle:
            i = self._idle.popleft()
        else:
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                i = await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._release(fut.result())  # handed over just as we were cancelled
                raise
        timer = self._idle_timers.pop(i, None)
        if timer is not None:
            timer.cancel()
        self._busy.add(i)
        return i

    def _release(self, i: int) -> None:
        self._busy.discard(i)
        w = self._workers[i]
        if w is not None and self._max_calls is not None and w.calls >= self._max_calls:
            self._retire(i)  # recycled: a fresh worker starts on next use
        elif w is not None and not w.alive:
            self._retire(i)  # crashed or killed: reaped now, replaced on next use
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(i)
                return
        self._idle.append(i)
        self._arm_idle(i)

    async def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on one idle worker and return its value.

        Raises:
            Exception: what ``fn`` raised (with the worker's traceback).
            BrokenWorkerError: the worker died during the call; it is
                replaced for later calls.

        Cancellation: cancelling kills the worker running the call; the pool
        replaces it.
        """
        i = await self._acquire()
        try:
            w = await self._ensure(i)
            return await w.call(fn, *args, **kwargs)
        finally:
            self._release(i)

    async def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``fn`` on every worker; return the values ordered by worker.

        Raises:
            Exception: the first error in worker order (after every worker
                finished its call), with that worker's traceback.

        Cancellation: cancelling kills the workers still running the call.
        """
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        kwargs = dict(kwargs or {})

        async def one(i: int) -> Any:
            w = await self._ensure(i)
            return await w.call(fn, *args, **kwargs)

        results = await asyncio.gather(*(one(i) for i in range(self.size)), return_exceptions=True)
        for i in range(self.size):
            w = self._workers[i]
            if w is None or i in self._busy:
                continue
            if not w.alive or (self._max_calls is not None and w.calls >= self._max_calls):
                self._retire(i)  # crashed, or recycled: replaced on next use
        for value in results:
            if isinstance(value, BaseException):
                raise value
        return list(results)

    async def aclose(self) -> None:
        """Stop every worker (terminate request, then SIGKILL after the timeout).

        Cancellation: shielded and bounded.
        """
        if self._closed:
            return
        await shielded(self._close())

    async def _close(self) -> None:
        self._closed = True
        for timer in self._idle_timers.values():
            timer.cancel()
        self._idle_timers.clear()
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(RuntimeError(f"{self!r} was closed"))
        if self._starting:
            await asyncio.wait(set(self._starting.values()))
            for i, task in list(self._starting.items()):
                if not task.cancelled() and task.exception() is None:
                    self._workers[i] = task.result()
        workers = [w for w in self._workers if w is not None]
        await asyncio.gather(*(w.aclose() for w in workers))
        if self._retiring:
            await asyncio.wait(set(self._retiring))


async def _started(pool: WorkerPool) -> WorkerPool:
    await pool.start()
    return pool


async def _closed(pool: WorkerPool, exc: BaseException | None) -> None:
    await pool.aclose()


def open_pool(
    n_or_cluster_spec: int | ClusterSpec,
    initializer: Callable[..., Any] | None = None,
    initargs: tuple[Any, ...] = (),
    *,
    init_timeout: float = 30,
    shutdown_timeout: float = 60,
    max_calls_per_worker: int | None = None,
    idle_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    name: str = "pool",
) -> OpenResource[WorkerPool]:
    """Start a pool of persistent workers.

    ``async with aioproc.open_pool(4, initializer=setup) as pool:``; also
    ``pool = await aioproc.open_pool(...)`` then ``await pool.aclose()``.

    Args:
        n_or_cluster_spec: number of workers, or a TensorFlow-style cluster
            spec ``{"worker": ["host:port", ...], "ps": [...]}`` (or
            ``{"worker": 2}``): one worker per task, each with ``TF_CONFIG``
            naming its task, and named ``<type>:<index>``.
        initializer: run once in each worker (again in a replacement); its
            return value is that worker's ``aioproc.worker_state()``.
        initargs: arguments for ``initializer``.
        init_timeout, shutdown_timeout: as for ``open_worker``.
        max_calls_per_worker: recycle a worker after this many calls.
        idle_timeout: stop a worker idle this long; it restarts on demand.
        env: extra environment for every worker.
        name: prefix of the workers' names.
    """
    check_duration("init_timeout", init_timeout)
    check_duration("shutdown_timeout", shutdown_timeout)
    check_duration("idle_timeout", idle_timeout, allow_none=True)
    if env is not None:
        check_env("env", env)
    slots = _slots(n_or_cluster_spec, name, dict(env or {}))
    if max_calls_per_worker is not None and (
        not isinstance(max_calls_per_worker, int) or max_calls_per_worker <= 0
    ):
        raise ValueError(
            f"max_calls_per_worker must be a positive int, got {max_calls_per_worker!r}"
        )
    if idle_timeout is not None and (
        not isinstance(idle_timeout, (int, float)) or idle_timeout <= 0
    ):
        raise ValueError(f"idle_timeout must be > 0, got {idle_timeout!r}")
    if initializer is not None and not callable(initializer):
        raise TypeError(f"initializer must be callable, got {initializer!r}")
    pool = WorkerPool(
        slots,
        initializer,
        tuple(initargs),
        init_timeout,
        shutdown_timeout,
        max_calls_per_worker,
        idle_timeout,
    )
    return OpenResource(lambda: _started(pool), _closed)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free right now (all held until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _slots(
    spec: int | ClusterSpec, name: str, env: dict[str, str]
) -> list[tuple[str, dict[str, str]]]:
    if isinstance(spec, bool):
        raise TypeError(f"pool size must be an int or a cluster spec, got {spec!r}")
    if isinstance(spec, int):
        if spec <= 0:
            raise ValueError(f"pool size must be positive, got {spec}")
        return [(f"{name}/{i}", env) for i in range(spec)]
    if not isinstance(spec, Mapping) or not spec:
        raise TypeError(f"pool size must be an int or a cluster spec dict, got {spec!r}")
    cluster: dict[str, list[str]] = {}
    for task_type, tasks in spec.items():
        if isinstance(tasks, int) and not isinstance(tasks, bool) and tasks > 0:
            # like TF's create_cluster_spec: a distinct free port per task
            cluster[task_type] = [f"localhost:{port}" for port in _free_ports(tasks)]
        elif isinstance(tasks, Sequence) and not isinstance(tasks, str) and tasks:
            cluster[task_type] = [str(t) for t in tasks]
        else:
            raise ValueError(f"cluster spec entry {task_type!r} must be a count or addresses")
    slots = []
    for task_type, tasks in cluster.items():
        for index in range(len(tasks)):
            tf_config = json.dumps(
                {"cluster": cluster, "task": {"type": task_type, "index": index}}
            )
            slots.append((f"{task_type}:{index}", {**env, "TF_CONFIG": tf_config}))
    return slots
