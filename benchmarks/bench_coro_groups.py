"""Coroutine workers in groups: what ``async def`` adds to a group's start.

    python benchmarks/bench_coro_groups.py [--quick] [--rounds N] [--loop asyncio|uvloop|both]

Each figure starts ``n`` function workers that return their rank at once,
start -> all results -> closed, medians of rounds measured interleaved in
the same run.  The ``async def`` worker imports asyncio, makes a loop, runs
the coroutine and closes the loop; the ``def`` one calls its function.

- spawned ``async def`` vs spawned ``def``: what every spawned coroutine
  worker pays for asyncio (info);
- forked ``async def`` (``start_method="forkserver"``, a warm template that
  has forked coroutine workers before) vs spawned ``async def``: the
  template imports asyncio once, at its first coroutine worker, so its
  forks do not (target 0.3x);
- forked ``async def`` vs forked ``def`` (each on a warm template of its
  own): what is left, the loop and a template that holds asyncio (info).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _coro_groups_workers  # noqa: E402
import _workers  # noqa: E402
from _util import (  # noqa: E402
    Config,
    Row,
    Series,
    Target,
    interleaved_all,
    rows_from,
    standalone_main,
)

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
    sync_fn, coro_fn = _workers.ret_rank, _coro_groups_workers.aret_rank

    def spawned(fn: Callable[[int], Any]) -> Callable[[], Awaitable[float]]:
        async def measure() -> float:
            return await group(fn, n, "spawn")

        return measure

    def forked(fn: Callable[[int], Any]) -> Callable[[], Awaitable[float]]:
        async def measure() -> float:
            async with aioproc.open_forkserver():
                await group(fn, n, "forkserver")  # warm: the template is up (and holds asyncio)
                return await group(fn, n, "forkserver")

        return measure

    series = interleaved_all(
        cfg, [spawned(sync_fn), spawned(coro_fn), forked(sync_fn), forked(coro_fn)]
    )
    sync_spawned, coro_spawned, sync_forked, coro_forked = 0, 1, 2, 3

    def pair(base: int, cand: int) -> dict[str, tuple[Series, Series]]:
        return {loop: (s[base], s[cand]) for loop, s in series.items()}

    what = f"{n} async def workers: start -> results -> closed"
    return [
        *rows_from(
            f"{what}, spawned",
            pair(sync_spawned, coro_spawned),
            None,
            note=f"baseline: {n} def workers, spawned",
            cpu_note=True,
        ),
        *rows_from(
            f"{what}, forked",
            pair(coro_spawned, coro_forked),
            Target("ratio", 0.3),
            note=f"baseline: the same {n} async def workers, spawned",
        ),
        *rows_from(
            f"{what}, forked",
            pair(sync_forked, coro_forked),
            None,
            note=f"baseline: {n} def workers, forked from a template of their own",
        ),
    ]


def _child(argv: list[str]) -> None:
    raise SystemExit(f"bench_coro_groups has no child mode: {argv}")


if __name__ == "__main__":
    standalone_main(__doc__, bench, _child)
