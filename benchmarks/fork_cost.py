"""Where a forked worker's time goes: a bare fork of a preloaded process, before
and after the template's huge-page collapse.

Imports the modules named (default: torch), freezes the collector as the
forkserver template does, then times ``N`` bare ``os.fork()`` + ``os._exit(0)``
from this process, as every forked worker begins and ends; then collapses the
anonymous memory exactly as the template does (``_child.template._collapse``)
and times them again.  Per fork: the parent's CPU (the page-table copy, what
the template pays), the child's CPU (its at-fork hooks, and the teardown of
its page tables at exit), and how much anonymous memory is mapped by 4 KiB
entries (one each to copy) or by 2 MiB ones.  Medians of ``--rounds`` rounds
(the memory columns: after them; the parent's own writes between forks split
a few huge pages back).

Usage::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        python benchmarks/fork_cost.py [--rounds 5] [MODULE ...]

Linux only.  Run in the torch venv for the P1t figures in ``RESULTS.md``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
N = 16


def _status(key: str) -> int:
    """A ``kB`` figure of ``/proc/self/status`` (``RssAnon``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def forks(rounds: int) -> tuple[float, float, float]:
    """Median per fork over ``rounds`` rounds of ``N``: parent CPU, child CPU, wall (ms)."""
    parent, child, wall = [], [], []
    for _ in range(rounds):
        p0, c0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        pids = []
        for _ in range(N):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            pids.append(pid)
        t1 = time.perf_counter()
        for pid in pids:
            os.waitpid(pid, 0)
        parent.append((_cpu(resource.RUSAGE_SELF) - p0) / N)
        child.append((_cpu(resource.RUSAGE_CHILDREN) - c0) / N)
        wall.append((t1 - t0) / N)
    return tuple(statistics.median(x) * 1e3 for x in (parent, child, wall))  # type: ignore[return-value]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("modules", nargs="*", default=["torch"])
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(HERE))  # the aioproc checkout
    from aioproc._child import template as _template_child

    for name in args.modules:
        importlib.import_module(name)
    gc.freeze()
    print(f"preload {args.modules}: {N} x os.fork() + os._exit(0), {args.rounds} rounds, medians")
    print("| memory | anon | in 2 MiB pages | 4 KiB entries | parent CPU/fork | child CPU | wall |")
    print("|---|---|---|---|---|---|---|")

    def row(what: str) -> None:
        parent, child, wall = forks(args.rounds)
        anon, huge = _status("RssAnon"), _huge_kb()
        print(
            f"| {what} | {anon / 1024:.0f} MiB | {huge / 1024:.0f} MiB | {(anon - huge) // 4} | "
            f"{parent:.2f} ms | {child:.2f} ms | {wall:.2f} ms |"
        )

    row("4 KiB pages (before)")
    t0 = time.perf_counter()
    done = _template_child._collapse()
    took = time.perf_counter() - t0
    row("collapsed (as the template)")
    print(f"\ncollapse: {done >> 20} MiB in {took * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
