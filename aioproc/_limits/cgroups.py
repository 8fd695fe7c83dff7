"""The cgroup hierarchies this process may create groups in, and one group's files.

``discover`` reads ``/proc/self/cgroup`` and ``/proc/self/mountinfo`` once
and lists, best first, every hierarchy where this process could make a
child group: cgroup v2 (its own group when that is the root or already
delegates controllers, then the parent of its own group, where systemd's
user slices let a user make siblings), then each mounted cgroup v1
controller, under this process's own group of that controller.  A group is
made under the process's own group, never at the root of a hierarchy it
was not placed at, so a container's or a job scheduler's limits still hold
around it.

Every file here lives in cgroupfs: a read or write is an in-kernel
operation of microseconds that never touches a disk and never blocks on
I/O, so these calls run on the caller's thread (the event loop's, in the
launcher) directly; a hop to the helper thread would cost more than the
write.  Nothing here polls: OOM kills and usage are counters the kernel
keeps, read when someone asks.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .spec import format_bytes

LIMITED = ("memory", "cpu", "pids")
"""The controllers a limit needs."""

ACCOUNTING = "cpuacct"
"""CPU time of a group: v1's cpuacct controller; in v2 every group counts it (``cpu.stat``)."""

CFS_PERIOD_US = 100_000
"""The CFS bandwidth period, in microseconds: the kernel's default, 100 ms."""

PARENT_ENV = "AIOPROC_CGROUP_PARENT"
"""A delegated cgroup v2 directory to make groups in, tried before any other."""

_KNOWN_V1 = frozenset({"memory", "cpu", "cpuacct", "pids"})
# A process that keeps forking while it is moved out of a group is moved
# again; past this many rounds it is a fork bomb the pids limit failed to
# stop, and the group is reported instead of chased forever.
_MOVE_ROUNDS = 64


@dataclass(frozen=True)
class Hierarchy:
    """A place where this process may make cgroups.

    Attributes:
        version: 1 or 2.
        controllers: what a group made here can do: the v1 controllers
            mounted together, or the v2 controllers the parent offers (and
            ``cpuacct``, which every v2 group has).
        parent: the directory new groups are made in.
        home: this process's own group in the hierarchy: where processes
            still in a group when it closes are moved to.
    """

    version: int
    controllers: frozenset[str]
    parent: Path
    home: Path

    def describe(self) -> str:
        """``"cgroup v2"`` or ``"cgroup v1 memory controller"``, for messages."""
        if self.version == 2:
            return "cgroup v2"
        names = sorted(self.controllers)
        return f"cgroup v1 {','.join(names)} controller{'s' if len(names) > 1 else ''}"


@dataclass(frozen=True)
class Host:
    """The hierarchies found, best first, and why others were left out."""

    hierarchies: tuple[Hierarchy, ...] = ()
    notes: tuple[str, ...] = ()


def _unescape(path: str) -> str:
    # mountinfo writes a space as \040, a tab as \011, a newline as \012
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _within(mount_root: str, own: str) -> str | None:
    """``own`` relative to the part of the hierarchy mounted, or None if it is outside it."""
    if mount_root == "/":
        return own.lstrip("/")
    if own == mount_root:
        return ""
    if own.startswith(mount_root + "/"):
        return own[len(mount_root) + 1 :]
    return None


def _read_words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


