"""PW: persistent workers: call latency and pool throughput.

    python benchmarks/bench_worker.py [--quick] [--loop asyncio|uvloop|both] [--rounds N]

Three figures, each for aioproc and two baselines measured in the same
round, in the same fresh event loop, one after the other (ProcessPoolExecutor,
anyio, aioproc), every worker started and warmed up before any clock starts:

- latency: the median time of one ``await w.call(noop)`` on one worker,
  over ``latency_calls`` sequential calls; baselines: a 1-worker
  ``concurrent.futures.ProcessPoolExecutor`` through ``loop.run_in_executor``
  and ``anyio.to_process.run_sync`` with a ``CapacityLimiter(1)``.
- small payloads: ``small_calls`` concurrent ``pool.submit(len, 64 bytes)``
  over 4 workers (``asyncio.gather``), start to last result; baselines the
  same through a 4-worker executor and anyio with a ``CapacityLimiter(4)``.
- 10 MB payloads: the same with ``big_calls`` calls of 10 MB bytes in, the
  length out.
- script functions: a function defined in the user's script (``__main__``)
  travels by value, the rest by reference.  ``w.call(f, 0)`` of such a
  function against the same call of its twin importable by name
  (``_workers.ret_rank``) on the same worker, blocks of calls alternating
  (target: 1.1x); and ``script_calls`` concurrent ``pool.submit(f, 0)`` over
  4 workers against the 4-worker executor, which pickles ``f`` by name and
  finds it in its forked workers' ``__main__`` (target: 0.6x).

The functions are builtins (``int`` as the no-op, ``len``), so every variant
sends them by reference and no worker imports anything to run them.  The
executor uses the ``fork`` start method, started first in each round (no
other thread exists yet): ``spawn``/``forkserver`` would leave a
``multiprocessing`` resource-tracker child behind that the leak benchmark
would count.  Figures are medians over rounds; the ratio column is the
median of the per-round ratios (see ``_util``).

For ``run_all``: ``worker_rows(cfg) -> list[Row]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import functools
import importlib.metadata
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

# run as a script: measure this checkout's aioproc (as run_all does), not an installed one
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _util
import _workers
import anyio
import anyio.to_process
from _util import Config, Row, Sample, Series, Target, rows_from, run_on

import aioproc

NOOP = int  # ``int()`` returns 0: a builtin no-op every variant imports by reference
SMALL = b"x" * 64
BIG_SIZE = 10 * 1024 * 1024
POOL_WORKERS = 4
VARIANTS = ("ppe", "anyio", "aioproc")
BASELINE_NAMES = {
    "ppe": "concurrent.futures.ProcessPoolExecutor (run_in_executor)",
    "anyio": "anyio.to_process.run_sync",
}
LATENCY_TARGET = Target("ratio", 1.5)  # small-call latency within 1.5x of ProcessPoolExecutor
SCRIPT_LATENCY_TARGET = Target("ratio", 1.1)  # a script's function: as fast as an importable one
SCRIPT_POOL_TARGET = Target("ratio", 0.6)
LATENCY_BLOCKS = 10  # module and script calls alternate in this many blocks per round


def _script_function() -> Callable[[int], int]:
    """``_workers.ret_rank``'s twin, defined as a script defines its functions.

    Its ``__module__`` is ``__main__``, so aioproc sends it by value; it is
    also set on the running ``__main__`` so that the executor, which pickles
    functions by name, finds it there and in its forked workers.
    """
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec("def script_ret_rank(rank):\n    return rank\n", namespace)
    fn: Callable[[int], int] = namespace["script_ret_rank"]
    main = sys.modules.get("__main__")  # absent while anyio's workers import this
    if main is not None:
        setattr(main, "script_ret_rank", fn)  # noqa: B010
    return fn


SCRIPT_FN = _script_function()


@dataclass(frozen=True)
class Sizes:
    latency_calls: int
    small_calls: int
    big_calls: int
    script_calls: int = 1000

    @classmethod
    def of(cls, cfg: Config) -> Sizes:
        if cfg.quick:
            return cls(latency_calls=300, small_calls=400, big_calls=12)
        return cls(latency_calls=2000, small_calls=2000, big_calls=40)


Call = Callable[..., Awaitable[Any]]


class Variant:
    """One implementation: a 1-worker caller (latency) and a 4-worker caller."""

    async def start(self) -> None:
        raise NotImplementedError

    async def one(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    async def many(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def warm(self) -> None:
        for _ in range(20):
            await self.one(NOOP)
        # several at once: every worker of the pool is started and has run a call
        await asyncio.gather(*(self.many(len, SMALL) for _ in range(4 * POOL_WORKERS)))
        await asyncio.gather(*(self.many(len, b"w" * BIG_SIZE) for _ in range(POOL_WORKERS)))

    async def warm_script(self) -> None:
        """The script-function rows: both functions known to every worker."""
        for _ in range(20):
            await self.one(_workers.ret_rank, 0)
            await self.one(SCRIPT_FN, 0)
        await asyncio.gather(*(self.many(SCRIPT_FN, 0) for _ in range(4 * POOL_WORKERS)))


class Executor(Variant):
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self.ex1 = concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx)
        self.ex4 = concurrent.futures.ProcessPoolExecutor(POOL_WORKERS, mp_context=ctx)

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.warm()
        await self.warm_script()

    async def one(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.loop.run_in_executor(self.ex1, fn, *args)

    async def many(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.loop.run_in_executor(self.ex4, fn, *args)

    async def close(self) -> None:
        self.ex1.shutdown(wait=True)
        self.ex4.shutdown(wait=True)


class AnyioProcesses(Variant):
    """anyio keeps one process pool per event loop; the limiters bound its use."""

    def __init__(self) -> None:
        self.lim1 = anyio.CapacityLimiter(1)
        self.lim4 = anyio.CapacityLimiter(POOL_WORKERS)

    async def start(self) -> None:
        await self.warm()

    async def one(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_process.run_sync(fn, *args, limiter=self.lim1)

    async def many(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_process.run_sync(fn, *args, limiter=self.lim4)

    async def close(self) -> None:
        # anyio would kill its idle workers when the loop shuts down, by
        # abandoning their Popen objects; the next subprocess.Popen() then
        # reaps them behind asyncio's child watcher ("Unknown child process").
        # Stop and reap them here instead, while the loop runs.
        from anyio.to_process import _process_pool_idle_workers, _process_pool_workers

        workers = _process_pool_workers.get(set())
        _process_pool_idle_workers.get(collections.deque()).clear()
        for process in list(workers):
            if process.returncode is None:
                process.kill()
            await process.aclose()
            workers.discard(process)


class Aioproc(Variant):
    async def start(self) -> None:
        self.worker = await aioproc.open_worker(name="bench")
        self.pool = await aioproc.open_pool(POOL_WORKERS, name="bench-pool")
        await self.warm()
        await self.warm_script()

    async def one(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.worker.call(fn, *args)

    async def many(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.pool.submit(fn, *args)

    async def close(self) -> None:
        await self.worker.aclose()
        await self.pool.aclose()


async def latency(v: Variant, n: int) -> float:
    """Median seconds of one sequential no-op call."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await v.one(NOOP)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def batch(v: Variant, n: int, payload: bytes) -> float:
    """Seconds from submitting ``n`` concurrent ``len(payload)`` calls to the last result."""
    t0 = time.perf_counter()
    results = await asyncio.gather(*(v.many(len, payload) for _ in range(n)))
    dt = time.perf_counter() - t0
    if results != [len(payload)] * n:
        raise AssertionError(f"wrong results: {sorted(set(results))[:5]}")
    return dt


