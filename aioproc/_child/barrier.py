"""``barrier()``: the worker's side of its group's barrier (the hub: ``aioproc._func.barrier``).

The worker sends ARRIVE on its control channel and blocks until RELEASE
comes, in ``main.barrier_wait``; this module only finds the booted
``main`` (registered under its name when the worker started) without
importing anything else.
"""

from __future__ import annotations

import sys
from typing import Any


def barrier() -> None:
    """Wait inside a worker until every worker of its group called ``barrier()``.

    The group is the cluster run (all the tasks of its cluster spec) or the
    ``run``/``start_processes`` group (all its ranks).  Reusable: the n-th
    call of every worker meets the n-th call of the others.

    Raises:
        ValueError: called outside a function worker started by aioproc
            (in the supervisor, or in a persistent/pool worker), as TF's
            ``multi_process_runner`` raises there, with TF's words.
        threading.BrokenBarrierError: a worker of the group ended without
            reaching the barrier; the message names it.
    """
    boot: Any = sys.modules.get("aioproc._child.boot")
    if boot is None:
        from . import boot
    if boot._ONE_SHOT_FD is None:
        raise ValueError(
            "barrier is not defined. It is likely because you are calling barrier() in the "
            "main process. barrier() can only be called in the subprocesses: the function "
            "workers aioproc starts (cluster.run, ClusterRunner, run or start_processes)."
        )
    boot.barrier_wait()
