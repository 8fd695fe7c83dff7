"""This process's children, as the kernel lists them thread by thread (Linux).

One reader for the leak check (what a test left running) and for the
template's sweep (what a dead template forked), so that both see every
child even while threads come and go.
"""

from __future__ import annotations

import os

SCANS = 20
"""Scans of the threads' children at most, when threads keep coming and going."""


def child_pids() -> set[int]:
    """Direct children of this process (of any thread), running or zombie.

    Each thread lists the children it started.  A thread that exits during
    the scan hands its children to another thread, perhaps one already
    read (aioproc's helper thread exits once idle, right after a start):
    the scan is then repeated, until no thread came or went during one
    (at most ``SCANS`` times).  Empty where there is no ``/proc``.
    """
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return set()
    pids: set[int] = set()
    for _ in range(SCANS):
        pids = set()
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/children") as f:
                    pids.update(int(p) for p in f.read().split())
            except FileNotFoundError:  # the thread just exited: scan again
                continue
        again = os.listdir("/proc/self/task")
        if again == tids:
            break
        tids = again
    return pids
