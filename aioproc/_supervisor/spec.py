"""``GroupSpec``: every option of one worker group, written out once and checked once.

``start_processes``, ``run``, ``PContext``'s torch-style constructor, the
agent's attempts and the cluster runner's tasks all describe a group with
this one frozen dataclass; the agent and the cluster runner build a base
spec once and derive each attempt's with ``dataclasses.replace``.  A new
group option is a new field here (and a line in ``start_processes``'
documented signature), not an edit of five signatures.

``check()`` runs every check a group's input gets before anything exists,
in one place and one order, and returns the spec with each option in its
one checked form (durations as floats, ranks as dicts of tuples, sinks as
``Sink`` objects, ...).  A checked spec is only read from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .._base.checks import check_duration, check_filters, check_preload
from .._func.barrier import ControlHub
from .._func.boot import check_worker_loop
from .._group.checks import check_interval, check_kwargs, validate_group
from .._group.rank_launcher import ROLE, SinkLike, make_sinks
from .._group.resources import CpusArg, LimitsArg, check_capacity, check_cpus, check_limits
from .._limits.capacity import Capacity
from ..logs import LogsSpecs
from ..results import DEFAULT_GRACE_PERIOD, WorkerEvent

__all__ = ["DEFAULT_GRACE_PERIOD", "GroupSpec"]


@dataclass(frozen=True)
class GroupSpec:
    """One worker group's options (see ``start_processes`` for each one's meaning).

    Beyond ``start_processes``' options, three serve the library's own
    callers: ``hub``/``hub_keys`` (the ``ControlHub`` behind ``barrier()``,
    which the cluster runner shares among its tasks' one-rank groups, keyed
    by task; default: one for this group's ranks) and ``role`` (the role
    the group's metrics carry: the agent's spec's; torch's default role
    otherwise).
    """

    name: str
    entrypoint: Callable[..., Any] | str
    args: Mapping[int, tuple[Any, ...]]
    envs: Mapping[int, Mapping[str, str]]
    logs_specs: LogsSpecs
    log_line_prefixes: Mapping[int, str] | str | None = None
    start_method: str = "spawn"
    grace_period: float = DEFAULT_GRACE_PERIOD
    sinks: Sequence[SinkLike] | None = None
    duplicate_stdout_filters: Sequence[str] | None = None
    duplicate_stderr_filters: Sequence[str] | None = None
    pass_fds: Sequence[int] = ()
    on_event: Callable[[WorkerEvent], None] | None = None
    close_sinks: bool = True
    preload: Sequence[str] = ()
    kwargs: Mapping[int, Mapping[str, Any]] | None = None
    limits: LimitsArg = None
    capacity: Capacity | None = None
    cpus: CpusArg = None
    sample_interval: float | None = None
    worker_loop: str = "asyncio"
    role: str = ROLE
    hub: ControlHub | None = None
    hub_keys: Mapping[int, Hashable] | None = None

    @property
    def nprocs(self) -> int:
        """How many ranks the group has."""
        return len(self.args)

    @property
    def is_function(self) -> bool:
        """True for function workers, False for binaries."""
        return not isinstance(self.entrypoint, str)

    def check(self) -> GroupSpec:
        """Check every option before anything of the group exists.

        Returns:
            This spec with each option in its checked form: ``args`` a
            ``{local_rank: tuple}`` dict, durations floats, ``kwargs`` a dict
            per rank (None for none), ``sinks`` the ``Sink`` objects (a ``ConsoleSink`` for
            ``None``, which the group then closes), the filters, fds and
            preload tuples, ``limits``/``capacity``/``cpus`` resolved.

        Raises:
            TypeError, ValueError, RuntimeError: bad input, named in the
                message (see ``start_processes``); nothing was created.
        """
        grace_period = check_duration("grace_period", self.grace_period)
        sample_interval = check_interval(self.sample_interval)
        worker_loop = check_worker_loop(self.worker_loop)
        validate_group(
            self.name,
            self.entrypoint,
            self.args,
            self.envs,
            self.logs_specs,
            self.log_line_prefixes,
            self.start_method,
        )
        n = len(self.args)
        limits = check_limits(self.limits, n)
        capacity = check_capacity(self.capacity, n)
        cpus = check_cpus(self.cpus, n)
        kwargs = check_kwargs(self.entrypoint, self.args, self.kwargs)
        preload = check_preload(self.start_method, self.preload)
        sinks = tuple(make_sinks(self.sinks))
        stdout_filters = check_filters("duplicate_stdout_filters", self.duplicate_stdout_filters)
        stderr_filters = check_filters("duplicate_stderr_filters", self.duplicate_stderr_filters)
        pass_fds = self.pass_fds
        if isinstance(pass_fds, (str, bytes)) or not all(
            isinstance(fd, int) and fd >= 0 for fd in pass_fds
        ):
            raise TypeError(f"pass_fds must be a sequence of fds, got {pass_fds!r}")
        return replace(
            self,
            args={r: tuple(self.args[r]) for r in range(n)},
            grace_period=float(grace_period),
            sinks=sinks,
            duplicate_stdout_filters=stdout_filters,
            duplicate_stderr_filters=stderr_filters,
            pass_fds=tuple(pass_fds),
            # sinks the group made itself are its own to close
            close_sinks=self.close_sinks or self.sinks is None,
            preload=preload,
            kwargs=kwargs or None,  # None, not {}: a checked spec passes its check again
            limits=limits,
            capacity=capacity,
            cpus=cpus,
            sample_interval=sample_interval,
            worker_loop=worker_loop,
            hub_keys=dict(self.hub_keys or {}),
        )
