"""What a recorder's hook costs the launcher, enabled and disabled.

    python benchmarks/bench_metrics.py [--calls N] [--rounds N] [--groups]

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

With ``--groups``, whole groups instead, metrics off against on, rounds
interleaved (ratios of medians; the target is under 1.05x):

- ``P2``: 256 ``/bin/true`` binary workers, start to all done;
- ``P6``: ``close()`` of 64 sleeping binary workers (SIGTERM, exits, reaps);
- ``tee``: 4 workers writing 50k lines each, tee'd to a sink.
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


TEE = (
    "import os\n"
    "chunk = b''.join(b'%08d ' % i + b'x' * 70 + b'\\n' for i in range(1000))\n"
    "for _ in range(50):\n"
    "    os.write(1, chunk)\n"
)


async def _p2() -> None:
    import aioproc

    result = await aioproc.run("/bin/true", 256, logs_specs=aioproc.DefaultLogsSpecs(os.devnull))
    assert not result.is_failed(), result.failures


async def _p6() -> float:
    import asyncio
    import time

    import aioproc

    pc = await aioproc.start_processes(
        "p6", "sleep", {r: ("60",) for r in range(64)}, {r: {} for r in range(64)},
        aioproc.DefaultLogsSpecs(os.devnull),
    )  # fmt: skip
    await asyncio.sleep(0.05)  # every sleep has exec'd: the close is what is timed
    t0 = time.perf_counter()
    await pc.close()
    return time.perf_counter() - t0


async def _tee() -> None:
    import aioproc

    lines = 0

    def count(record: object) -> None:
        nonlocal lines
        lines += 1

    specs = aioproc.DefaultLogsSpecs(os.devnull, tee=aioproc.Std.OUT)
    args = {r: ("-c", TEE) for r in range(4)}
    result = await aioproc.run(sys.executable, 4, args, logs_specs=specs, sinks=[count])
    assert not result.is_failed(), result.failures
    assert lines == 4 * 50_000, lines


def groups(rounds: int) -> None:
    """Each group benchmark with metrics off, then on, ``rounds`` times; medians."""
    import asyncio
    import time

    import aioproc.metrics

    async def timed(case: str) -> float:
        if case == "P6":
            return await _p6()
        t0 = time.perf_counter()
        await (_p2() if case == "P2" else _tee())
        return time.perf_counter() - t0

    cases = ("P2", "P6", "tee")
    figures: dict[tuple[str, bool], list[float]] = {(c, on): [] for c in cases for on in (0, 1)}
    for i in range(rounds + 1):  # the first round warms up
        for case in cases:
            for on in (False, True):
                if on:
                    aioproc.metrics.enable(aioproc.metrics.Recorder())
                try:
                    seconds = asyncio.run(timed(case))
                finally:
                    aioproc.metrics.disable()
                if i:
                    figures[case, on].append(seconds)
    print(f"{rounds} rounds, medians; load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':6} {'off ms':>8} {'on ms':>8} {'on/off':>7}")
    for case in cases:
        off = statistics.median(figures[case, False])
        on = statistics.median(figures[case, True])
        print(f"{case:6} {off * 1e3:8.1f} {on * 1e3:8.1f} {on / off:7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--groups", action="store_true", help="whole groups, metrics off vs on")
    args = parser.parse_args()
    if args.groups:
        groups(args.rounds)
        return

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
