"""Memory per live worker: the supervisor's RSS with 1024 workers running.

A fresh supervisor (``--child``) starts ``N`` binary workers (``sleep``,
no tee: what every worker costs the supervisor whatever it runs) and
reads its ``VmRSS`` before the start and once all are running (after a
``gc.collect()``); the difference over ``N`` is the supervisor's memory per
live worker (its ``Child``, exit watcher, pidfd, outcome slot, log paths).
Baseline, in another fresh supervisor: the same ``N`` processes held as
plain ``subprocess.Popen`` objects.

Target: < 30 KB per worker.  ``--quick`` (CI): 128 workers, one round.

    python benchmarks/bench_rss_workers.py [--quick] [--rounds N] [--loop asyncio|uvloop|both]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from _util import Config, Row, Target, standalone_main


def _rss() -> int:
    import gc

    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def _child_main(n: int, kind: str) -> float:
    """RSS growth per worker while ``n`` run, in this fresh process."""
    import aioproc

    # one small group first: imports, the guardian, the first log dir
    await aioproc.run("true", nprocs=1)
    before = _rss()
    if kind == "popen":
        procs = [subprocess.Popen(["sleep", "1000"], start_new_session=True) for _ in range(n)]
        try:
            during = _rss()
        finally:
            for p in procs:
                p.kill()
            for p in procs:
                p.wait()
        return (during - before) / n
    pc = await aioproc.start_processes(
        "mem", "sleep", {r: ("1000",) for r in range(n)}, {r: {} for r in range(n)}
    )
    try:
        during = _rss()
    finally:
        await pc.close(timeout=10)
    return (during - before) / n


def _child(argv: list[str]) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import asyncio

    loop, n, kind = argv[0], int(argv[1]), argv[2]
    if loop == "uvloop":
        import uvloop

        out = uvloop.run(_child_main(n, kind))
    else:
        out = asyncio.run(_child_main(n, kind))
    print(json.dumps(out), file=sys.stderr, flush=True)


def _measure(loop: str, n: int, kind: str) -> float:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", loop, str(n), kind],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"supervisor failed: {proc.stderr[-2000:]}")
    return float(json.loads(proc.stderr.strip().splitlines()[-1]))


def rss_workers(cfg: Config) -> list[Row]:
    n = 128 if cfg.quick else 1024
    rounds = 1 if cfg.quick else max(1, cfg.rounds // 3)
    rows = []
    for loop in cfg.loops:
        pairs = [(_measure(loop, n, "popen"), _measure(loop, n, "aioproc")) for _ in range(rounds)]
        rows.append(
            Row(
                f"supervisor RSS per live worker, {n} workers",
                loop,
                statistics.median(a for _, a in pairs) / 1e3,
                statistics.median(b for b, _ in pairs) / 1e3,
                "KB",
                Target("max", 30.0, "KB"),
                note=f"baseline: {n} plain subprocess.Popen objects; median of {rounds} run(s)",
                timed=False,
            )
        )
    return rows


def main() -> None:
    standalone_main(__doc__ or "", rss_workers, _child)


if __name__ == "__main__":
    main()