async def script_latency(v: Variant, n: int) -> tuple[float, float]:
    """Median seconds of one sequential call: (module function, script function).

    The two alternate in blocks on the same worker, so drift in the machine's
    load reaches both alike.
    """
    times: dict[Any, list[float]] = {_workers.ret_rank: [], SCRIPT_FN: []}
    block = max(1, n // LATENCY_BLOCKS)
    for _ in range(LATENCY_BLOCKS):
        for fn, out in times.items():
            for _ in range(block):
                t0 = time.perf_counter()
                await v.one(fn, 0)
                out.append(time.perf_counter() - t0)
    return statistics.median(times[_workers.ret_rank]), statistics.median(times[SCRIPT_FN])


async def script_batch(v: Variant, n: int) -> float:
    """Seconds from submitting ``n`` concurrent ``SCRIPT_FN(i)`` calls to the last result."""
    t0 = time.perf_counter()
    results = await asyncio.gather(*(v.many(SCRIPT_FN, i) for i in range(n)))
    dt = time.perf_counter() - t0
    if results != list(range(n)):
        raise AssertionError(f"wrong results: {results[:5]}")
    return dt


METRICS = ("latency", "small", "big", "script_latency", "script_pool")


async def one_round(sizes: Sizes) -> dict[str, dict[str, Sample]]:
    """Every metric for every variant, in this event loop: ``{metric: {variant: sample}}``."""
    big = b"b" * BIG_SIZE
    children_before = _util.child_pids()
    # the executor forks: start it while this process has no other thread
    variants: dict[str, Variant] = {
        "ppe": Executor(),
        "anyio": AnyioProcesses(),
        "aioproc": Aioproc(),
    }
    started: list[Variant] = []
    out: dict[str, dict[str, Sample]] = {m: {} for m in METRICS}
    try:
        for name in VARIANTS:
            await variants[name].start()
            started.append(variants[name])
        for metric, measure in (
            ("latency", functools.partial(latency, n=sizes.latency_calls)),
            ("small", functools.partial(batch, n=sizes.small_calls, payload=SMALL)),
            ("big", functools.partial(batch, n=sizes.big_calls, payload=big)),
        ):
            for name in VARIANTS:  # baselines first, as everywhere in the benchmarks
                out[metric][name] = await _util.measure_async(
                    functools.partial(measure, variants[name])
                )
        # script functions: aioproc's own module-function call is the baseline
        # of the first, the executor that of the second
        module, script = await script_latency(variants["aioproc"], sizes.latency_calls)
        out["script_latency"] = {"module": Sample(module), "aioproc": Sample(script)}
        for name in ("ppe", "aioproc"):
            out["script_pool"][name] = await _util.measure_async(
                functools.partial(script_batch, variants[name], sizes.script_calls)
            )
    finally:
        for v in reversed(started):
            await v.close()
    leftover = _util.child_pids() - children_before
    if leftover:
        raise AssertionError(f"worker processes left running: {sorted(leftover)}")
    return out


def measure(cfg: Config, sizes: Sizes) -> dict[str, dict[str, dict[str, Series]]]:
    """``{metric: {loop: {variant: series}}}``, rounds interleaved across loops."""
    out: dict[str, dict[str, dict[str, Series]]] = {
        m: {loop: collections.defaultdict(Series) for loop in cfg.loops} for m in METRICS
    }
    for i in range(cfg.warmup + cfg.rounds):
        for loop in cfg.loops:
            got = run_on(loop, lambda: one_round(sizes))
            if i < cfg.warmup:
                continue
            for m in METRICS:
                for v, sample in got[m].items():
                    out[m][loop][v].samples.append(sample)
    return out


def _us(series: Series) -> Series:
    """Seconds -> microseconds (the table's ``ms`` unit shows only 0.1 ms steps)."""
    return Series(
        [Sample(round(s.value * 1e6, 1), s.parent_cpu, s.child_cpu) for s in series.samples]
    )


def worker_rows(cfg: Config) -> list[Row]:
    """The PW rows: latency and throughput against both baselines, per loop."""
    sizes = Sizes.of(cfg)
    data = measure(cfg, sizes)
    rows: list[Row] = []
    for base in ("ppe", "anyio"):
        by_loop = {loop: (_us(d[base]), _us(d["aioproc"])) for loop, d in data["latency"].items()}
        rows += rows_from(
            f"PW latency: one `w.call(noop)` (median of {sizes.latency_calls})",
            by_loop,
            LATENCY_TARGET if base == "ppe" else None,
            unit="µs",
            note=f"baseline: {BASELINE_NAMES[base]}, 1 worker",
        )
    by_loop = {
        loop: (_us(d["module"]), _us(d["aioproc"])) for loop, d in data["script_latency"].items()
    }
    rows += rows_from(
        "PW script function: one `w.call(f, 0)`, `f` from `__main__` "
        f"(median of {sizes.latency_calls})",
        by_loop,
        SCRIPT_LATENCY_TARGET,
        unit="µs",
        note="baseline: the same call of its twin importable by name, same worker",
    )
    by_loop = {loop: (d["ppe"], d["aioproc"]) for loop, d in data["script_pool"].items()}
    for row in rows_from(
        f"PW script function: {sizes.script_calls} x `pool.submit(f, i)`, `f` from `__main__`",
        by_loop,
        SCRIPT_POOL_TARGET,
        note=f"baseline: {BASELINE_NAMES['ppe']}, {POOL_WORKERS} workers",
    ):
        n = sizes.script_calls
        row.note += f"; {n / row.candidate:,.0f} vs {n / row.baseline:,.0f} calls/s"
        rows.append(row)
    for metric, n, size in (
        ("small", sizes.small_calls, len(SMALL)),
        ("big", sizes.big_calls, BIG_SIZE),
    ):
        what = f"{size} B" if size < 1024 else f"{size // (1024 * 1024)} MB"
        for base in ("ppe", "anyio"):
            by_loop = {loop: (d[base], d["aioproc"]) for loop, d in data[metric].items()}
            for row in rows_from(
                f"PW throughput: {n} x `pool.submit(len, {what})`, {POOL_WORKERS} workers",
                by_loop,
                None,
                note=f"baseline: {BASELINE_NAMES[base]}, {POOL_WORKERS} workers",
            ):
                rate = n / row.candidate
                base_rate = n / row.baseline
                row.note += f"; {rate:,.0f} vs {base_rate:,.0f} calls/s"
                rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    p.add_argument("--loop", choices=("asyncio", "uvloop", "both"), default="both")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds")
    args = p.parse_args(argv[1:])
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    loops: tuple[str, ...] = _util.LOOPS if args.loop == "both" else (args.loop,)
    if "uvloop" in loops and not _util.uvloop_available():
        loops = tuple(x for x in loops if x != "uvloop")
    cfg = (Config.quick_mode if args.quick else Config.full)(loops, args.rounds)
    sizes = Sizes.of(cfg)
    print(
        f"- mode: {'quick' if cfg.quick else 'full'}, loops: {', '.join(loops)}, "
        f"rounds: {cfg.rounds} (+{cfg.warmup} warm-up); {sizes}",
        flush=True,
    )
    t0 = time.perf_counter()
    rows = worker_rows(cfg)
    print()
    print(_util.format_table(rows))
    print()
    print(f"- python {sys.version.split()[0]}, anyio {importlib.metadata.version('anyio')}")
    print(f"- total time: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
