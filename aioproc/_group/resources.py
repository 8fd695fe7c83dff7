"""A group's resources: its limits (a placement per rank), its CPUs and its slots.

``GroupResources`` checks ``limits=``, ``capacity=`` and ``cpus=`` when the
group is built, so a mistake raises before anything exists.  One ``Limits``
is each rank's own, as ``aioproc run --memory-limit`` gives it (and as a
container per rank would): every rank gets a placement of its own, a cgroup
where the host allows; ``{local_rank: Limits}`` names the ranks.  At start
it waits for the group's slots (``Capacity``: first come, first served, all
ranks at once), then opens the placements and says once, in the log, how
each limit is enforced, warning about any that nothing here could enforce.
Each rank is joined to its placement, and pinned to its CPUs, from this
process before it runs user code (see ``_proc.spawn``, ``_func.launch`` and
``_func.fork``): a spawned function worker waits for its boot code, a forked
one at its gate.  A binary runs from its exec, so one with cgroups is
started through a shell that enters them and then execs it (``entries``,
``_limits.join.ENTER_SH``); its rlimits and CPUs are set on the helper
thread microseconds after its exec.  Persistent workers use the same
object, as a group of one (``aioproc.worker``, ``aioproc.pool``).

No cgroup outlives this process: the guardian (``_proc.lifeline``) is told
of each one before it is made, and kept until it is removed, so a SIGKILL
at any moment leaves it to the guardian to remove.

At a worker's exit it tells whether the kernel's OOM killer ended it, or a
process of its cgroup, and adds the cgroup's figures to the ``Usage`` its
reap reported.  ``close()`` runs once every worker is reaped: the
placements are removed, then the slots given back, so a budget never
counts a worker twice.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from .._limits import placement as _placement
from .._limits.affinity import ROUND_ROBIN, allowed_cpus, check_cpu_set, with_affinity
from .._limits.capacity import Capacity
from .._limits.join import PROCS_ENV
from .._limits.placement import Placement, open_placement
from .._limits.spec import Limits, format_bytes
from .._limits.usage import own_peak
from .._proc import lifeline as _lifeline
from .._proc.spawn import Child
from ..results import Usage

logger = logging.getLogger("aioproc")

BACKENDS: tuple[str, ...] = _placement.BACKENDS
"""The mechanisms a group's limits may use, best first (tests narrow it)."""

LimitsArg = Limits | Mapping[int, Limits] | None
"""``limits=``: one ``Limits`` for each rank, ``{local_rank: Limits}``, or none."""


def check_limits(limits: object, nprocs: int) -> Limits | dict[int, Limits] | None:
    """``limits=`` checked: a ``Limits``, a ``{local_rank: Limits}`` dict, or None.

    Raises:
        TypeError: not a ``Limits`` nor a mapping of them; a key is not an int.
        ValueError: a key is not a local rank of the group (``0..nprocs-1``).
    """
    if limits is None or isinstance(limits, Limits):
        return limits
    if not isinstance(limits, Mapping):
        raise TypeError(
            f"limits must be an aioproc.Limits or a {{local_rank: Limits}} dict, got {limits!r}"
        )
    checked: dict[int, Limits] = {}
    for rank, value in limits.items():
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"limits: keys must be local ranks (ints), got {rank!r}")
        if not 0 <= rank < nprocs:
            raise ValueError(
                f"limits: local rank {rank} is not in the group (ranks 0..{nprocs - 1})"
            )
        if not isinstance(value, Limits):
            raise TypeError(f"limits[{rank}] must be an aioproc.Limits, got {value!r}")
        checked[rank] = value
    return checked


CpusArg = Sequence[int] | str | Mapping[int, Sequence[int] | str] | None
"""``cpus=``: CPU ids for every rank, ``"numa:<node>"``, ``"round-robin"``, or per rank."""


