"""A group's resources: its limits (one placement, or one per rank), its CPUs and its slots.

``GroupResources`` checks ``limits=``, ``capacity=`` and ``cpus=`` when the
group is built, so a mistake raises before anything exists.  At start it waits for
the group's slots (``Capacity``: first come, first served, all ranks at
once), then opens the placements and says once, in the log, how each limit
is enforced, warning about any that nothing here could enforce.  Each rank
is joined to its placement, and pinned to its CPUs, from this process before
it runs user code (see ``_proc.spawn``, ``_func.launch`` and ``_func.fork``):
a spawned function worker waits for its boot code, a forked one at its
gate.  A binary runs from its exec, so one with cgroups is started through
a shell that enters them and then execs it (``entries``,
``_limits.join.ENTER_SH``); its rlimits and CPUs are set on the helper
thread microseconds after its exec.  Persistent workers use the same object, as a group of one
(``aioproc.worker``, ``aioproc.pool``).

At a worker's exit it tells whether the kernel's OOM killer ended it and
adds the cgroup's figures to the ``Usage`` its reap reported.  ``close()``
runs once every worker is reaped: the placements are removed, then the
slots given back, so a budget never counts a worker twice.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from .._limits import placement as _placement
from .._limits.affinity import ROUND_ROBIN, allowed_cpus, check_cpu_set, with_affinity
from .._limits.capacity import Capacity
from .._limits.join import PROCS_ENV
from .._limits.placement import Placement, open_placement
from .._limits.spec import Limits, format_bytes
from .._proc import lifeline as _lifeline
from .._proc.spawn import Child
from ..results import Usage

logger = logging.getLogger("aioproc")

BACKENDS: tuple[str, ...] = _placement.BACKENDS
"""The mechanisms a group's limits may use, best first (tests narrow it)."""

LimitsArg = Limits | Mapping[int, Limits] | None
"""``limits=``: one ``Limits`` for the group, ``{local_rank: Limits}``, or none."""


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
        self._group: Placement | None = None  # one placement for every rank
        self._ranks: dict[int, Placement] = {}  # or one per rank
        self._kills_seen: dict[int, int] = {}  # id(placement) -> OOM kills attributed
        # False: how the limits are enforced is logged at DEBUG only (a pool's
        # workers after its first: the same limits, the same mechanisms)
        self.report = True

    def __repr__(self) -> str:
        return f"<GroupResources {self.name} limits={self.limits!r} slots={self._held}>"

    async def acquire(self) -> None:
        """Wait for the group's slots (none without ``capacity``).

        **Cancellation:** a cancelled wait holds nothing (``Capacity.acquire``).
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

    def open(self) -> dict[int, Callable[[int], None]]:
        """Open the placements, log how each limit is enforced; ``{rank: join}``.

        A rank with ``cpus`` is pinned to them by its join too, before it
        enters its placement.

        Raises:
            OSError: a cgroup could not be made; those made are removed.
        """
        joins = self._open_placements()
        for rank, cpus in (self.cpus or {}).items():
            joins[rank] = with_affinity(joins.get(rank), cpus)
        return joins

    def _open_placements(self) -> dict[int, Callable[[int], None]]:
        limits = self.limits
        if not limits:
            return {}  # None, an empty dict, or a Limits() that limits nothing
        try:
            if isinstance(limits, Limits):
                self._group = _guarded(open_placement(limits, self.name, backends=BACKENDS))
                self._report({"": self._group})
                return dict.fromkeys(range(self.nprocs), self._group.join)
            for rank, rank_limits in sorted(limits.items()):
                self._ranks[rank] = _guarded(
                    open_placement(rank_limits, f"{self.name}/{rank}", backends=BACKENDS)
                )
        except BaseException:
            self._close_placements()
            raise
        self._report({f"rank {rank}: ": p for rank, p in self._ranks.items()})
        return {rank: p.join for rank, p in self._ranks.items()}

    def _report(self, placements: Mapping[str, Placement]) -> None:
        """One INFO line for the group; one WARNING naming what nothing enforces."""
        applied: list[str] = []
        missed: list[str] = []
        for who, placement in placements.items():
            for key, how in placement.mechanisms.items():
                value = getattr(placement.limits, key)
                shown = format_bytes(value) if key == "memory" else f"{value:g}"
                line = f"{who}{key} {shown}: {how}"
                (missed if key in placement.unenforced else applied).append(line)
        for lines, level, text in (
            (applied, logging.INFO, "limits for %s: %s"),
            (missed, logging.WARNING, "limits for %s not enforced here: %s"),
        ):
            if lines:
                level = level if self.report else logging.DEBUG
                logger.log(level, text, self.name, "; ".join(lines))

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
        return self._group if self._group is not None else self._ranks.get(rank)

    def oom(self, rank: int, child: Child, code: int) -> str | None:
        """Why the kernel's OOM killer ended ``rank`` (exit ``code``), or None if it did not.

        Only a death by SIGKILL that aioproc did not send counts.  Where the
        ranks share a placement, each OOM kill the cgroup counted is given to
        one such death, in the order they are recorded.
        """
        if code != -signal.SIGKILL or child.forced:
            return None
        placement = self.placement_of(rank)
        if placement is None:
            return None
        kills = placement.oom_kills()
        if kills is None:
            return placement.oom_killed()  # a kernel without a count: the limit's hits
        seen = self._kills_seen.get(id(placement), 0)
        if kills <= seen:
            return None
        self._kills_seen[id(placement)] = seen + 1
        return placement.oom_killed()

    def usage(self, children: Mapping[int, Child]) -> dict[int, Usage]:
        """``{rank: Usage}`` of the reaped workers, with the tree figures of a rank's own cgroup.

        The ranks of a group share its cgroup, and its figures are no one
        rank's, except in a group of one (a persistent worker's).
        """
        out = {}
        for rank, child in sorted(children.items()):
            usage = child.watcher.usage
            if usage is None:
                continue
            own = self._ranks.get(rank)
            if own is None and self.nprocs == 1:
                own = self._group  # a group of one: its cgroup is the rank's own
            if own is not None:
                tree = own.usage()
                usage = replace(usage, tree_cpu_time=tree.cpu_time, tree_max_memory=tree.max_memory)
            out[rank] = usage
        return out

    def close(self) -> None:
        """Remove the placements, then give the slots back; idempotent.

        Call it once every worker is reaped.  A cgroup that cannot be
        removed is logged, never raised: the group's own cleanup goes on.
        """
        self._close_placements()
        if self._held and self.capacity is not None:
            held, self._held = self._held, 0
            self.capacity.release(held)

    def _close_placements(self) -> None:
        placements = [p for p in (self._group, *self._ranks.values()) if p is not None]
        for placement in placements:
            paths = placement.cgroups
            try:
                placement.close()
            except OSError:
                logger.exception("could not remove the cgroups of %s", placement.name)
            for path in paths:
                if not path.exists():
                    _lifeline.forget_cgroup(str(path))


def _guarded(placement: Placement) -> Placement:
    """``placement``, its cgroups made known to the guardian, which removes them
    if this process dies before it does."""
    for path in placement.cgroups:
        _lifeline.remove_cgroup_after_crash(str(path))
    return placement
