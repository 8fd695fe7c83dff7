"""PC: coroutine calls in persistent workers: latency and fan-out.

    python benchmarks/bench_coro.py [--quick] [--loop asyncio|uvloop|both] [--rounds N]

Two figures, per supervisor loop (the workers run asyncio's loop):

- latency: the median time of one ``await w.call(async_noop)`` against one
  ``await w.call(noop)`` on the same worker, whose loop is running (it ran
  a coroutine call first), blocks of the two alternating so that drift in
  the machine's load reaches both alike (target: 1.3x); measured again with
  the supervisor and a new worker on one CPU (where ``sched_setaffinity``
  exists), the placement in which the worker's extra steps count fully.
- fan-out: ``FANOUT_CALLS`` concurrent ``asyncio.sleep(FANOUT_SLEEP)`` calls
  across a pool of ``FANOUT_WORKERS`` workers with ``max_concurrency``
  ``FANOUT_CONCURRENCY``, from the first submit to the last result, against
  the ideal ``FANOUT_SLEEP * ceil(calls / (workers * concurrency))`` (target:
  under 2x of it); and the same work on aiomultiprocess's ``Pool`` with as
  many processes and ``childconcurrency``, measured in the same round (a row
  of its own, skipped with a note where aiomultiprocess is not installed; it
  is no dependency of aioproc).

Every pool is started and has run a batch of calls before any clock starts.
aiomultiprocess starts its children with ``multiprocessing``'s spawn, which
leaves a resource-tracker process behind (``run_all`` runs this after the
leak benchmark), and a Manager server it keeps for good (stopped after each
round here).

For ``run_all``: ``coro_rows(cfg) -> list[Row]``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import statistics
import sys
import time
from typing import Any

# run as a script: measure this checkout's aioproc (as run_all does), not an installed one
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _util
import _workers
from _util import Config, Row, Sample, Series, Target, rows_from, run_on

import aioproc

NOOP = int  # the sync no-op of the persistent-worker benchmarks
LATENCY_TARGET = Target("ratio", 1.3)
LATENCY_BLOCKS = 10
FANOUT_CALLS = 1000
FANOUT_SLEEP = 0.1
FANOUT_WORKERS = 2
FANOUT_CONCURRENCY = 100
FANOUT_IDEAL = FANOUT_SLEEP * math.ceil(FANOUT_CALLS / (FANOUT_WORKERS * FANOUT_CONCURRENCY))
FANOUT_TARGET = Target("ratio", 2.0)


def aiomultiprocess_available() -> bool:
    return importlib.util.find_spec("aiomultiprocess") is not None


async def latency(w: aioproc.WorkerProcess, n: int) -> tuple[float, float]:
    """Median seconds of one sequential call: (sync no-op, coroutine no-op), same worker."""
    times: dict[Any, list[float]] = {NOOP: [], _workers.async_noop: []}
    block = max(1, n // LATENCY_BLOCKS)
    for _ in range(LATENCY_BLOCKS):
        for fn, out in times.items():
            for _ in range(block):
                t0 = time.perf_counter()
                await w.call(fn)
                out.append(time.perf_counter() - t0)
    return statistics.median(times[NOOP]), statistics.median(times[_workers.async_noop])


async def latency_on_one_cpu(n: int) -> tuple[float, float]:
    """``latency`` with the supervisor and the worker on one CPU (the worker inherits it).

    Where the scheduler places them together (a loaded machine does), each
    call's time is the sum of both processes' work, nothing of it hidden by
    the other CPU: the worst placement for a coroutine call's extra steps.
    """
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        async with aioproc.open_worker(name="bench-coro-one-cpu") as w:
            for _ in range(20):
                await w.call(_workers.async_noop)
                await w.call(NOOP)
            return await latency(w, n)
    finally:
        os.sched_setaffinity(0, cpus)


async def fanout(submit: Any) -> float:
    """Seconds from submitting every sleep to the last result."""
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(submit(_workers.async_sleep, FANOUT_SLEEP) for _ in range(FANOUT_CALLS))
    )
    dt = time.perf_counter() - t0
    if results != [FANOUT_SLEEP] * FANOUT_CALLS:
        raise AssertionError(f"wrong results: {sorted(set(results))[:5]}")
    return dt


async def aioproc_fanout() -> float:
    async with aioproc.open_pool(FANOUT_WORKERS, max_concurrency=FANOUT_CONCURRENCY) as pool:
        await fanout(pool.submit)  # warm: every worker runs its loop
        return await fanout(pool.submit)


async def aiomultiprocess_fanout() -> float:
    import aiomultiprocess
    import aiomultiprocess.core

    try:
        async with aiomultiprocess.Pool(
            processes=FANOUT_WORKERS, childconcurrency=FANOUT_CONCURRENCY
        ) as pool:

            def submit(fn: Any, *args: Any) -> Any:
                return pool.apply(fn, args)

            await fanout(submit)
            return await fanout(submit)
    finally:
        # its workers share a multiprocessing Manager server that it keeps for
        # the life of the interpreter: stopped here, so no round leaves a process
        manager = aiomultiprocess.core._manager
        if manager is not None:
            aiomultiprocess.core._manager = None
            manager.shutdown()


async def one_round(n: int, with_amp: bool) -> dict[str, Sample]:
    children_before = _util.child_pids()
    out: dict[str, Sample] = {}
    async with aioproc.open_worker(name="bench-coro") as w:
        for _ in range(20):
            await w.call(_workers.async_noop)  # the worker's loop runs from the first
            await w.call(NOOP)
        sync, coro = await latency(w, n)
    out["sync"], out["coro"] = Sample(sync), Sample(coro)
    if hasattr(os, "sched_setaffinity"):
        out["sync1"], out["coro1"] = map(Sample, await latency_on_one_cpu(n))
    if with_amp:
        out["aiomultiprocess"] = await _util.measure_async(aiomultiprocess_fanout)
    out["aioproc"] = await _util.measure_async(aioproc_fanout)
    leftover = _util.child_pids() - children_before
    leftover -= _resource_trackers(leftover)
    if leftover:
        raise AssertionError(f"worker processes left running: {sorted(leftover)}")
    return out


def _resource_trackers(pids: set[int]) -> set[int]:
    """The ``multiprocessing`` resource trackers among ``pids`` (spawn leaves one for good)."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"resource_tracker" in f.read():
                    found.add(pid)
        except OSError:
            pass
    return found


