"""The ``aioproc_group``, ``aioproc_pool`` and ``aioproc_cluster`` fixtures:
factories whose products are closed at teardown.

Each factory keeps what it opened on an ``AsyncExitStack`` and closes it,
newest first, when the fixture is torn down: after a passing test, a failing
one, or a cancelled one, on the test's own event loop (the fixtures are async
fixtures; the plugin hands them to pytest-asyncio or anyio, whichever runs
the test).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from .._cluster.runner import ClusterRunner
from ..context import PContext
from ..pool import WorkerPool


def _per_rank(value: Any, nprocs: int, what: str) -> dict[int, Any]:
    """``value`` for every rank, or a ``{rank: value}`` dict covering ranks 0..n-1."""
    if isinstance(value, Mapping) and all(isinstance(k, int) for k in value) and value:
        if set(value) != set(range(nprocs)):
            raise ValueError(f"{what} must cover ranks 0..{nprocs - 1}, got ranks {sorted(value)}")
        return dict(value)
    return dict.fromkeys(range(nprocs), value)


class GroupFactory:
    """``await aioproc_group(fn_or_binary, nprocs, args=(), envs={}, **kwargs)``.

    Starts a group with :func:`aioproc.start_processes` and returns the started
    ``PContext``; every group it started is closed at the fixture's teardown.
    """

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self._stack = stack
        self._count = 0

    def __repr__(self) -> str:
        return f"<aioproc_group factory: {self._count} groups started>"

    async def __call__(
        self,
        entrypoint: Callable[..., Any] | str,
        nprocs: int = 1,
        *,
        args: tuple[Any, ...] | Mapping[int, tuple[Any, ...]] = (),
        envs: Mapping[str, str] | Mapping[int, Mapping[str, str]] | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> PContext:
        """Start ``nprocs`` workers running ``entrypoint``.

        Args:
            entrypoint: a picklable callable, or an executable.
            nprocs: how many workers.
            args: the arguments of every rank, or ``{rank: args}``.
            envs: environment added for every rank, or ``{rank: env}``.
            name: the group's name (default ``group<n>``).
            kwargs: passed on to :func:`aioproc.start_processes`
                (``logs_specs``, ``sinks``, ``grace_period``, ...).

        Raises:
            TypeError, ValueError: a bad ``nprocs``, ``args`` or ``envs``,
                before anything starts.

        Cancellation: the group is closed by the fixture's teardown; a start
        that is cancelled stops what it had launched.
        """
        from ..runner import start_processes

        if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs <= 0:
            raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
        rank_args = _per_rank(args, nprocs, "args")
        rank_envs = _per_rank(envs or {}, nprocs, "envs")
        self._count += 1
        group = start_processes(
            name or f"group{self._count}",
            entrypoint,
            {r: tuple(a) for r, a in rank_args.items()},
            {r: dict(e) for r, e in rank_envs.items()},
            **kwargs,
        )
        return await self._stack.enter_async_context(group)


class PoolFactory:
    """``await aioproc_pool(n_or_cluster_spec, initializer=None, **kwargs)``.

    Opens a pool with :func:`aioproc.open_pool`; every pool it opened is
    closed at the fixture's teardown.
    """

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self._stack = stack

    def __repr__(self) -> str:
        return "<aioproc_pool factory>"

    async def __call__(self, *args: Any, **kwargs: Any) -> WorkerPool:
        """Open a pool; arguments as for :func:`aioproc.open_pool`.

        Cancellation: the pool is closed by the fixture's teardown.
        """
        from ..pool import open_pool

        return await self._stack.enter_async_context(open_pool(*args, **kwargs))


class ClusterFactory:
    """``await aioproc_cluster(fn, cluster_spec, **kwargs)``.

    Starts a :class:`aioproc.cluster.ClusterRunner` and returns it running
    (``join()`` it for the result); every runner it started is stopped at the
    fixture's teardown.
    """

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self._stack = stack

    def __repr__(self) -> str:
        return "<aioproc_cluster factory>"

    async def __call__(self, *args: Any, **kwargs: Any) -> ClusterRunner:
        """Start a cluster; arguments as for ``ClusterRunner``.

        Raises:
            TypeError, ValueError: a bad cluster spec or argument, before
                anything starts.

        Cancellation: a start that is cancelled stops the tasks it launched;
        the runner is otherwise stopped by the fixture's teardown.
        """
        return await self._stack.enter_async_context(ClusterRunner(*args, **kwargs))
