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


def reap_with_usage(pid: int) -> tuple[int, Usage]:
    """Reap ``pid`` (blocking) and return its exit code and usage.

    The drop-in for ``os.waitpid(pid, 0)`` where the usage is wanted: the
    code follows ``subprocess`` (``-N`` for a death by signal N).
    """
    _, status, rusage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), usage_from_rusage(rusage)
