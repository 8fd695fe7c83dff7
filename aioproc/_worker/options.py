"""How the workers of one ``open_worker`` or ``open_pool`` start and stop, checked once.

The factories' keywords, the old spellings included, are read here once:
every value is checked before anything starts (a mistake raises
``TypeError``/``ValueError`` naming the value and leaves nothing behind),
two spellings of one option given together are refused, a deprecated one
warns, and what the starts need is kept in one frozen ``WorkerOptions``
that they only read, the first start of a pool as its last replacement.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from .._base.checks import check_duration, check_env, check_preload, check_start_method
from .._func.boot import check_worker_loop
from .._group.resources import CpusArg, check_capacity, check_cpus, check_worker_limits
from .._limits.affinity import ROUND_ROBIN, allowed_cpus
from .._limits.capacity import Capacity
from .._limits.spec import Limits
from ..results import DEFAULT_GRACE_PERIOD
from .process import DEFAULT_MAX_CONCURRENCY

__all__ = [
    "WorkerOptions",
    "check_max_concurrency",
    "one_spelling",
    "worker_cpus",
    "worker_options",
]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """What every start of one worker, or of each worker of a pool, reads.

    Attributes:
        initializer: run once in each worker before any call, or None.
        initargs: its positional arguments.
        init_timeout: seconds the initializer may take.
        grace_period: seconds a worker gets to exit after the terminate
            request before its process group is SIGKILLed.
        env: extra environment variables for each worker.
        preload: the forkserver template's modules; None for spawn.
        limits: each worker's own placement, or None.
        capacity: the process budget each worker takes one slot of, or None.
        max_concurrency: calls each worker has in flight at most.
        worker_loop: the event loop each worker runs coroutine calls on.
    """

    initializer: Callable[..., Any] | None
    initargs: tuple[Any, ...]
    init_timeout: float
    grace_period: float
    env: Mapping[str, str]
    preload: tuple[str, ...] | None
    limits: Limits | None
    capacity: Capacity | None
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    worker_loop: str = "asyncio"


def one_spelling(
    caller: str, preferred: str, value: T | None, alias: str, old: T | None
) -> tuple[str, T | None]:
    """The option given as ``preferred`` or as its ``alias``: the name used and the value.

    Neither given: ``preferred`` and None.

    Raises:
        TypeError: both were given, naming both.
    """
    if value is not None and old is not None:
        raise TypeError(
            f"{caller}() got both {preferred}={value!r} and {alias}={old!r}, two spellings "
            f"of one option: pass {preferred}= only"
        )
    return (preferred, value) if old is None else (alias, old)


def worker_options(
    caller: str,
    *,
    workers: int,
    initializer: Callable[..., Any] | None,
    initargs: Iterable[Any],
    init_timeout: float,
    grace_period: float,
    shutdown_timeout: float | None,
    env: Mapping[str, str] | None,
    start_method: str,
    preload: Sequence[str],
    limits: Limits | None,
    capacity: Capacity | None,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    worker_loop: str = "asyncio",
    spelled: tuple[str, str] = ("initializer", "initargs"),
) -> WorkerOptions:
    """Check a factory's options for ``workers`` workers; the one ``WorkerOptions``.

    ``shutdown_timeout`` (None where not given) is ``grace_period``'s old
    name: checked under that name, then a ``DeprecationWarning`` pointing at
    the caller's call.  ``grace_period`` is given when it is not the very
    default object (``DEFAULT_GRACE_PERIOD``).  ``spelled``: the names the
    caller gave the initializer and its arguments, for messages.

    Raises:
        TypeError, ValueError: a bad value, named; ``grace_period`` and
            ``shutdown_timeout`` both given.
    """
    if initializer is not None and not callable(initializer):
        raise TypeError(f"{caller}(): {spelled[0]} must be callable, got {initializer!r}")
    if isinstance(initargs, (str, bytes)) or not isinstance(initargs, Iterable):
        raise TypeError(f"{caller}(): {spelled[1]} must be a tuple of arguments, got {initargs!r}")
    timeout = check_duration("init_timeout", init_timeout)
    grace = check_duration("grace_period", grace_period)
    if shutdown_timeout is not None:
        if grace_period is not DEFAULT_GRACE_PERIOD:
            raise TypeError(
                f"{caller}() got both grace_period={grace_period!r} and "
                f"shutdown_timeout={shutdown_timeout!r}, two spellings of one option: "
                "pass grace_period= only"
            )
        grace = check_duration("shutdown_timeout", shutdown_timeout)
        warnings.warn(
            f"{caller}(shutdown_timeout=...) is deprecated: pass grace_period= (the same "
            "seconds, the name every aioproc stop uses)",
            DeprecationWarning,
            stacklevel=3,  # the user's call of the factory
        )
    if env is not None:
        check_env("env", env)
    method = check_start_method(start_method)
    names = check_preload(method, preload)
    concurrency = check_max_concurrency(max_concurrency)
    loop = check_worker_loop(worker_loop)
    return WorkerOptions(
        initializer=initializer,
        initargs=tuple(initargs),
        init_timeout=timeout,
        grace_period=grace,
        env=dict(env or {}),
        preload=names if method == "forkserver" else None,
        limits=check_worker_limits(limits),
        capacity=check_capacity(capacity, workers),
        max_concurrency=concurrency,
        worker_loop=loop,
    )


def check_max_concurrency(value: object) -> int:
    """``max_concurrency``, checked: a positive int.

    Raises:
        TypeError: not an int (or a bool).
        ValueError: below 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_concurrency must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(
            f"max_concurrency must be >= 1 (calls in flight per worker), got {value!r}"
        )
    return value


_cpu_turn = 0  # open_worker(cpus="round-robin"): the next CPU of the allowed set


def worker_cpus(cpus: CpusArg, workers: int, *, one_by_one: bool = False) -> list[CpusArg]:
    """``cpus=`` of ``workers`` persistent workers, checked: each one's own ``cpus``.

    As a group's (``_group.resources.check_cpus``), a worker position
    standing for a local rank: a list of CPU ids (or ``"numa:<node>"``) for
    every worker, ``{position: list}`` for the ones named (the others run
    where this process may), ``"round-robin"`` one CPU each by position.
    With ``one_by_one`` (``open_worker``: a worker at a time),
    ``"round-robin"`` gives each call the next CPU of the allowed set.

    Raises:
        TypeError, ValueError: as ``check_cpus``, naming the value.
    """
    global _cpu_turn
    if one_by_one and cpus == ROUND_ROBIN:
        allowed = allowed_cpus()
        cpus = [allowed[_cpu_turn % len(allowed)]]
        _cpu_turn += 1
    checked = check_cpus(cpus, workers)
    if checked is None:
        return [None] * workers
    return [{0: checked[i]} if i in checked else None for i in range(workers)]