def coro_rows(cfg: Config) -> list[Row]:
    """The PC rows, per supervisor loop."""
    n = 300 if cfg.quick else 2000
    with_amp = aiomultiprocess_available()
    data: dict[str, dict[str, Series]] = {
        loop: {
            k: Series()
            for k in ("sync", "coro", "sync1", "coro1", "aioproc", "aiomultiprocess", "ideal")
        }
        for loop in cfg.loops
    }
    for i in range(cfg.warmup + cfg.rounds):
        for loop in cfg.loops:
            got = run_on(loop, lambda: one_round(n, with_amp))
            if i < cfg.warmup:
                continue
            got["ideal"] = Sample(FANOUT_IDEAL)
            for key, sample in got.items():
                data[loop][key].samples.append(sample)

    def us(series: Series) -> Series:
        return Series([Sample(round(s.value * 1e6, 1)) for s in series.samples])

    rows = rows_from(
        f"PC latency: one `w.call(async_noop)` (median of {n})",
        {loop: (us(d["sync"]), us(d["coro"])) for loop, d in data.items()},
        LATENCY_TARGET,
        unit="µs",
        note="baseline: one `w.call(noop)` (sync), same worker, its loop running",
    )
    if all(d["sync1"].samples for d in data.values()):
        rows += rows_from(
            f"PC latency, supervisor and worker on one CPU (median of {n})",
            {loop: (us(d["sync1"]), us(d["coro1"])) for loop, d in data.items()},
            LATENCY_TARGET,
            unit="µs",
            note="baseline: one `w.call(noop)` (sync), same worker, both pinned to one CPU",
        )
    what = (
        f"PC fan-out: {FANOUT_CALLS} x `asyncio.sleep({FANOUT_SLEEP:g})`, pool of "
        f"{FANOUT_WORKERS}, max_concurrency {FANOUT_CONCURRENCY}"
    )
    rows += rows_from(
        what,
        {loop: (d["ideal"], d["aioproc"]) for loop, d in data.items()},
        FANOUT_TARGET,
        note=f"baseline: the ideal {FANOUT_SLEEP:g} s x ceil({FANOUT_CALLS} / "
        f"({FANOUT_WORKERS} x {FANOUT_CONCURRENCY}))",
    )
    if not with_amp:
        for row in rows[-len(data) :]:
            row.note += "; the row against aiomultiprocess is skipped: it is not installed"
        return rows
    import aiomultiprocess

    rows += rows_from(
        what,
        {loop: (d["aiomultiprocess"], d["aioproc"]) for loop, d in data.items()},
        None,
        note=f"baseline: aiomultiprocess {aiomultiprocess.__version__} Pool, "
        f"{FANOUT_WORKERS} processes, childconcurrency {FANOUT_CONCURRENCY}",
    )
    return rows


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--loop", choices=("asyncio", "uvloop", "both"), default="both")
    a = p.parse_args()
    loops = _util.LOOPS if a.loop == "both" else (a.loop,)
    loops = tuple(x for x in loops if x != "uvloop" or _util.uvloop_available())
    cfg = Config.quick_mode(loops, a.rounds) if a.quick else Config.full(loops, a.rounds)
    print(_util.format_table(coro_rows(cfg)))


if __name__ == "__main__":
    main()
