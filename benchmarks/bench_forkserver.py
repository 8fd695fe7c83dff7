"""P1b and the forkserver's memory: function workers forked from a warm template.

P1b: ``cfg.p1_n`` function workers (``_workers.ret_rank``) started with
``start_method="forkserver"`` while ``open_forkserver()`` keeps the template
up, start -> all results; baseline: the same group spawned (P1's candidate).
The template's own start-up (an interpreter plus an empty preload) is its
own row, against one ``python -c pass``.

Memory: ``cfg.p1_n`` idle workers (each waits in ``time.sleep`` after saying
ready on a FIFO), spawn vs forkserver: the supervisor's RSS and the mean
PSS per worker (``/proc/<pid>/smaps_rollup``; forked workers share the
template's pages copy-on-write).  Reported once per loop, from one round.
"""

from __future__ import annotations

import statistics
import sys
import time

import _workers
from _util import Config, ReadyFifo, Row, Target, interleaved, rows_from, run_on
from bench_core import aioproc_functions, raw_concurrent

import aioproc


async def forked_functions(n: int) -> float:
    """P1b: ``n`` forked function workers, the template already up (not timed)."""
    async with aioproc.open_forkserver():
        t0 = time.perf_counter()
        pc = await aioproc.start_processes(
            "p1b",
            _workers.ret_rank,
            args={r: (r,) for r in range(n)},
            envs={r: {} for r in range(n)},
            start_method="forkserver",
        )
        try:
            result = await pc.wait()
            dt = time.perf_counter() - t0
        finally:
            await pc.close()
    assert result is not None
    if result.return_values != {r: r for r in range(n)}:
        raise AssertionError(f"P1b: wrong return values / failures: {result}")
    return dt


async def template_start() -> float:
    t0 = time.perf_counter()
    server = await aioproc.open_forkserver()
    dt = time.perf_counter() - t0
    await server.aclose()
    return dt


def p1b(cfg: Config) -> list[Row]:
    n = cfg.p1_n
    rows = rows_from(
        f"P1b {n} function workers, forkserver (template up): start -> all results",
        interleaved(
            cfg, lambda: aioproc_functions(_workers.ret_rank, n), lambda: forked_functions(n)
        ),
        Target("max", 0.15, "ms"),
        note=f"baseline: the same {n} workers spawned",
        cpu_note=True,
    )
    rows += rows_from(
        "P1b template start-up (no preload)",
        interleaved(cfg, lambda: raw_concurrent([sys.executable, "-c", "pass"], 1), template_start),
        None,
        note="baseline: 1 x `python -c pass`",
    )
    return rows


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def _idle_memory(n: int, method: str) -> tuple[float, float]:
    """(supervisor RSS MiB, mean worker PSS MiB) with ``n`` idle workers."""
    ready = ReadyFifo(n)
    try:
        async with aioproc.start_processes(
            "mem",
            _workers.ready_then_sleep,
            args={r: (ready.path,) for r in range(n)},
            envs={r: {} for r in range(n)},
            start_method=method,
        ) as pc:
            await ready.wait(60)
            pss = [_pss_kib(pid) for pid in pc.pids().values()]
            rss = _rss_kib()
            await pc.close(timeout=5)
    finally:
        ready.close()
    return rss / 1024, statistics.mean(pss) / 1024


def memory(cfg: Config) -> list[Row]:
    n = cfg.p1_n
    rows = []
    for loop in cfg.loops:
        spawn = run_on(loop, lambda: _idle_memory(n, "spawn"))
        fork = run_on(loop, lambda: _idle_memory(n, "forkserver"))
        rows.append(
            Row(
                f"memory: supervisor RSS, {n} idle workers, forkserver vs spawn",
                loop,
                fork[0],
                spawn[0],
                "MiB",
                None,
                "one round",
                False,
            )
        )
        rows.append(
            Row(
                "memory: mean PSS per idle worker, forkserver vs spawn",
                loop,
                fork[1],
                spawn[1],
                "MiB",
                None,
                "one round",
                False,
            )
        )
    return rows
