"""What a recorder's hook costs the launcher, enabled and disabled.

    python benchmarks/bench_metrics.py [--calls N] [--rounds N]

Each case is one statement the launcher would run per event, timed over
``--calls`` executions by ``timeit``; the cost of the bare loop (``pass``)
is subtracted, so a figure is nanoseconds per statement.  Cases run
interleaved, round after round, and each figure is the median over rounds;
the ratio column divides it by the median cost of calling an empty function
with the same arguments, measured in the same rounds, so the figures carry
from one machine to another.

- ``empty function call``: the unit, ``empty(group, role, stream, 3, 120)``.
- ``disabled, guarded``: what the launcher pays while metrics are off:
  ``if rec.enabled: rec.output(...)`` on the default ``NullRecorder``.
- ``disabled, unguarded``: calling the no-op hook without the check.
- ``enabled ...``: the guarded hook on a ``Recorder``: ``output`` (two
  counters), ``worker_exited`` (a gauge and a counter), ``pool_call`` (a
  counter and a histogram), and ``output`` with a ``group_label`` mapping.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import timeit

# run as a script: measure this checkout's aioproc, not an installed one
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aioproc._metrics import hooks
from aioproc.metrics import Recorder


def empty(group: str, role: str, stream: str, lines: int, nbytes: int) -> None:
    """The unit every figure is divided by."""


OUTPUT = 'rec.output(g, r, "stdout", 3, 120)'
CASES = {
    "empty function call": ("empty(g, r, 'stdout', 3, 120)", None),
    "disabled, guarded": (f"if rec.enabled: {OUTPUT}", hooks.DEFAULT),
    "disabled, unguarded": (OUTPUT, hooks.DEFAULT),
    "enabled output": (f"if rec.enabled: {OUTPUT}", Recorder()),
    "enabled worker_exited": ('if rec.enabled: rec.worker_exited(g, r, "failed")', Recorder()),
    "enabled pool_call": ('if rec.enabled: rec.pool_call(g, "succeeded", 0.003)', Recorder()),
    "enabled output, group_label": (
        f"if rec.enabled: {OUTPUT}",
        Recorder(group_label=lambda name: name.rsplit("-", 1)[0]),
    ),
}


def measure(stmt: str, rec: hooks.NullRecorder | None, calls: int) -> float:
    """Nanoseconds per execution of ``stmt``, the bare loop's cost taken off."""
    names = {"empty": empty, "rec": rec, "g": "train-7", "r": "default"}
    loop = timeit.Timer("pass", globals=names).timeit(calls)
    total = timeit.Timer(stmt, globals=names).timeit(calls)
    return (total - loop) / calls * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()

    for stmt, rec in CASES.values():  # warm up: caches, the series' first insert
        measure(stmt, rec, 1000)
    figures: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.rounds):
        for name, (stmt, rec) in CASES.items():
            figures[name].append(measure(stmt, rec, args.calls))

    unit = statistics.median(figures["empty function call"])
    python = f"{sys.implementation.name} {sys.version.split()[0]}"
    print(f"{python}, {args.calls} calls x {args.rounds} rounds, medians")
    print(f"{'case':32} {'ns/call':>8} {'x empty call':>13}")
    for name, values in figures.items():
        ns = statistics.median(values)
        print(f"{name:32} {ns:8.1f} {ns / unit:13.2f}")


if __name__ == "__main__":
    main()
