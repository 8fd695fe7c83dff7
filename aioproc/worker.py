"""Persistent worker processes: one interpreter answering requests (``open_worker``).

PyTorch's ``CheckpointProcess``, async: a worker that runs an initializer
once, then answers ``call`` and ``ping`` until it is closed.  Coroutine
functions run on the worker's own event loop, many calls at once
(``max_concurrency``), and cancelling such a call cancels its coroutine in
the worker.  Its stop is a
terminate request, ``grace_period`` seconds for the worker to exit, then
SIGKILL of its process group.  Never hangs: a worker that dies fails the
call in flight with ``BrokenWorkerError`` as soon as its exit is noticed.
The implementation lives in the ``_worker`` wing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ._base import public_module
from ._base.resource import OpenResource
from ._group.resources import CpusArg
from ._limits.capacity import Capacity
from ._limits.spec import Limits
from ._worker.options import one_spelling, worker_cpus, worker_options
from ._worker.process import DEFAULT_MAX_CONCURRENCY, WorkerProcess
from ._worker.start import open_one
from .results import DEFAULT_GRACE_PERIOD

__all__ = ["WorkerProcess", "open_worker"]

public_module(__name__, WorkerProcess)  # defined in the wing, imported from here

_counter = 0  # numbers the workers opened without a name


def open_worker(
    init: Callable[..., Any] | None = None,
    init_args: Iterable[Any] | None = None,
    *,
    initializer: Callable[..., Any] | None = None,
    initargs: Iterable[Any] | None = None,
    init_timeout: float = 30,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    env: Mapping[str, str] | None = None,
    name: str | None = None,
    start_method: str = "spawn",
    preload: Sequence[str] = (),
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    worker_loop: str = "asyncio",
    limits: Limits | None = None,
    capacity: Capacity | None = None,
    cpus: CpusArg = None,
    shutdown_timeout: float | None = None,
) -> OpenResource[WorkerProcess]:
    """Start a persistent worker process (PyTorch's ``CheckpointProcess``, async).

    ``async with aioproc.open_worker(setup) as w:`` starts it, runs
    ``setup()`` in it once (its return value is the worker state, read by
    called functions with ``aioproc.worker_state()``, which imports nothing
    heavy in the worker), and stops it when the block exits.
    ``w = await aioproc.open_worker(...)`` also works; then call
    ``await w.aclose()``.

    Args:
        init: run once in the worker before any call; the only option
            that may be given by position (with ``init_args``).
            ``initializer`` is its concurrent.futures spelling, as for
            ``open_pool``: pass one of the two.
        init_args: arguments for ``init``; ``initargs`` is its other spelling.
        initializer: the same as ``init``.
        initargs: the same as ``init_args``.
        init_timeout: seconds the initializer may take (``TimeoutError`` beyond).
        grace_period: seconds the worker gets to exit after the terminate
            request before its process group is SIGKILLed (and named in a
            ``ForcedKillWarning``); the default is every aioproc stop's.
        env: extra environment variables for the worker.
        name: used in messages and as the stderr prefix ``[name]:``.
        start_method: ``"spawn"`` or ``"forkserver"`` (forked from the
            template for ``preload``; see ``start_processes``).
        preload: modules the forkserver template imports first.
        max_concurrency: calls in flight on the worker at most (default
            100); more wait in the supervisor, in the order they were made.
            Coroutine calls run concurrently up to it; sync calls run one at
            a time whatever it is.  ``1`` makes every call wait for the one
            before it.
        worker_loop: the event loop coroutine calls run on in the worker,
            ``"asyncio"`` (the default) or ``"uvloop"``; made at the first
            coroutine call (a worker that runs none never imports asyncio).
        limits: resource limits for the worker and every process it starts
            (``aioproc.Limits``; its own cgroup, else rlimits: see
            ``start_processes``), removed once the worker is reaped.  Killed
            by the kernel's OOM killer, the worker fails the call in flight
            with a ``BrokenWorkerError`` that says so; past an rlimit, the
            allocation fails instead (the call raises ``MemoryError``).
        capacity: a process budget (``aioproc.Capacity``) shared with
            groups and pools: the worker waits for one slot before it starts
            and holds it until it is reaped.
        cpus: the CPUs the worker runs on (Linux), as ``start_processes``
            takes them for a group of one: a list of CPU ids,
            ``"numa:<node>"`` (that node's CPUs, from
            ``/sys/devices/system/node/node<N>/cpulist``, among the allowed
            ones), ``{0: CPU ids}``, or ``"round-robin"`` (one CPU of this
            process's allowed set, ``os.sched_getaffinity(0)``, the next
            one for each worker opened).  Set from this process before the
            worker runs its initializer.
        shutdown_timeout: deprecated name of ``grace_period`` (warns
            ``DeprecationWarning``).

    Raises:
        TypeError, ValueError: a bad argument, named, before anything
            starts (``max_concurrency`` below 1, a ``worker_loop`` other
            than ``"asyncio"``/``"uvloop"`` or uvloop not installed, a CPU
            not in the allowed set, an empty list, a NUMA node this machine
            does not list: the message names the missing file); two
            spellings of one option given together.
        TimeoutError: the initializer took longer than ``init_timeout``.
        Exception: whatever the initializer raised, with the worker's traceback.
        BrokenWorkerError: the worker died during its initializer.

    Cancellation: a cancelled start (also one waiting for its ``capacity``
    slot) kills the half-started worker, removes its placement and holds no
    slot.
    """
    global _counter
    fn_name, fn = one_spelling("open_worker", "initializer", initializer, "init", init)
    args_name, arguments = one_spelling("open_worker", "initargs", initargs, "init_args", init_args)
    options = worker_options(
        "open_worker",
        workers=1,
        initializer=fn,
        initargs=() if arguments is None else arguments,
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
        spelled=(fn_name, args_name),
    )
    if name is not None and not isinstance(name, str):
        raise TypeError(f"open_worker(): name must be a str, got {name!r}")
    (own_cpus,) = worker_cpus(cpus, 1, one_by_one=True)
    _counter += 1
    return open_one(name or f"worker{_counter}", options, own_cpus)
