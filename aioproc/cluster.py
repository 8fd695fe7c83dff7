"""TensorFlow's ``multi_process_runner``, async: a cluster of named tasks as local processes.

::

    spec = aioproc.cluster.create_cluster_spec(has_chief=True, num_workers=2)
    result = await aioproc.cluster.run(train, spec, return_output=True)
    result.return_value        # chief's, then worker-0's, worker-1's (None dropped)

Every task ``(task_type, task_id)`` of the cluster spec runs ``fn`` in a
fresh interpreter with ``TF_CONFIG`` naming the cluster and the task; its
lines reach the console (and ``result.stdout``) prefixed ``[worker-1]:`` as
TF prints them.  ``open_cluster`` opens a ``ClusterRunner``, for per-task
control (terminate, start a single task, pids, exit codes)::

    async with aioproc.cluster.open_cluster(train, spec) as runner:
        result = await runner.join()

``barrier()`` synchronises the tasks (``await abarrier()`` in a coroutine).
Differences from TF: a task killed by a signal is a failure
(``UnexpectedSubprocessExitError``), results are ordered, a timeout reports
every live task's stacks, restarts back off, and nothing polls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._base import public_module
from ._child.boot import abarrier as abarrier
from ._child.boot import barrier as barrier
from ._cluster.result import DEFAULT_TIMEOUT
from ._cluster.result import MultiProcessRunnerResult as MultiProcessRunnerResult
from ._cluster.result import SubprocessTimeoutError as SubprocessTimeoutError
from ._cluster.result import UnexpectedSubprocessExitError as UnexpectedSubprocessExitError
from ._cluster.tfconfig import assign_gpus as assign_gpus
from ._cluster.tfconfig import create_cluster_spec as create_cluster_spec

if TYPE_CHECKING:
    from ._base.resource import OpenResource
    from ._cluster.runner import ClusterRunner as ClusterRunner

# Defined in the wing, named here: reprs and pickles show the path users import.
public_module(
    __name__,
    MultiProcessRunnerResult,
    SubprocessTimeoutError,
    UnexpectedSubprocessExitError,
    abarrier,
    assign_gpus,
    barrier,
    create_cluster_spec,
)

__all__ = [
    "ClusterRunner",
    "MultiProcessRunnerResult",
    "SubprocessTimeoutError",
    "UnexpectedSubprocessExitError",
    "abarrier",
    "assign_gpus",
    "barrier",
    "create_cluster_spec",
    "open_cluster",
    "run",
]


async def run(
    fn: Callable[..., Any],
    cluster_spec: Mapping[str, Sequence[str] | int],
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    return_output: bool = False,
    stream_output: bool = True,
    max_run_time: float | None = None,
    dependence_on_chief: bool = True,
    auto_restart: bool = False,
    share_gpu: bool = True,
    env: Mapping[str, str] | None = None,
    **options: Any,
) -> MultiProcessRunnerResult:
    """Run ``fn(*args, **kwargs)`` in one process per task of ``cluster_spec``.

    Args:
        fn: a picklable callable.
        cluster_spec: ``{task_type: [address, ...]}`` (``create_cluster_spec``
            makes one with free localhost ports), or ``{task_type: count}``.
            Task types ``chief``, ``worker``, ``ps``, ``evaluator`` (others
            are allowed and sort after them); at most one chief.
        args, kwargs: passed to ``fn`` in every task.
        timeout: bound on the whole run in seconds (``None``: none).  On
            expiry every live task dumps its threads' stacks into its output,
            then all are stopped; ``SubprocessTimeoutError`` carries the
            dumps and the partial result.
        return_output: collect every prefixed line in ``result.stdout``.
        stream_output: print the prefixed lines to the console.
        max_run_time: seconds after which a task is stopped and counted as
            done with value ``None`` (TF's meaning).
        dependence_on_chief: when the chief exits, the other tasks get
            ``chief_grace_period`` (3 s) to end, then are stopped.
        auto_restart: restart tasks that fail (or are terminated), with
            backoff, up to ``max_restarts`` times each; a chief that exits 0
            ends the restarts, and so does a timeout.
        share_gpu: ``False`` gives each task its own ``CUDA_VISIBLE_DEVICES``,
            round robin over the GPUs found (see ``assign_gpus``); nothing is
            set where no GPU is found.
        env: extra environment variables for every task.
        options: the other keyword arguments of ``ClusterRunner``.

    Returns:
        The ``MultiProcessRunnerResult``.

    Raises:
        The first failed task's own exception (original type, its traceback
        as ``__cause__``, ``mpr_result`` attached); ``UnexpectedSubprocessExitError``
        for a task that exited non-zero or was killed by a signal without
        raising; ``SubprocessTimeoutError``; ``TypeError``/``ValueError`` for
        bad input, before anything starts.

    Cancellation: every task is stopped (shielded, bounded) before the
    cancellation propagates.
    """
    from ._cluster.runner import ClusterRunner

    runner = ClusterRunner(
        fn,
        cluster_spec,
        args=args,
        kwargs=kwargs,
        return_output=return_output,
        stream_output=stream_output,
        max_run_time=max_run_time,
        dependence_on_chief=dependence_on_chief,
        auto_restart=auto_restart,
        share_gpu=share_gpu,
        env=env,
        **options,
    )
    async with runner:
        return await runner.join(timeout)


def open_cluster(
    fn: Callable[..., Any],
    cluster_spec: Mapping[str, Sequence[str] | int],
    **options: Any,
) -> OpenResource[ClusterRunner]:
    """A started ``ClusterRunner``: ``fn`` runs once per task of ``cluster_spec``.

    Awaited, it starts every task and returns the runner (close it with
    ``await runner.aclose()``); with ``async with``, leaving the block stops
    every task (SIGTERM, SIGKILL after the runner's ``grace_period``) and
    releases everything.  TF's face, ``ClusterRunner(...)`` then
    ``start()``, stays.

    Usage::

        async with open_cluster(train, create_cluster_spec(num_workers=2)) as runner:
            await runner.terminate("worker", 1)
            result = await runner.join()

    Args:
        fn: a picklable callable.
        cluster_spec: as for ``run``.
        options: ``ClusterRunner``'s options, keyword-only (``args``,
            ``kwargs``, ``return_output``, ``grace_period``...); checked at
            the call, before anything starts.

    Returns:
        An ``OpenResource``: ``await`` it, or use it with ``async with``.

    Raises:
        TypeError, ValueError: bad arguments (at the call).
        OSError: a task could not be launched (the others are stopped).

    Cancellation: cancelled while the tasks start, those started are
    stopped (shielded, bounded) before it propagates; leaving the ``async
    with`` block by a cancellation stops every task the same way.
    """
    from ._base.resource import OpenResource
    from ._cluster.runner import ClusterRunner

    runner = ClusterRunner(fn, cluster_spec, **options)

    async def close(runner: ClusterRunner, exc: BaseException | None) -> None:
        await runner.aclose()

    return OpenResource(runner._started, close, "open_cluster(...)")


def __getattr__(name: str) -> Any:
    # The runner (and with it asyncio) loads on first use: a task that only
    # calls ``barrier()`` imports this module without paying for the loop.
    if name == "ClusterRunner":
        from ._cluster.runner import ClusterRunner  # named this module's where it is defined

        globals()[name] = ClusterRunner
        return ClusterRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
