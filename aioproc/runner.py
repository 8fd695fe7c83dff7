"""The two ways to run a group: ``start_processes`` (yours to wait on and close)
and ``run()`` (start, wait, close, raise if it failed)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._base.checks import check_duration
from ._base.resource import OpenResource
from ._errors.summary import ChildFailedError
from ._group.rank_launcher import SinkLike
from ._group.resources import CpusArg, LimitsArg
from ._limits.capacity import Capacity
from ._supervisor.spec import DEFAULT_GRACE_PERIOD, GroupSpec
from .context import PContext, close_on_exit
from .logs import DefaultLogsSpecs, LogsSpecs
from .results import RunProcsResult, RunTimeoutError, WorkerEvent

__all__ = ["run", "start_processes"]


async def _start(pc: PContext) -> PContext:
    await pc.start()
    return pc


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, Mapping[str, str]],
    logs_specs: LogsSpecs | None = None,
    log_line_prefixes: Mapping[int, str] | str | None = None,
    start_method: str = "spawn",
    *,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    sinks: Sequence[SinkLike] | None = None,
    duplicate_stdout_filters: Sequence[str] | None = None,
    duplicate_stderr_filters: Sequence[str] | None = None,
    pass_fds: Sequence[int] = (),
    on_event: Callable[[WorkerEvent], None] | None = None,
    close_sinks: bool = True,
    preload: Sequence[str] = (),
    kwargs: Mapping[int, Mapping[str, Any]] | None = None,
    limits: LimitsArg = None,
    capacity: Capacity | None = None,
    cpus: CpusArg = None,
    sample_interval: float | None = None,
    worker_loop: str = "asyncio",
) -> OpenResource[PContext]:
    """Start ``len(args)`` workers running ``entrypoint``.

    ``await start_processes(...)`` returns the started ``PContext``;
    ``async with start_processes(...) as pc:`` also closes the group when
    the block exits, by error, cancellation or signal (a ``SignalException``,
    or a cancellation from ``translate_signals``, stops the workers with
    that same signal).

    Args:
        name: the group's name, used in log prefixes and messages.
        entrypoint: a picklable callable (function workers) or the path or
            name of an executable (binary workers: ``argv = (entrypoint,
            *map(str, args[rank]))``, never a shell).
        args: ``{local_rank: tuple}`` for ranks ``0..n-1``.
        envs: ``{local_rank: {name: value}}``, added to the parent's
            environment in each worker.
        logs_specs: where output and error files go (default:
            ``DefaultLogsSpecs()``: inherited output, error files in a
            temporary directory that is removed when left empty).
        log_line_prefixes: ``{local_rank: prefix}`` for tee'd lines, or one
            template for every rank with ``${role_name}`` (the group name),
            ``${rank}`` (the rank's ``RANK`` env var, else its local rank)
            and ``${local_rank}``; a per-rank value may be a template too.
            Default ``[{name}{local_rank}]:``.
        start_method: ``"spawn"`` (default): every worker is a fresh
            interpreter.  ``"forkserver"``: function workers are forked from
            a template process that imported ``preload`` once (binary
            workers are still spawned); ``"fork"`` is refused.
        grace_period: seconds between SIGTERM and SIGKILL when a failure
            stops the group or the ``async with`` block exits.
        sinks: where tee'd lines go (``aioproc.sinks``): ``Sink`` objects,
            callables taking an ``OutputLine`` (sync or async), file paths or
            open text files.  Default: one ``ConsoleSink``.
        duplicate_stdout_filters: lines of redirected or tee'd stdout that
            contain any of these strings also go, prefixed, to the attempt's
            ``filtered_stdout.log`` (torch's option).
        duplicate_stderr_filters: the same for stderr.
        pass_fds: extra fds every worker inherits (kept open under the same
            numbers), e.g. a channel the worker reports to.
        on_event: called on the loop with a ``WorkerEvent`` when a worker
            has started and when its exit has been recorded.
        close_sinks: close the given ``sinks`` when the group is closed
            (``False`` when they outlive the group, as across agent restarts).
        preload: modules the forkserver template imports before forking
            (torch's ``set_forkserver_preload``); only with ``"forkserver"``.
            A module that fails to import raises ``ImportError``; one that
            starts a thread or initialises CUDA raises ``RuntimeError``.
        kwargs: ``{local_rank: {name: value}}``, keyword arguments of
            function workers (ranks left out get none).
        limits: resource limits (``aioproc.Limits``: memory, CPU quota,
            processes): one ``Limits`` is each rank's own (a cgroup per
            rank, as ``aioproc run --memory-limit``), or
            ``{local_rank: Limits}`` for the ranks named.
            Each limit is enforced by the best mechanism this host offers
            (a cgroup v2 or v1 group, else an rlimit), said once in the log
            at INFO; a limit nothing can enforce here is named in a
            WARNING.  A rank the kernel's OOM killer ends, or a process of
            its cgroup, is reported as such (``ProcessFailure.oom``, the
            summary, the ``"exited"`` event).  The cgroups are removed when
            the group is closed.
        capacity: a process budget (``aioproc.Capacity``) shared with other
            groups: the start waits, first come first served, until all
            ``len(args)`` workers fit, and gives the slots back once the
            group is closed and every worker reaped.
        cpus: the CPUs the workers run on (Linux): a list of CPU ids for
            every rank, ``{local_rank: [CPU ids]}`` for the ranks named,
            ``"round-robin"`` (rank ``r`` gets the ``r % n``-th of the
            ``n`` CPUs this process may use, ``os.sched_getaffinity(0)``),
            or ``"numa:<node>"`` (alone or per rank): the CPUs
            ``/sys/devices/system/node/node<N>/cpulist`` lists, among the
            allowed ones.  Each worker is pinned from this process right
            after its start, before it runs user code (a binary worker:
            microseconds after its exec); its threads and children inherit
            the set.  A CPU outside the allowed set, an empty list, a rank
            not in the group or a node this machine does not list (the
            message names the missing file) raises before anything starts.
        sample_interval: seconds between live samples of every running
            worker's CPU time and memory, read from ``/proc`` off the event
            loop and delivered to ``on_event`` as "sampled" events (Linux; a
            documented periodic read, off by default).  A positive number
            or None, else ValueError.
        worker_loop: the event loop a coroutine-function ``entrypoint``
            (``async def``) runs on in each worker, a fresh one closed after,
            as ``asyncio.run`` does: ``"asyncio"`` (default) or ``"uvloop"``.
            The stop (SIGTERM, SIGINT, SIGHUP) cancels the coroutine, so its
            ``finally:`` blocks run within ``grace_period``.  Ignored by a
            sync function.  Another value, or ``"uvloop"`` where uvloop is
            not installed, raises ValueError before anything starts.

    Raises:
        TypeError, ValueError, RuntimeError, FileNotFoundError,
        PermissionError, NotADirectoryError: for bad input, before anything
        is started.

    Cancellation: cancelled while it waits for ``capacity``, nothing was
    started and no slot is held.  Cancelled while the group starts, every
    worker started so far is killed with its group (shielded, bounded) before the
    cancellation propagates, or stopped with the signal and the grace
    period when ``translate_signals`` cancelled it; nothing is left
    running.  A cancellation inside ``async with`` stops the workers as the
    block exits: SIGTERM (or the translated signal), SIGKILL after the
    grace period, shielded.
    """
    spec = GroupSpec(
        name,
        entrypoint,
        args,
        envs,
        logs_specs if logs_specs is not None else DefaultLogsSpecs(),
        log_line_prefixes,
        start_method,
        grace_period=grace_period,
        sinks=sinks,
        duplicate_stdout_filters=duplicate_stdout_filters,
        duplicate_stderr_filters=duplicate_stderr_filters,
        pass_fds=pass_fds,
        on_event=on_event,
        close_sinks=close_sinks,
        preload=preload,
        kwargs=kwargs,
        limits=limits,
        capacity=capacity,
        cpus=cpus,
        sample_interval=sample_interval,
        worker_loop=worker_loop,
    )
    pc = PContext._from_spec(spec)
    return OpenResource(lambda: _start(pc), close_on_exit, "start_processes(...)")


async def run(
    entrypoint: Callable[..., Any] | str,
    nprocs: int,
    args: Mapping[int, tuple[Any, ...]] | tuple[Any, ...] | None = None,
    envs: Mapping[int, Mapping[str, str]] | None = None,
    *,
    kwargs: Mapping[int, Mapping[str, Any]] | Mapping[str, Any] | None = None,
    name: str | None = None,
    logs_specs: LogsSpecs | None = None,
    log_line_prefixes: Mapping[int, str] | str | None = None,
    start_method: str = "spawn",
    timeout: float | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    sinks: Sequence[SinkLike] | None = None,
    preload: Sequence[str] = (),
    limits: LimitsArg = None,
    capacity: Capacity | None = None,
    cpus: CpusArg = None,
    worker_loop: str = "asyncio",
) -> RunProcsResult:
    """Run ``nprocs`` workers to completion: start, wait, close.

    Args:
        entrypoint: a callable or an executable, as for ``start_processes``.
        nprocs: number of workers (> 0).
        args: one tuple for every rank, or ``{local_rank: tuple}``; default
            no arguments.
        envs: ``{local_rank: {name: value}}``; default no extra variables.
        kwargs: keyword arguments of function workers: one ``{name: value}``
            dict for every rank, or ``{local_rank: {name: value}}``.
        name: group name (default: the function's or executable's name).
        timeout: seconds before the group is stopped and ``RunTimeoutError``
            raised (its ``result`` attribute holds the partial result).
        logs_specs, log_line_prefixes, start_method: as for ``start_processes``.
        grace_period, sinks, preload, limits, capacity, cpus, worker_loop: as
            for ``start_processes``.

    Returns:
        The ``RunProcsResult`` when every worker succeeded; its ``usage``
        says what each worker used.

    Raises:
        ChildFailedError: a worker failed; its ``__cause__`` is the root-cause
            worker's own exception (function workers), whose ``__cause__``
            holds the worker's traceback.
        RunTimeoutError: ``timeout`` expired (a ``TimeoutError``).
        TypeError, ValueError: bad input, before anything is started (a
            ``{local_rank: tuple}`` ``args`` whose ranks are not ``0..nprocs-1``
            is a ``ValueError`` naming both).

    Cancellation: the workers are stopped (shielded, bounded) before the
    cancellation propagates; a run still waiting for ``capacity`` started
    nothing and holds no slot.
    """
    check_duration("timeout", timeout, allow_none=True)
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs <= 0:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    rank_args = _rank_args(args, nprocs)
    if name is None:
        name = (
            os.path.basename(entrypoint)
            if isinstance(entrypoint, str)
            else getattr(entrypoint, "__name__", "worker")
        )
    spec = GroupSpec(
        name,
        entrypoint,
        rank_args,
        envs if envs else {r: {} for r in range(nprocs)},
        logs_specs if logs_specs is not None else DefaultLogsSpecs(),
        log_line_prefixes,
        start_method,
        grace_period=grace_period,
        sinks=sinks,
        preload=preload,
        kwargs=_rank_kwargs(kwargs, nprocs),
        limits=limits,
        capacity=capacity,
        cpus=cpus,
        worker_loop=worker_loop,
    )
    group = PContext._from_spec(spec)
    async with OpenResource(lambda: _start(group), close_on_exit, "run()") as pc:
        result = await pc.wait(-1 if timeout is None else timeout)
        if result is None:
            await pc.close(signal.SIGTERM)
            partial = pc.poll()
            stopped = sorted(partial.failures) if partial is not None else []
            raise RunTimeoutError(
                f"{pc.name}: workers still running after {timeout} s; stopped ranks {stopped}",
                partial,
            )
        if result.is_failed():
            failed = ChildFailedError(pc.name, result.failures, result.log_dir)
            root, _ = failed.get_first_failure()
            raise failed from pc.remote_exception(root)
        return result


def _rank_args(
    args: Mapping[int, tuple[Any, ...]] | tuple[Any, ...] | None, nprocs: int
) -> Mapping[int, tuple[Any, ...]]:
    """``run()``'s ``args`` as ``{local_rank: tuple}`` for ranks ``0..nprocs-1``."""
    if args is None or (isinstance(args, Mapping) and not args):
        return {r: () for r in range(nprocs)}
    if isinstance(args, tuple):
        return dict.fromkeys(range(nprocs), args)
    if not isinstance(args, Mapping):
        raise TypeError(f"args must be a tuple or a {{local_rank: tuple}} dict, got {args!r}")
    if set(args) != set(range(nprocs)):
        raise ValueError(
            f"args has {len(args)} ranks {sorted(args, key=repr)} but nprocs is {nprocs}: "
            f"give one tuple for every rank 0..{nprocs - 1}, or one tuple for all"
        )
    return args


def _rank_kwargs(
    kwargs: Mapping[int, Mapping[str, Any]] | Mapping[str, Any] | None, nprocs: int
) -> Mapping[int, Mapping[str, Any]] | None:
    """``run()``'s ``kwargs`` as ``{local_rank: {name: value}}`` (a shared dict for every rank)."""
    if not kwargs:
        return None
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a dict, got {kwargs!r}")
    if all(isinstance(k, str) for k in kwargs):
        shared: Mapping[str, Any] = kwargs  # type: ignore[assignment]
        return dict.fromkeys(range(nprocs), shared)
    return kwargs  # type: ignore[return-value]  # checked per rank by the spec