def discover(
    cgroup_text: str | None = None,
    mountinfo_text: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Host:
    """List the hierarchies this process may make groups in.

    Args:
        cgroup_text: the text of ``/proc/self/cgroup`` (read when None).
        mountinfo_text: the text of ``/proc/self/mountinfo`` (read when None).
        environ: where ``AIOPROC_CGROUP_PARENT`` is looked up (``os.environ``).

    Returns:
        The hierarchies, cgroup v2 ones first; an empty ``Host`` where
        ``/proc`` cannot be read (not Linux).
    """
    try:
        if cgroup_text is None:
            cgroup_text = Path("/proc/self/cgroup").read_text()
        if mountinfo_text is None:
            mountinfo_text = Path("/proc/self/mountinfo").read_text()
    except OSError as exc:
        return Host(notes=(f"no cgroups: cannot read /proc ({exc.strerror})",))
    environ = os.environ if environ is None else environ
    own_v2: str | None = None
    own_v1: dict[frozenset[str], str] = {}
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            own_v2 = parts[2]
        elif parts[1]:
            own_v1[frozenset(parts[1].split(","))] = parts[2]
    v2: list[Hierarchy] = []
    v1: list[Hierarchy] = []
    notes: list[str] = []
    seen_v1: set[frozenset[str]] = set()
    for line in mountinfo_text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, super_fields = left.split(), right.split()
        if not sep or len(fields) < 5 or len(super_fields) < 3:
            continue
        fstype, mount_root, mountpoint = super_fields[0], _unescape(fields[3]), _unescape(fields[4])
        if fstype == "cgroup2" and own_v2 is not None and not v2:
            rel = _within(mount_root, own_v2)
            if rel is None:
                notes.append(f"cgroup v2 at {mountpoint}: this process's group is outside it")
                continue
            v2 = _v2_candidates(Path(mountpoint), Path(mountpoint, rel), environ, notes)
        elif fstype == "cgroup":
            controllers = frozenset(super_fields[2].split(",")) & _KNOWN_V1
            if not controllers or controllers in seen_v1:
                continue
            own = next((path for names, path in own_v1.items() if names & controllers), None)
            rel = None if own is None else _within(mount_root, own)
            home = Path(mountpoint, rel) if rel is not None else None
            what = f"cgroup v1 {','.join(sorted(controllers))} at {mountpoint}"
            if home is None:
                notes.append(f"{what}: this process's group is outside the mount")
            elif not os.access(home, os.W_OK):
                notes.append(f"{what}: {home} is not writable by this process")
            else:
                seen_v1.add(controllers)
                v1.append(Hierarchy(1, controllers, home, home))
    return Host(tuple(v2 + v1), tuple(notes))


def _v2_candidates(
    mountpoint: Path, home: Path, environ: Mapping[str, str], notes: list[str]
) -> list[Hierarchy]:
    """The v2 directories to try, best first: a delegated one, our own group, its parent."""
    places = []
    if environ.get(PARENT_ENV):
        places.append(Path(environ[PARENT_ENV]))
    places.append(home)
    if home != mountpoint:
        # systemd's user slices: a user may make siblings of its own scope
        places.append(home.parent)
    found = []
    for place in places:
        offered = _read_words(place / "cgroup.controllers") & set(LIMITED)
        if place == home and home != mountpoint:
            # A non-root group that holds processes (this one does) cannot
            # give controllers to children: only those already given count.
            offered &= _read_words(place / "cgroup.subtree_control")
        if not offered:
            notes.append(f"cgroup v2 at {place}: offers none of {', '.join(LIMITED)}")
        elif not os.access(place, os.W_OK):
            notes.append(f"cgroup v2 at {place}: not writable by this process")
        else:
            found.append(Hierarchy(2, frozenset(offered | {ACCOUNTING}), place, home))
    return found


class Group:
    """One cgroup directory this process made, in one hierarchy.

    Args:
        hierarchy: where it lives.
        path: its directory.
        controllers: the controllers it is used for.
    """

    def __init__(self, hierarchy: Hierarchy, path: Path, controllers: frozenset[str]) -> None:
        self.hierarchy = hierarchy
        self.path = path
        self.controllers = controllers

    @classmethod
    def create(
        cls,
        hierarchy: Hierarchy,
        controllers: frozenset[str],
        name: str,
        *,
        before: Callable[[Path], None] | None = None,
    ) -> Group:
        """Make a group for ``controllers`` under ``hierarchy.parent``.

        ``before(path)``, if given, is told the new directory's path before
        it is made: whoever must remove it after a crash then knows it
        from its first instant (``_proc.lifeline``'s guardian).

        Raises:
            OSError: the directory cannot be made, or a v2 parent refuses
                to give a controller to its children.
        """
        if hierarchy.version == 2:
            given = _read_words(hierarchy.parent / "cgroup.subtree_control")
            missing = sorted((controllers - given) - {ACCOUNTING})
            if missing:
                # A v2 group only has the files of controllers its parent
                # gives to its children.  The grant stays after close:
                # other groups under the same parent may rely on it.
                _write(
                    hierarchy.parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing)
                )
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]
        path = hierarchy.parent / f"aioproc-{os.getpid()}-{secrets.token_hex(3)}-{safe}"
        if before is not None:
            before(path)
        path.mkdir()
        return cls(hierarchy, path, controllers)

    @property
    def procs_file(self) -> Path:
        """The file a process writes its pid into to enter the group."""
        return self.path / "cgroup.procs"

    def describe(self) -> str:
        """``"cgroup v1 memory controller at /sys/fs/cgroup/memory/..."``."""
        return f"{self.hierarchy.describe()} at {self.path}"

    # ------------------------------------------------------------ limits

    def limit_memory(self, size: int) -> str:
        """Cap memory, RAM and swap together; return how."""
        if self.hierarchy.version == 2:
            _write(self.path / "memory.max", str(size))
            # Swap past the limit would turn a hard cap into a slow crawl.
            swap = self.path / "memory.swap.max"
            if swap.exists():
                _write(swap, "0")
            return f"memory.max={size} ({format_bytes(size)}) via {self.describe()}"
        _write(self.path / "memory.limit_in_bytes", str(size))
        memsw = self.path / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            try:
                _write(memsw, str(size))
            except OSError:  # swap accounting is off: nothing to cap
                pass
        return f"memory.limit_in_bytes={size} ({format_bytes(size)}) via {self.describe()}"

    def limit_cpus(self, cpus: float) -> str:
        """Set a CFS quota of ``cpus`` CPUs per period; return how."""
        quota = max(1000, round(cpus * CFS_PERIOD_US))
        if self.hierarchy.version == 2:
            _write(self.path / "cpu.max", f"{quota} {CFS_PERIOD_US}")
            return f"cpu.max={quota} {CFS_PERIOD_US} ({cpus:g} CPUs) via {self.describe()}"
        _write(self.path / "cpu.cfs_period_us", str(CFS_PERIOD_US))
        _write(self.path / "cpu.cfs_quota_us", str(quota))
        return (
            f"cpu.cfs_quota_us={quota} per cpu.cfs_period_us={CFS_PERIOD_US} ({cpus:g} CPUs) "
            f"via {self.describe()}"
        )

    def limit_pids(self, pids: int) -> str:
        """Cap the number of processes and threads; return how."""
        _write(self.path / "pids.max", str(pids))
        return f"pids.max={pids} via {self.describe()}"

    # ------------------------------------------------------------ counters

    def oom_kills(self) -> int | None:
        """The kernel's count of OOM kills in the group, or None where it keeps none."""
        name = "memory.events" if self.hierarchy.version == 2 else "memory.oom_control"
        return _counter(_read(self.path / name), "oom_kill")

    def limit_hits(self) -> int | None:
        """v1's count of charges refused at the limit (``memory.failcnt``)."""
        text = _read(self.path / "memory.failcnt")
        return int(text) if text and text.strip().isdigit() else None

    def cpu_time(self) -> float | None:
        """CPU seconds of every process that was in the group, or None."""
        if self.hierarchy.version == 2:
            usec = _counter(_read(self.path / "cpu.stat"), "usage_usec")
            return None if usec is None else usec / 1e6
        text = _read(self.path / "cpuacct.usage")
        return int(text) / 1e9 if text and text.strip().isdigit() else None

    def max_memory(self) -> int | None:
        """The group's memory high-water mark in bytes, or None."""
        name = "memory.peak" if self.hierarchy.version == 2 else "memory.max_usage_in_bytes"
        text = _read(self.path / name)
        return int(text) if text and text.strip().isdigit() else None

    # ------------------------------------------------------------ members

    def add(self, pid: int) -> None:
        """Move ``pid`` (and its threads) into the group.

        Raises:
            ProcessLookupError: the process is gone.
            OSError: the kernel refused the move.
        """
        _write(self.procs_file, str(pid))

    def pids(self) -> list[int]:
        """The processes in the group now."""
        text = _read(self.procs_file) or ""
        return [int(word) for word in text.split()]

    def remove(self) -> None:
        """Move any process still inside back to ``home``, then remove the directory.

        Idempotent: a group already gone is fine.

        Raises:
            OSError: the directory still holds processes that could not be
                moved (it is left in place; the message names them).
        """
        if not self.path.exists():
            return
        for _ in range(_MOVE_ROUNDS):
            survivors = self.pids()
            if not survivors:
                break
            for pid in survivors:
                try:
                    _write(self.hierarchy.home / "cgroup.procs", str(pid))
                except ProcessLookupError:  # it exited meanwhile
                    pass
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            raise OSError(
                exc.errno, f"cgroup {self.path} still holds processes {self.pids()}"
            ) from None


def _write(path: Path, value: str) -> None:
    # One write(2) per value: cgroupfs takes a whole value per call, and
    # a buffered writer could split or merge them.
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _counter(text: str | None, key: str) -> int | None:
    """The value of ``key`` in a flat-keyed cgroup file (``oom_kill 3``), or None."""
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None
