"""``run()``: start a group, wait for it, close it, raise if it failed."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._validate import check_duration
from .context import SinkLike, start_processes
from .errors import ChildFailedError
from .logs import LogsSpecs
from .results import DEFAULT_GRACE_PERIOD, RunProcsResult

__all__ = ["run"]


async def run(
    entrypoint: Callable[..., Any] | str,
    nprocs: int,
    args: Mapping[int, tuple[Any, ...]] | tuple[Any, ...] | None = None,
    envs: Mapping[int, Mapping[str, str]] | None = None,
    *,
    name: str | None = None,
    logs_specs: LogsSpecs | None = None,
    log_line_prefixes: Mapping[int, str] | str | None = None,
    start_method: str = "spawn",
    timeout: float | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    sinks: Sequence[SinkLike] | None = None,
) -> RunProcsResult:
    """Run ``nprocs`` workers to completion: start, wait, close.

    Args:
        entrypoint: a callable or an executable, as for ``start_processes``.
        nprocs: number of workers (> 0).
        args: one tuple for every rank, or ``{local_rank: tuple}``; default
            no arguments.
        envs: ``{local_rank: {name: value}}``; default no extra variables.
        name: group name (default: the function's or executable's name).
        timeout: seconds before the group is stopped and ``TimeoutError``
            raised (its ``result`` attribute holds the partial result).

    Returns:
        The ``RunProcsResult`` when every worker succeeded.

    Raises:
        ChildFailedError: a worker failed; its ``__cause__`` is the root-cause
            worker's own exception (function workers), whose ``__cause__``
            holds the worker's traceback.
        TimeoutError: ``timeout`` expired.

    Cancellation: the workers are stopped (shielded, bounded) before the
    cancellation propagates.
    """
    check_duration("timeout", timeout, allow_none=True)
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs <= 0:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if args is None:
        args = {}
    if isinstance(args, tuple):
        rank_args: Mapping[int, tuple[Any, ...]] = {r: args for r in range(nprocs)}
    elif isinstance(args, Mapping):
        rank_args = args if args else {r: () for r in range(nprocs)}
    else:
        raise TypeError(f"args must be a tuple or a {{local_rank: tuple}} dict, got {args!r}")
    rank_envs = envs if envs else {r: {} for r in range(nprocs)}
    if name is None:
        name = (
            os.path.basename(entrypoint)
            if isinstance(entrypoint, str)
            else getattr(entrypoint, "__name__", "worker")
        )
    if len(rank_args) != nprocs:
        raise RuntimeError(
            f"args has {len(rank_args)} ranks {sorted(rank_args)} but nprocs is {nprocs}"
        )
    async with start_processes(
        name,
        entrypoint,
        rank_args,
        rank_envs,
        logs_specs,
        log_line_prefixes,
        start_method,
        grace_period=grace_period,
        sinks=sinks,
    ) as pc:
        result = await pc.wait(-1 if timeout is None else timeout)
        if result is None:
            await pc.close(signal.SIGTERM, grace_period)
            partial = pc.poll()
            stopped = sorted(partial.failures) if partial is not None else []
            err = TimeoutError(
                f"{pc.name}: workers still running after {timeout} s; stopped ranks {stopped}"
            )
            err.result = partial  # type: ignore[attr-defined]
            raise err
        if result.is_failed():
            failed = ChildFailedError(name=pc.name, failures=result.failures)
            root, _ = failed.get_first_failure()
            raise failed from pc.remote_exception(root)
        return result
