"""The fallback where no cgroup can be made: per-process rlimits.

Rlimits are weaker than cgroups in four ways, each said in the mechanism
string a placement reports:

* they hold per process, not for the tree: a worker and each of its
  children may each use the memory limit;
* memory is capped with ``RLIMIT_DATA`` on Linux (the heap and private
  mappings, which is what a process allocates; ``RLIMIT_AS`` would also
  count reserved address space, which runtimes such as CUDA's reserve by
  the terabyte) and ``RLIMIT_AS`` elsewhere.  An allocation past it fails
  in the process that makes it (Python raises ``MemoryError``); no OOM
  kill happens, and none is reported;
* ``RLIMIT_NPROC`` counts every process and thread of the user, wherever
  they run, not just the worker's tree: the worker may not fork once the
  user owns that many, and root ignores it;
* there is no CPU quota among rlimits (``RLIMIT_CPU`` kills after a total
  of CPU seconds, a different thing), so ``cpus`` is not enforced.
"""

from __future__ import annotations

import os
import sys

from .join import set_rlimits

if sys.platform != "win32":
    import resource

MEMORY_RLIMIT = "DATA" if sys.platform.startswith("linux") else "AS"


def memory(size: int) -> tuple[dict[str, int], str]:
    """The rlimit for a memory limit of ``size`` bytes, and how it is applied."""
    return {MEMORY_RLIMIT: size}, (
        f"RLIMIT_{MEMORY_RLIMIT}={size} per process (an allocation past it fails in that "
        f"process; not a limit on the tree, and no OOM kill)"
    )


def pids(count: int) -> tuple[dict[str, int], str]:
    """The rlimit for a process limit, and how it is applied."""
    uid = os.getuid()
    note = "; root ignores it" if uid == 0 else ""
    return {"NPROC": count}, (
        f"RLIMIT_NPROC={count} (counts every process and thread of uid {uid}, not just this "
        f"tree: a fork fails once the user owns {count}{note})"
    )


def apply(pid: int, settings: dict[str, int]) -> None:
    """Set ``settings`` on the running process ``pid`` (Linux's prlimit).

    Where prlimit does not exist, nothing is set here: the child sets them
    on itself from ``child_env()``.

    Raises:
        ProcessLookupError: the process is gone.
    """
    if settings and hasattr(resource, "prlimit"):
        set_rlimits(settings, pid)
