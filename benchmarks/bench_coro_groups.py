"""Coroutine workers in groups: what ``async def`` adds to a group's start.

    python benchmarks/bench_coro_groups.py [--quick] [--rounds N] [--loop asyncio|uvloop|both]

Each row starts ``n`` function workers that return their rank at once, start
-> all results -> closed; the candidate's function is ``async def`` (its
worker imports asyncio, makes a loop, runs the coroutine and closes the
loop), the baseline's the same function written ``def``, measured
interleaved in the same run.  Spawned: every coroutine worker imports
asyncio itself (no target; the figure says what that costs here).
Forked (``start_method="forkserver"``, template kept up by
``open_forkserver`` and warmed by one group of the same kind): the template
imports asyncio once, at its first coroutine worker, for all that follow,
so they start about as fast as sync ones (target 1.3x).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _coro_groups_workers  # noqa: E402
import _workers  # noqa: E402
from _util import Config, Row, Target, interleaved, rows_from, standalone_main  # noqa: E402

import aioproc  # noqa: E402


async def group(fn: Callable[[int], Any], n: int, start_method: str) -> float:
    """Start ``n`` workers of ``fn``, wait for every rank back, close: seconds."""
    t0 = time.perf_counter()
    result = await aioproc.run(fn, n, args={r: (r,) for r in range(n)}, start_method=start_method)
    dt = time.perf_counter() - t0
    if result.return_values != {r: r for r in range(n)}:
        raise AssertionError(f"wrong return values: {result.return_values}")
    return dt


def bench(cfg: Config) -> list[Row]:
    n = 4 if cfg.quick else 8
    rows: list[Row] = []
    for start_method, target in (("spawn", None), ("forkserver", Target("ratio", 1.3))):

        async def sync(start_method: str = start_method) -> float:
            if start_method == "forkserver":
                async with aioproc.open_forkserver():
                    await group(_workers.ret_rank, n, start_method)  # the template is up
                    return await group(_workers.ret_rank, n, start_method)
            return await group(_workers.ret_rank, n, start_method)

        async def coro(start_method: str = start_method) -> float:
            if start_method == "forkserver":
                async with aioproc.open_forkserver():
                    # the template is up, and has imported asyncio (once)
                    await group(_coro_groups_workers.aret_rank, n, start_method)
                    return await group(_coro_groups_workers.aret_rank, n, start_method)
            return await group(_coro_groups_workers.aret_rank, n, start_method)

        rows += rows_from(
            f"{n} async def workers ({start_method}): start -> results -> closed",
            interleaved(cfg, sync, coro),
            target,
            note=f"baseline: the same {n} workers running a def",
            cpu_note=True,
        )
    return rows


def _child(argv: list[str]) -> None:
    raise SystemExit(f"bench_coro_groups has no child mode: {argv}")


if __name__ == "__main__":
    standalone_main(__doc__, bench, _child)
