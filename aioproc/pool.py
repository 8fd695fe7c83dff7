"""Pools of persistent workers (TensorFlow's ``MultiProcessPoolRunner``, async).

``pool.run(fn)`` broadcasts: ``fn`` runs on every worker and the values come
back ordered by worker.  ``pool.submit(fn, *args)`` runs on one idle worker,
optionally within ``timeout=`` seconds.  Workers keep their pids across
calls; a worker that dies is replaced (only its in-flight call fails, with
``BrokenWorkerError``; a call it died before reading runs on the
replacement), and workers can be recycled after ``max_calls_per_worker``
calls or retired after ``idle_timeout`` seconds without work (then
restarted on demand).  ``pool.stats()`` counts what the pool is doing.

Each worker has its own placement (``limits=``, ``cpus=``) and, with
``capacity=``, holds one slot of the budget from its start until it is
reaped.  The first workers' slots are reserved together, as a group's are;
a replacement waits, first come first served, for one slot.  The
implementation lives in the ``_worker`` wing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ._base import public_module
from ._base.resource import OpenResource
from ._cluster.tfconfig import ClusterSpec, worker_slots
from ._group.resources import CpusArg
from ._limits.capacity import Capacity
from ._limits.spec import Limits
from ._worker.options import worker_options
from ._worker.pool import WorkerPool, open_workers
from ._worker.process import DEFAULT_MAX_CONCURRENCY
from ._worker.records import PoolStats
from .results import DEFAULT_GRACE_PERIOD

__all__ = ["PoolStats", "WorkerPool", "open_pool"]

public_module(__name__, PoolStats, WorkerPool)  # defined in the wing, imported from here


def open_pool(
    n_or_cluster_spec: int | ClusterSpec,
    initializer: Callable[..., Any] | None = None,
    initargs: Iterable[Any] = (),
    *,
    init_timeout: float = 30,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    max_calls_per_worker: int | None = None,
    idle_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    name: str = "pool",
    start_method: str = "spawn",
    preload: Sequence[str] = (),
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    worker_loop: str = "asyncio",
    limits: Limits | None = None,
    capacity: Capacity | None = None,
    cpus: CpusArg = None,
    shutdown_timeout: float | None = None,
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
        init_timeout: seconds each initializer may take (``TimeoutError``
            beyond).
        grace_period: seconds each worker gets to exit after the terminate
            request before its process group is SIGKILLed (and named in a
            ``ForcedKillWarning``); the default is every aioproc stop's.
        max_calls_per_worker: recycle a worker after this many calls.
        idle_timeout: stop a worker idle this long; it restarts on demand.
        env: extra environment for every worker.
        name: prefix of the workers' names.
        start_method: ``"spawn"`` or ``"forkserver"``: the pool keeps the
            template for ``preload`` up for its whole life, so replacements
            fork from it too (see ``start_processes``).
        preload: modules the forkserver template imports first.
        max_concurrency: calls in flight on each worker at most (default
            100): the pool runs up to ``size * max_concurrency`` coroutine
            calls at once, each on the least busy worker; more wait for
            one, first come first served.  A sync call has a worker to
            itself, as ever: it waits for an idle one.
        worker_loop: the event loop coroutine calls run on in each worker,
            ``"asyncio"`` (the default) or ``"uvloop"``.
        limits: resource limits for each worker (``aioproc.Limits``): every
            worker gets a placement of its own (its own cgroup, else
            rlimits), as the workers are independent; a replacement gets a
            fresh one.  A worker the kernel's OOM killer ends fails its call
            with a ``BrokenWorkerError`` that says so, and is replaced.
        capacity: a process budget (``aioproc.Capacity``) shared with groups
            and other pools: each worker holds one slot from its start until
            it is reaped.  The pool opens once *all* its workers have slots
            and have started: the ``size`` slots are reserved together,
            first come first served, as a group's are, since ``run()``
            needs every worker and a pool that started with what fits would
            run at a size nobody chose.  A replacement (after a crash, a
            recycling or ``idle_timeout``) waits in the same queue for one
            slot, which its predecessor gave back once reaped: a call at
            that position waits too, ``submit(timeout=...)`` included.
        cpus: the CPUs the workers run on (Linux), as ``start_processes``
            takes them, a worker's position standing for a local rank: a
            list of CPU ids for every worker, ``"numa:<node>"`` (that node's
            CPUs, from ``/sys/devices/system/node/node<N>/cpulist``, among
            the allowed ones), ``{position: CPU ids}`` for the workers named
            (the others run where this process may), or ``"round-robin"``:
            the worker at position ``i`` (and its replacements) gets the
            ``i % n``-th of the ``n`` CPUs this process may use
            (``os.sched_getaffinity(0)``).
        shutdown_timeout: deprecated name of ``grace_period`` (warns
            ``DeprecationWarning``).

    Raises:
        ValueError, TypeError: a bad argument, named (at the call, before
            anything starts): a CPU outside the allowed set, an empty list,
            a NUMA node this machine does not list (the message names the
            missing file), a ``capacity`` with fewer slots than workers,
            ``max_concurrency`` below 1, a ``worker_loop`` other than
            ``"asyncio"``/``"uvloop"`` or uvloop not installed,
            ``grace_period`` and ``shutdown_timeout`` both given.
        Exception: what made a worker's start fail (the initializer's
            exception, ``TimeoutError``, ``BrokenWorkerError``), raised as
            soon as one fails, once every worker is stopped.

    Cancellation: cancelling the start (the ``await`` or the ``async with``
    entry) at any point stops every worker started or starting, shielded and
    bounded, before the cancellation propagates: nothing is left running,
    and no slot of ``capacity`` is held.
    """
    if not isinstance(name, str):
        raise TypeError(f"open_pool(): name must be a str, got {name!r}")
    if env is not None and not isinstance(env, Mapping):
        raise TypeError(f"env must be a dict of str to str, got {env!r}")
    slots = worker_slots(n_or_cluster_spec, name, dict(env or {}))
    options = worker_options(
        "open_pool",
        workers=len(slots),
        initializer=initializer,
        initargs=initargs,
        init_timeout=init_timeout,
        grace_period=grace_period,
        shutdown_timeout=shutdown_timeout,
        env=env,
        start_method=start_method,
        preload=preload,
        limits=limits,
        capacity=capacity,
        max_concurrency=max_concurrency,
        worker_loop=worker_loop,
    )
    return open_workers(
        slots,
        options,
        name=name,
        max_calls_per_worker=max_calls_per_worker,
        idle_timeout=idle_timeout,
        cpus=cpus,
    )
