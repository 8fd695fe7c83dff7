"""P7: the longest event-loop stall while aioproc starts, stops and tees.

A ticker task sleeps 1 ms at a time and records how late each wake-up is;
the largest lateness is the longest time one callback held the loop (a
service embedding aioproc answers nothing for that long).  Measured while:

- starting 256 binary workers (``sleep``) and 64 function workers,
- closing those 320 workers (SIGTERM, exits, release),
- 4 workers tee 200k lines of 80 bytes each to a ``ConsoleSink`` on a pipe
  that a reader drains.

Baseline: the same ticker on an idle loop for as long, in the same run.
Target: no stall over 5 ms.  Each scenario runs in a fresh supervisor
process so the rounds do not share a warmed-up heap.  ``--quick`` (CI):
fewer workers and lines, 1 round.

    python benchmarks/bench_p7.py [--quick] [--rounds N] [--loop asyncio|uvloop|both]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from _util import Config, Row, Target, standalone_main

TEE_WORKER = (
    "import os, sys\n"
    "n = int(sys.argv[1])\n"
    "chunk = b''.join(b'%08d ' % i + b'x' * 70 + b'\\n' for i in range(1000))\n"
    "for _ in range(n // 1000):\n"
    "    view = memoryview(chunk)\n"
    "    while view:\n"
    "        view = view[os.write(1, view):]\n"
)


def _hold(seconds: float) -> None:
    import time

    time.sleep(seconds)


class Ticker:
    """Records the worst lateness of 1 ms sleeps until stopped.

    ``worst`` is wall time (what a service waiting on the loop sees, CPU
    starvation by the workers included); ``worst_cpu`` is the main thread's
    CPU time between two ticks, i.e. how long callbacks ran without
    yielding, whatever else the machine was doing.
    """

    def __init__(self) -> None:
        import asyncio

        self.worst = 0.0
        self.worst_cpu = 0.0
        self._stop = False
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        import asyncio
        import time

        while not self._stop:
            t0 = time.perf_counter()
            c0 = time.thread_time()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - t0 - 0.001)
            self.worst_cpu = max(self.worst_cpu, time.thread_time() - c0)

    async def stop(self) -> tuple[float, float]:
        self._stop = True
        await self._task
        return self.worst, self.worst_cpu


async def _idle(seconds: float) -> tuple[float, float]:
    import asyncio

    ticker = Ticker()
    await asyncio.sleep(seconds)
    return await ticker.stop()


async def _warm_up() -> None:
    """One small group of each kind first: imports and one-time setup are
    a process's first start, not the steady state a service lives in."""
    import aioproc
    from aioproc import DefaultLogsSpecs, Std

    for entrypoint, args in (("true", ()), (_hold, (0.0,))):
        await aioproc.run(entrypoint, nprocs=1, args=args)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory(prefix="bench-p7-") as logs:
        pc = await aioproc.start_processes(
            "warm",
            sys.executable,
            {0: ("-c", TEE_WORKER, "1000")},
            {0: {}},
            DefaultLogsSpecs(log_dir=logs, tee=Std.OUT),
        )
        await pc.wait()


async def _start_close(n_bin: int, n_fn: int) -> dict[str, float]:
    import asyncio
    import time

    import aioproc

    out: dict[str, float] = {}
    await _warm_up()
    t0 = time.perf_counter()
    ticker = Ticker()
    await asyncio.sleep(0.01)  # the ticker is running
    bins = await aioproc.start_processes(
        "bin", "sleep", {r: ("1000",) for r in range(n_bin)}, {r: {} for r in range(n_bin)}
    )
    fns = await aioproc.start_processes(
        "fn", _hold, {r: (1000.0,) for r in range(n_fn)}, {r: {} for r in range(n_fn)}
    )
    await asyncio.sleep(0.01)
    out["start"], out["start_cpu"] = await ticker.stop()
    out["start_s"] = time.perf_counter() - t0
    await asyncio.sleep(0.5)  # function workers booted and idle
    out["idle"], out["idle_cpu"] = await _idle(0.2)
    t0 = time.perf_counter()
    ticker = Ticker()
    await asyncio.sleep(0.01)
    await asyncio.gather(bins.close(timeout=10), fns.close(timeout=10))
    await asyncio.sleep(0.01)
    out["close"], out["close_cpu"] = await ticker.stop()
    out["close_s"] = time.perf_counter() - t0
    return out