def check_cpus(cpus: object, nprocs: int) -> dict[int, tuple[int, ...]] | None:
    """``cpus=`` checked and resolved: ``{local_rank: CPU ids}``, or None.

    A list of CPU ids (or ``"numa:<node>"``) is every rank's set;
    ``{local_rank: list}`` gives the ranks named their own (the others run
    where this process may); ``"round-robin"`` gives rank ``r`` the
    ``r % n``-th CPU of this process's ``n`` allowed ones.

    Raises:
        TypeError: not a list, a string or a mapping of them; a key or a
            CPU id is not an int.
        ValueError: an empty list, a CPU outside ``os.sched_getaffinity(0)``,
            a NUMA node this machine does not list, or a key that is not a
            local rank of the group.
    """
    if cpus is None:
        return None
    allowed = allowed_cpus()
    if cpus == ROUND_ROBIN:
        return {rank: (allowed[rank % len(allowed)],) for rank in range(nprocs)}
    if not isinstance(cpus, Mapping):
        one = check_cpu_set(cpus, "cpus", allowed)
        return dict.fromkeys(range(nprocs), one)
    checked: dict[int, tuple[int, ...]] = {}
    for rank, value in cpus.items():
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"cpus: keys must be local ranks (ints), got {rank!r}")
        if not 0 <= rank < nprocs:
            raise ValueError(f"cpus: local rank {rank} is not in the group (ranks 0..{nprocs - 1})")
        if value == ROUND_ROBIN:
            raise ValueError(f"cpus[{rank}]={ROUND_ROBIN!r}: round-robin is for the whole group")
        checked[rank] = check_cpu_set(value, f"cpus[{rank}]", allowed)
    return checked


def check_worker_limits(limits: object) -> Limits | None:
    """``limits=`` of persistent workers: one ``Limits``, each worker getting its own placement.

    Raises:
        TypeError: not a ``Limits``.
    """
    if limits is None or isinstance(limits, Limits):
        return limits
    raise TypeError(f"limits must be an aioproc.Limits (each worker gets its own), got {limits!r}")


def check_capacity(capacity: object, nprocs: int) -> Capacity | None:
    """``capacity=`` checked: a ``Capacity`` that can ever hold the group, or None.

    Raises:
        TypeError: not a ``Capacity``.
        ValueError: the group has more ranks than the budget has slots.
    """
    if capacity is None:
        return None
    if not isinstance(capacity, Capacity):
        raise TypeError(f"capacity must be an aioproc.Capacity, got {capacity!r}")
    if nprocs > capacity.total:
        raise ValueError(
            f"a group of {nprocs} workers never fits in {capacity!r}: it has {capacity.total} slots"
        )
    return capacity


