"""``open_placement``: limits applied to processes, with a mechanism chosen per limit.

For each limit the best mechanism the host offers wins: a cgroup v2 group,
else a cgroup v1 controller's group, else an rlimit (memory, processes), else
nothing (a CPU quota has no rlimit); ``Placement.mechanisms`` says which, in
words, so a user who asked for ``cpus=2`` on a laptop learns it was not
enforced.  One placement is one set of groups: the launcher opens one per
rank (``_group.resources``), a persistent worker one of its own.

The launcher's side, in order:

* before spawn: ``placement = open_placement(limits, name)``; a child that
  can enter by itself gets ``placement.child_env()`` in its environment;
* right after spawn, from the parent: ``placement.join(pid)``;
* at a worker's exit: reap with ``os.wait4`` (``usage.reap_with_usage``) and
  ask ``placement.oom_killed()`` when it died by SIGKILL;
* at close, after every process is reaped: ``placement.usage()`` for the
  tree's figures, then ``placement.close()``.

All of it is synchronous: see ``cgroups`` for why that is right for
cgroupfs on the loop's thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType

from . import rlimits
from .cgroups import ACCOUNTING, LIMITED, Group, Hierarchy, Host, discover
from .join import PROCS_ENV, RLIMITS_ENV, encode_rlimits
from .spec import Limits, format_bytes
from .usage import TreeUsage

BACKENDS = ("cgroup2", "cgroup1", "rlimit")
"""Every mechanism, best first."""

# the Limits field each controller serves
_FIELD = {"memory": "memory", "cpu": "cpus", "pids": "pids"}


class Placement:
    """Limits applied to a set of processes; made by ``open_placement``.

    Attributes:
        name: the name given to ``open_placement``.
        limits: the limits applied.
        mechanisms: for each limit set (``"memory"``, ``"cpus"``,
            ``"pids"``), how it is enforced, or ``"not enforced: ..."``.
        unenforced: the limits no mechanism could enforce here.
    """

    def __init__(
        self,
        name: str,
        limits: Limits,
        groups: Iterable[Group],
        rlimit_settings: Mapping[str, int],
        mechanisms: Mapping[str, str],
    ) -> None:
        self.name = name
        self.limits = limits
        self.mechanisms = dict(mechanisms)
        self.unenforced = tuple(k for k, v in self.mechanisms.items() if v.startswith("not "))
        self._groups = list(groups)
        self._rlimits = dict(rlimit_settings)
        self._closed = False
        self._final: tuple[TreeUsage, int | None, int | None] | None = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._groups)} cgroups"
        return f"<Placement {self.name} {self.limits} {state}>"

    def __enter__(self) -> Placement:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def cgroups(self) -> tuple[Path, ...]:
        """The directories of the groups made (empty where only rlimits apply)."""
        return tuple(group.path for group in self._groups)

    def _group_for(self, controller: str) -> Group | None:
        return next((g for g in self._groups if controller in g.controllers), None)

    # ---------------------------------------------------------------- joining

    def join(self, pid: int) -> None:
        """Put a freshly spawned process in the placement, from its parent.

        Call it right after spawn, before anything else happens to the
        child; its own children inherit the placement from then on.  The
        child ran unlimited from spawn to here; where user code must not,
        give the child ``child_env()`` and let it enter by itself.

        Raises:
            RuntimeError: the placement is closed.
            OSError: a cgroup refused the process; a process that has
                already exited (ESRCH) is not an error.
        """
        if self._closed:
            raise RuntimeError(f"placement {self.name} is closed: cannot join pid {pid}")
        try:
            for group in self._groups:
                group.add(pid)
            rlimits.apply(pid, self._rlimits)
        except ProcessLookupError:  # it exited already: nothing left to limit
            pass

    def child_env(self) -> dict[str, str]:
        """Variables that let a child enter the placement by itself (``join.enter``).

        ``AIOPROC_CGROUP_PROCS`` names the ``cgroup.procs`` files the child
        writes its pid into; ``AIOPROC_RLIMITS`` the rlimits it sets.  Empty
        where there is nothing to enter.
        """
        env = {}
        if self._groups:
            env[PROCS_ENV] = os.pathsep.join(str(group.procs_file) for group in self._groups)
        if self._rlimits:
            env[RLIMITS_ENV] = encode_rlimits(self._rlimits)
        return env

    # ---------------------------------------------------------------- reading

    def oom_kills(self) -> int | None:
        """How many processes the kernel's OOM killer killed in the placement so far.

        ``None`` where nothing counts them (no memory cgroup, or a kernel
        that keeps no count).
        """
        if self._final is not None:
            return self._final[1]
        group = self._group_for("memory")
        return None if group is None else group.oom_kills()

    def oom_killed(self, *, inside: bool = False) -> str | None:
        """Why the kernel killed a process here, or None if it did not.

        Args:
            inside: the process asked about did not die of it, but shares
                the placement with those that did (its children): they are
                named instead.

        Returns:
            ``"killed by the kernel's OOM killer: memory limit 2 GiB
            reached"`` once the memory cgroup counted an OOM kill (with
            ``inside``: ``"a process in its cgroup was killed by ..."``).
            A v1 kernel without an ``oom_kill`` count reports the limit
            hits instead (not ``inside``: hits alone name no process).
            Rlimits never kill: a process that passes one gets a failed
            allocation, and this returns None.
        """
        limit = self.limits.memory
        where = f"memory limit {format_bytes(limit)}" if limit else "memory of its cgroup"
        kills = self.oom_kills()
        if kills:
            times = f" ({kills} OOM kills in {self.name})" if kills > 1 else ""
            who = "a process in its cgroup was killed" if inside else "killed"
            return f"{who} by the kernel's OOM killer: {where} reached{times}"
        if inside:
            return None
        group = self._group_for("memory")
        hits = (
            self._final[2]
            if self._final is not None
            else (None if group is None else group.limit_hits())
        )
        if kills is None and hits:
            return (
                f"{where} reached {hits} times (this kernel does not count OOM kills: "
                f"a death by SIGKILL here is most likely its OOM killer)"
            )
        return None

    def usage(self) -> TreeUsage:
        """What the processes of the placement used together, as the cgroups counted.

        The figures include every process that was ever in the placement,
        reaped or not; after ``close()`` they are the last ones read.
        ``None`` fields: nothing counted them (rlimits only, or no
        ``cpuacct``/``memory`` group).
        """
        if self._final is not None:
            return self._final[0]
        cpu, memory = self._group_for(ACCOUNTING), self._group_for("memory")
        return TreeUsage(
            cpu_time=None if cpu is None else cpu.cpu_time(),
            max_memory=None if memory is None else memory.max_memory(),
        )

    # ---------------------------------------------------------------- closing

    def close(self) -> None:
        """Remove every cgroup made; idempotent.

        Call it once the processes are reaped.  A process still inside (a
        daemon that escaped its process group) is moved back to this
        process's own group first, so no directory is ever left behind.
        The figures of ``usage()`` and ``oom_killed()`` are kept.

        Raises:
            OSError: a group could not be removed (the message names it and
                what is still inside); the others are removed all the same.
        """
        if self._closed:
            return
        memory = self._group_for("memory")
        self._final = (
            self.usage(),
            self.oom_kills(),
            None if memory is None else memory.limit_hits(),
        )
        self._closed = True
        remove(self._groups)


def remove(groups: list[Group]) -> None:
    """Remove every group of ``groups`` (emptied as it goes), raising the first failure last."""
    error: OSError | None = None
    while groups:
        try:
            groups[-1].remove()
        except OSError as exc:
            error = error or exc
        groups.pop()
    if error is not None:
        raise error


def open_placement(
    limits: Limits,
    name: str,
    *,
    track_usage: bool = True,
    backends: Iterable[str] = BACKENDS,
    host: Host | None = None,
    before_create: Callable[[Path], None] | None = None,
) -> Placement:
    """Make the cgroups (or rlimit settings) that apply ``limits``, before any process joins.

    Args:
        limits: what to apply.  ``Limits()`` with ``track_usage`` makes
            groups only to count the tree's CPU time and peak memory.
        name: the group or rank, used in the cgroup directory names and in
            messages (``"trainer"``, ``"trainer/3"``).
        track_usage: also make the groups that count CPU time and memory
            where no limit needs them.
        backends: the mechanisms allowed, from ``"cgroup2"``, ``"cgroup1"``
            and ``"rlimit"``; the best one the host offers wins per limit.
        host: the hierarchies to use (``cgroups.discover()`` by default).
        before_create: told the path of each cgroup directory before it is
            made (``Group.create``): a guardian that must remove it after a
            crash knows it first.

    Returns:
        An open placement: close it (or use it as a ``with`` block).

    Raises:
        TypeError: ``limits`` is not a ``Limits``.
        ValueError: ``backends`` names an unknown mechanism.
    """
    if not isinstance(limits, Limits):
        raise TypeError(f"limits must be an aioproc.Limits, got {limits!r}")
    backends = tuple(backends)
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise ValueError(f"unknown backends {unknown}: choose from {list(BACKENDS)}")
    host = discover() if host is None else host
    allowed = {2: "cgroup2" in backends, 1: "cgroup1" in backends}
    candidates = [h for h in host.hierarchies if allowed[h.version]]
    notes = list(host.notes) + [
        f"{h.describe()} at {h.parent}: left out by backends={list(backends)}"
        for h in host.hierarchies
        if not allowed[h.version]
    ]
    wanted = [c for c in LIMITED if getattr(limits, _FIELD[c]) is not None]
    extra = [c for c in ("memory", ACCOUNTING) if track_usage and c not in wanted]
    groups, mechanisms = _build(limits, name, wanted + extra, candidates, notes, before_create)
    why = "; ".join(notes) or "no cgroup hierarchy found"
    settings: dict[str, int] = {}
    for controller in wanted:
        key = _FIELD[controller]
        if key in mechanisms:
            continue
        if controller == "memory" and "rlimit" in backends and limits.memory is not None:
            more, mechanisms[key] = rlimits.memory(limits.memory)
        elif controller == "pids" and "rlimit" in backends and limits.pids is not None:
            more, mechanisms[key] = rlimits.pids(limits.pids)
        else:
            more = {}
            mechanisms[key] = f"not enforced: no cgroup could be made ({why})"
            if controller == "cpu":
                mechanisms[key] += "; rlimits have no CPU quota"
        settings.update(more)
    order = [_FIELD[c] for c in LIMITED]
    mechanisms = {k: mechanisms[k] for k in order if k in mechanisms}
    return Placement(name, limits, groups, settings, mechanisms)


def _build(
    limits: Limits,
    name: str,
    needs: list[str],
    candidates: list[Hierarchy],
    notes: list[str],
    before_create: Callable[[Path], None] | None,
) -> tuple[list[Group], dict[str, str]]:
    """Make the groups for ``needs``; a hierarchy that refuses is dropped and the rest retried.

    Returns:
        The groups made and how each limit they serve is enforced;
        ``candidates`` loses, and ``notes`` explains, every hierarchy that refused.
    """
    while True:
        groups: list[Group] = []
        mechanisms: dict[str, str] = {}
        try:
            for hierarchy, controllers in _choose(needs, candidates).items():
                group = Group.create(hierarchy, controllers, name, before=before_create)
                groups.append(group)
                mechanisms.update(_apply(group, limits))
        except OSError as exc:
            notes.append(f"{hierarchy.describe()} at {hierarchy.parent}: {exc}")
            remove(groups)
            candidates.remove(hierarchy)
            continue
        return groups, mechanisms


def _choose(needs: list[str], candidates: list[Hierarchy]) -> dict[Hierarchy, frozenset[str]]:
    """Which hierarchy serves each controller: the first that offers it.

    CPU accounting rides along with a hierarchy already chosen for a limit
    where one offers it, rather than making a group only for it.
    """
    chosen: dict[Hierarchy, set[str]] = {}
    for controller in needs:
        offering = [h for h in candidates if controller in h.controllers]
        if not offering:
            continue
        pick = next((h for h in offering if h in chosen), offering[0])
        chosen.setdefault(pick, set()).add(controller)
    return {h: frozenset(c) for h, c in chosen.items()}


def _apply(group: Group, limits: Limits) -> dict[str, str]:
    """Write the limits ``group`` serves; return how each is enforced."""
    done = {}
    if "memory" in group.controllers and limits.memory is not None:
        done["memory"] = group.limit_memory(limits.memory)
    if "cpu" in group.controllers and limits.cpus is not None:
        done["cpus"] = group.limit_cpus(limits.cpus)
    if "pids" in group.controllers and limits.pids is not None:
        done["pids"] = group.limit_pids(limits.pids)
    return done