async def _tee(n_workers: int, lines: int) -> dict[str, float]:
    import asyncio
    import time

    import aioproc
    from aioproc import DefaultLogsSpecs, Std

    out: dict[str, float] = {}
    await _warm_up()
    with tempfile.TemporaryDirectory(prefix="bench-p7-") as logs:
        t0 = time.perf_counter()
        ticker = Ticker()
        await asyncio.sleep(0.01)
        pc = await aioproc.start_processes(
            "tee",
            sys.executable,
            {r: ("-c", TEE_WORKER, str(lines)) for r in range(n_workers)},
            {r: {} for r in range(n_workers)},
            DefaultLogsSpecs(log_dir=logs, tee=Std.OUT),
        )
        result = await pc.wait()
        if result is None or result.is_failed():
            raise RuntimeError(f"tee workers failed: {result}")
        out["tee"], out["tee_cpu"] = await ticker.stop()
        out["tee_s"] = time.perf_counter() - t0
    out["idle"], out["idle_cpu"] = await _idle(0.2)
    return out


def _child(argv: list[str]) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import asyncio

    loop, scenario, *sizes = argv
    coro = (
        _start_close(int(sizes[0]), int(sizes[1]))
        if scenario == "start"
        else _tee(int(sizes[0]), int(sizes[1]))
    )
    if loop == "uvloop":
        import uvloop

        out = uvloop.run(coro)
    else:
        out = asyncio.run(coro)
    print(json.dumps(out), file=sys.stderr, flush=True)


def _measure(loop: str, scenario: str, *sizes: int) -> dict[str, float]:
    # the supervisor's console is a pipe drained by a reader: `cat > /dev/null`
    drain = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        proc = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                loop,
                scenario,
                *map(str, sizes),
            ],
            stdout=drain.stdin,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        assert drain.stdin is not None
        drain.stdin.close()
        drain.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"supervisor failed: {proc.stderr[-2000:]}")
    res: dict[str, float] = json.loads(proc.stderr.strip().splitlines()[-1])
    return res


def p7(cfg: Config) -> list[Row]:
    n_bin, n_fn = (64, 16) if cfg.quick else (256, 64)
    tee_n, tee_lines = (4, 20_000) if cfg.quick else (4, 200_000)
    rounds = 1 if cfg.quick else max(1, cfg.rounds // 3)
    rows = []
    target = Target("max", 0.005, "ms")
    for loop in cfg.loops:
        sc = [_measure(loop, "start", n_bin, n_fn) for _ in range(rounds)]
        tc = [_measure(loop, "tee", tee_n, tee_lines) for _ in range(rounds)]
        idle = statistics.median([s["idle"] for s in sc] + [t["idle"] for t in tc])
        idle_cpu = statistics.median([s["idle_cpu"] for s in sc] + [t["idle_cpu"] for t in tc])
        for what, key, samples, took in (
            (f"start {n_bin} binary + {n_fn} function workers", "start", sc, "start_s"),
            (f"close those {n_bin + n_fn}", "close", sc, "close_s"),
            (f"tee {tee_n} x {tee_lines} lines x 80 B", "tee", tc, "tee_s"),
        ):
            wall = statistics.median(s[key] for s in samples)
            rows.append(
                Row(
                    f"P7 longest callback (main-thread CPU between ticks): {what}",
                    loop,
                    statistics.median(s[key + "_cpu"] for s in samples),
                    idle_cpu,
                    "ms",
                    target,
                    note=f"baseline: idle loop; median of {rounds} run(s); took "
                    f"{statistics.median(s[took] for s in samples) * 1e3:.0f} ms; worst "
                    f"wall-clock lateness of a 1 ms ticker {wall * 1e3:.1f} ms "
                    f"(idle {idle * 1e3:.1f} ms; includes CPU taken by the workers)",
                    timed=False,
                )
            )
    return rows


def main() -> None:
    standalone_main(__doc__ or "", p7, _child)


if __name__ == "__main__":
    main()