class GroupResources:
    """The limits and process slots of one group (see the module docstring).

    Args:
        name: the group's name, in messages and cgroup names.
        nprocs: how many ranks the group has.
        limits: as ``start_processes(limits=...)``.
        capacity: as ``start_processes(capacity=...)``.
        cpus: as ``start_processes(cpus=...)``.

    Raises:
        TypeError, ValueError: a bad ``limits``, ``capacity`` or ``cpus``
            (see the checks).
    """

    def __init__(
        self, name: str, nprocs: int, limits: object, capacity: object, cpus: object = None
    ) -> None:
        self.name = name
        self.nprocs = nprocs
        self.limits = check_limits(limits, nprocs)
        self.capacity = check_capacity(capacity, nprocs)
        self.cpus = check_cpus(cpus, nprocs)
        self._held = 0  # slots taken from ``capacity``
        self._ranks: dict[int, Placement] = {}  # a placement per rank with limits
        # cgroup paths told to the guardian (made or not), and whether this
        # group holds the guardian for them (see _announce)
        self._announced: list[str] = []
        self._holding = False
        # False: how the limits are enforced is logged at DEBUG only (a pool's
        # workers after its first: the same limits, the same mechanisms)
        self.report = True

    def __repr__(self) -> str:
        return f"<GroupResources {self.name} limits={self.limits!r} slots={self._held}>"

    async def acquire(self) -> None:
        """Wait for the group's slots (none without ``capacity``).

        Cancellation: a cancelled wait holds nothing (``Capacity.acquire``).
        """
        if self.capacity is not None and not self._held:
            await self.capacity.acquire(self.nprocs)
            self._held = self.nprocs

    def granted(self) -> None:
        """Take over slots the caller acquired for this group; ``close()`` gives them back.

        A pool reserves all its first workers' slots at once (so two pools
        opening together cannot each hold half of what they need), then
        hands one to each worker.
        """
        if self.capacity is not None:
            self._held = self.nprocs

    def per_rank(self) -> dict[int, Limits]:
        """``{rank: Limits}`` of the ranks that get a placement.

        One ``Limits`` is every rank's own (a cgroup each, as the CLI's
        ``--memory-limit``), unless it limits nothing; ``{rank: Limits}``
        names the ranks, ``Limits()`` among them for the figures alone.
        """
        limits = self.limits
        if isinstance(limits, Limits):
            return dict.fromkeys(range(self.nprocs), limits) if limits else {}
        return dict(limits or {})

    def open(self) -> dict[int, Callable[[int], None]]:
        """Open the placements, log how each limit is enforced; ``{rank: join}``.

        A rank with ``cpus`` is pinned to them by its join too, before it
        enters its placement.  Must be called on the loop (the guardian is
        started here if a cgroup is to be made).

        Raises:
            OSError: a cgroup could not be made; those made are removed.
        """
        joins = self._open_placements()
        for rank, cpus in (self.cpus or {}).items():
            joins[rank] = with_affinity(joins.get(rank), cpus)
        return joins

    def _open_placements(self) -> dict[int, Callable[[int], None]]:
        wanted = self.per_rank()
        if not wanted:
            return {}
        # a group of one given one Limits (a persistent worker) is named as the group
        alone = self.nprocs == 1 and isinstance(self.limits, Limits)
        try:
            for rank, rank_limits in sorted(wanted.items()):
                self._ranks[rank] = open_placement(
                    rank_limits,
                    self.name if alone else f"{self.name}/{rank}",
                    backends=BACKENDS,
                    before_create=self._announce,
                )
        except BaseException:
            self._close_placements()
            raise
        self._report()
        return {rank: p.join for rank, p in self._ranks.items()}

    def _announce(self, path: Path) -> None:
        """Tell the guardian of a cgroup about to be made, holding it until ``close()``.

        The guardian removes every cgroup it knows when this process dies:
        told before the directory exists, and kept running (not dismissed
        when its last worker group is forgotten) until the directory is
        gone, it leaves none behind whatever the moment of the death.
        """
        if not self._holding:
            _lifeline.hold()
            self._holding = True
        self._announced.append(str(path))
        _lifeline.remove_cgroup_after_crash(str(path))

    def _report(self) -> None:
        """One INFO line for the group; one WARNING naming what nothing enforces.

        Ranks whose limits are enforced alike (the usual case: one
        ``Limits`` for every rank) are said once, with the first one's
        cgroups as the example.
        """
        placements = self._ranks
        if len(placements) == 1 and self.nprocs == 1:
            shown: dict[str, Placement] = {"": next(iter(placements.values()))}
        elif len(placements) > 1 and len({_shape(p) for p in placements.values()}) == 1:
            first = min(placements)
            shown = {f"each rank (rank {first}'s): ": placements[first]}
        else:
            shown = {f"rank {rank}: ": p for rank, p in sorted(placements.items())}
        applied: list[str] = []
        missed: list[str] = []
        for who, placement in shown.items():
            for key, how in placement.mechanisms.items():
                value = getattr(placement.limits, key)
                text = format_bytes(value) if key == "memory" else f"{value:g}"
                line = f"{who}{key} {text}: {how}"
                (missed if key in placement.unenforced else applied).append(line)
        for lines, level, msg in (
            (applied, logging.INFO, "limits for %s: %s"),
            (missed, logging.WARNING, "limits for %s not enforced here: %s"),
        ):
            if lines:
                level = level if self.report else logging.DEBUG
                logger.log(level, msg, self.name, "; ".join(lines))

    def entries(self) -> dict[int, dict[str, str]]:
        """``{rank: variables}``: what a binary rank needs to enter its cgroups by itself.

        A binary runs from its exec, before the parent's ``join`` lands: it
        is started through ``_limits.join.ENTER_SH`` with these variables
        (the ranks of placements without cgroups need nothing).
        """
        out = {}
        for rank in range(self.nprocs):
            placement = self.placement_of(rank)
            if placement is not None and placement.cgroups:
                env = placement.child_env()
                out[rank] = {PROCS_ENV: env[PROCS_ENV]}
        return out

    def placement_of(self, rank: int) -> Placement | None:
        """The placement ``rank`` is in, if any."""
        return self._ranks.get(rank)

    def oom(self, rank: int, child: Child, code: int) -> str | None:
        """Why ``rank`` (exit ``code``) failed with an OOM kill in its cgroup, or None.

        The rank's own cgroup counts every OOM kill among its processes:
        the rank itself, dead by a SIGKILL that aioproc did not send, is
        named as killed by the OOM killer; a rank that ended otherwise
        (an exit status, a signal of aioproc's) after the OOM killer took a
        process of its cgroup (its child) names that kill.  A SIGKILL
        aioproc sent is never taken for an OOM kill.
        """
        placement = self.placement_of(rank)
        if placement is None:
            return None
        killed_itself = code == -signal.SIGKILL and not child.forced
        if killed_itself:
            return placement.oom_killed()
        return placement.oom_killed(inside=True)

    def usage(self, children: Mapping[int, Child]) -> dict[int, Usage]:
        """``{rank: Usage}`` of the reaped workers, with the figures of each rank's own cgroup.

        A worker started by an exec carries the peak of the process that
        started it (this one) in its ``ru_maxrss``: where the figure does
        not rise above this process's own peak, it cannot be told from
        ours, and a rank with a memory cgroup of its own takes that
        cgroup's peak as its ``max_rss`` (see ``aioproc.Usage``).
        """
        out = {}
        ours: int | None = None
        for rank, child in sorted(children.items()):
            usage = child.watcher.usage
            if usage is None:
                continue
            own = self._ranks.get(rank)
            if own is not None:
                tree = own.usage()
                usage = replace(usage, tree_cpu_time=tree.cpu_time, tree_max_memory=tree.max_memory)
                if tree.max_memory is not None and child.execed:
                    ours = own_peak() if ours is None else ours
                    if usage.max_rss <= ours:
                        usage = replace(usage, max_rss=min(usage.max_rss, tree.max_memory))
            out[rank] = usage
        return out

    def close(self) -> None:
        """Remove the placements, then give the slots back; idempotent.

        Call it once every worker is reaped, then ``lifeline.settle()`` (or
        use ``aclose``): the guardian held for the cgroups is let go here.
        A cgroup that cannot be removed is logged, never raised: the
        group's own cleanup goes on.
        """
        self._close_placements()
        if self._held and self.capacity is not None:
            held, self._held = self._held, 0
            self.capacity.release(held)

    async def aclose(self) -> None:
        """``close()``, then wait until a guardian it dismissed has exited.

        Cancellation: bounded (``lifeline.settle``); callers run it shielded.
        """
        self.close()
        await _lifeline.settle()

    def _close_placements(self) -> None:
        # closed placements stay: they keep their last figures for usage() and oom()
        for placement in self._ranks.values():
            try:
                placement.close()
            except OSError:
                logger.exception("could not remove the cgroups of %s", placement.name)
        announced, self._announced = self._announced, []
        for path in announced:
            if not os.path.exists(path):
                _lifeline.forget_cgroup(path)
        if self._holding:
            self._holding = False
            _lifeline.unhold()


def _shape(placement: Placement) -> tuple[object, ...]:
    """How ``placement`` enforces what, its own cgroups' paths left out: alike or not."""
    how = dict(placement.mechanisms)
    for path in placement.cgroups:
        how = {key: text.replace(str(path), "") for key, text in how.items()}
    return (placement.limits, tuple(sorted(how.items())), placement.unenforced)
