"""``Usage``: what one process used, taken from its exit, and what its cgroup counted.

The figures of a rank come from the reap itself: ``os.wait4`` returns the
child's ``struct rusage`` along with its status, so nothing is sampled and
nothing polls (``Usage`` itself lives in ``results``, the
layer below, which reports it).  That rusage covers the child and every descendant the child
itself waited for; a grandchild left unreaped is not in it, which is what
the cgroup's figures (``tree_*``) are for.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ..results import Usage as Usage

if sys.platform != "win32":
    import resource

# ``ru_maxrss`` is in KiB on Linux and the BSDs, in bytes on macOS.
_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024


@dataclass(frozen=True)
class TreeUsage:
    """What a cgroup counted for all its processes: ``None`` where it was not counted."""

    cpu_time: float | None = None
    max_memory: int | None = None


def usage_from_rusage(rusage: resource.struct_rusage, tree: TreeUsage | None = None) -> Usage:
    """Turn the rusage ``os.wait4`` returned for a child into a ``Usage``.

    Args:
        rusage: the third item of ``os.wait4(pid, 0)``.
        tree: the cgroup's figures for the same worker (``Placement.usage()``),
            read before its cgroup is closed.

    Returns:
        The worker's usage, ``max_rss`` in bytes on every platform.
    """
    return Usage(
        cpu_time=rusage.ru_utime + rusage.ru_stime,
        user_time=rusage.ru_utime,
        system_time=rusage.ru_stime,
        max_rss=rusage.ru_maxrss * _MAXRSS_UNIT,
        tree_cpu_time=None if tree is None else tree.cpu_time,
        tree_max_memory=None if tree is None else tree.max_memory,
    )


def own_peak() -> int:
    """This process's peak resident set size in bytes, as ``ru_maxrss`` counts it.

    Linux carries the peak of the process that execs a program into the
    new program's ``ru_maxrss``: a worker started from this process by an
    exec reports at least this process's peak at the time (at most this
    figure, which only grows), however little it used itself.
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _MAXRSS_UNIT


def reap_with_usage(pid: int) -> tuple[int, Usage]:
    """Reap ``pid`` (blocking) and return its exit code and usage.

    The drop-in for ``os.waitpid(pid, 0)`` where the usage is wanted: the
    code follows ``subprocess`` (``-N`` for a death by signal N).
    """
    _, status, rusage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), usage_from_rusage(rusage)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def sample(pid: int) -> Usage | None:
    """What the running process ``pid`` has used so far, from ``/proc``; None if unreadable.

    ``cpu_time`` so far, ``rss`` now and ``max_rss`` the peak since its
    program started (``VmHWM``: unlike ``ru_maxrss``, it does not carry the
    launcher's peak over an exec).  Linux only; a process that has just
    exited (or another system) gives None.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
        # the command name may hold spaces and parentheses: the fields follow its last ')'
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):
            return None  # exited, not reaped yet: its memory is gone, its figures all 0
        # fields 14, 15 and 24 of proc(5) (utime, stime, rss); this list starts at field 3
        user, system = int(fields[11]) / _CLOCK_TICKS, int(fields[12]) / _CLOCK_TICKS
        rss = int(fields[21]) * _PAGE_SIZE
        peak = rss
        for line in status.splitlines():
            if line.startswith(b"VmHWM:"):
                peak = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        return None
    return Usage(user + system, user, system, max(peak, rss), rss=rss)


def sample_all(pids: Mapping[int, int]) -> dict[int, Usage]:
    """``{rank: Usage}`` read from ``/proc`` for the ranks still readable."""
    out = {}
    for rank, pid in pids.items():
        usage = sample(pid)
        if usage is not None:
            out[rank] = usage
    return out
