"""P9: large values out of band: a 1 GiB dict of numpy arrays to ``w.call`` and back.

    python benchmarks/bench_oob.py [--quick] [--loop asyncio|uvloop|both] [--rounds N]

One persistent worker gets a dict of 16 float64 arrays (64 MiB each, 1 GiB
in all; ``--quick``: 4 MiB each) and returns it (``dict``, a builtin: a
shallow copy holding the very arrays it received).  The figure is the time
of that one round trip, the worker started and warmed up (one call with the
same dict) before the clock starts.  Baselines, measured in the same round:

- a 1-worker ``concurrent.futures.ProcessPoolExecutor`` (fork) through
  ``loop.run_in_executor``: pickled in band, through a pipe, both ways;
- when torch is installed, a 1-worker ``torch.multiprocessing`` pool (fork)
  with the same arrays as tensors (``torch.from_numpy``): torch moves a
  tensor's storage into shared memory the first time it is sent and sends a
  handle from then on, so after the warm-up call neither side copies.

The result is checked (keys, shapes, and a few values of every array) after
the clock stops.  numpy is needed (it is not an aioproc dependency): without
it the benchmark is skipped with a note.

For ``run_all``: ``oob_rows(cfg) -> list[Row] | str``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import sys
import time
from typing import Any

import _util
from _util import Config, Row, Target, interleaved, interleaved_sync_baseline, rows_from
from bench_p7 import Ticker

import aioproc

ARRAYS = 16
TARGET = Target("ratio", 0.3)  # <= 0.3x ProcessPoolExecutor's time
HOLD = Target("max", 0.005, "ms")  # no callback holds the loop longer, whatever the size


def make_data(cfg: Config) -> dict[str, Any]:
    import numpy as np

    each = (4 if cfg.quick else 64) << 20
    return {
        f"a{i}": np.full(each // 8, float(i), dtype=np.float64) + np.arange(each // 8)
        for i in range(ARRAYS)
    }


def check(sent: dict[str, Any], got: Any) -> None:
    if not isinstance(got, dict) or got.keys() != sent.keys():
        raise AssertionError(f"wrong result: {type(got).__name__}")
    for key, array in sent.items():
        back = got[key]
        n = len(array)
        same = back.shape == array.shape and all(
            float(back[i]) == float(array[i]) for i in (0, n // 2, n - 1)
        )
        if not same:
            raise AssertionError(f"array {key} came back different")


def _size(data: dict[str, Any]) -> str:
    total = sum(a.nbytes for a in data.values())
    return f"{total / (1 << 30):g} GiB" if total >= 1 << 30 else f"{total >> 20} MiB"


def oob_rows(cfg: Config) -> list[Row] | str:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return "P9 skipped: numpy is not installed"
    data = make_data(cfg)

    async def executor() -> float:
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(ex, dict, data)  # warm-up
            t0 = time.perf_counter()
            got = await loop.run_in_executor(ex, dict, data)
            dt = time.perf_counter() - t0
        check(data, got)
        return dt

    async def worker() -> float:
        async with aioproc.open_worker(name="p9") as w:
            await w.call(dict, data)  # warm-up
            t0 = time.perf_counter()
            got = await w.call(dict, data)
            dt = time.perf_counter() - t0
        check(data, got)
        return dt

    async def idle_hold() -> float:
        ticker = Ticker()
        await asyncio.sleep(0.3)
        return (await ticker.stop())[1]

    async def worker_hold() -> float:
        async with aioproc.open_worker(name="p9") as w:
            await w.call(dict, data)  # warm-up
            ticker = Ticker()
            await asyncio.sleep(0.01)  # the ticker is running
            got = await w.call(dict, data)
            worst = (await ticker.stop())[1]
        check(data, got)
        return worst

    what = f"P9: a {_size(data)} dict of {ARRAYS} numpy arrays to `w.call` and back"
    rows = rows_from(
        what,
        interleaved(cfg, executor, worker),
        TARGET,
        note="baseline: concurrent.futures.ProcessPoolExecutor (fork, run_in_executor), 1 worker",
    )
    rows += rows_from(
        f"P9 hold: the longest loop hold while the {_size(data)} goes to the worker and back",
        interleaved(cfg, idle_hold, worker_hold),
        HOLD,
        note="the loop thread's CPU time between two 1 ms ticks (what one callback ran); "
        "baseline: the same ticker on an idle loop",
    )
    torch_rows = _torch_rows(cfg, data, worker, what)
    return rows + torch_rows


def _torch_rows(cfg: Config, data: dict[str, Any], worker: Any, what: str) -> list[Row]:
    try:
        import torch
        import torch.multiprocessing as tmp
    except ImportError:
        return []
    tensors = {k: torch.from_numpy(v) for k, v in data.items()}

    def torch_pool() -> float:
        with tmp.get_context("fork").Pool(1) as pool:
            pool.apply(dict, (tensors,))  # warm-up: storages move to shared memory
            t0 = time.perf_counter()
            got = pool.apply(dict, (tensors,))
            dt = time.perf_counter() - t0
        check(data, {k: v.numpy() for k, v in got.items()})
        return dt

    return rows_from(
        what,
        interleaved_sync_baseline(cfg, torch_pool, worker, max(1, cfg.rounds)),
        None,
        note="baseline: torch.multiprocessing Pool(1) (fork), shared-memory tensors",
    )


def main() -> None:
    _util.standalone_main(__doc__, _rows_or_note, lambda argv: None)


def _rows_or_note(cfg: Config) -> list[Row]:
    out = oob_rows(cfg)
    if isinstance(out, str):
        print(out, file=sys.stderr)
        return []
    return out


if __name__ == "__main__":
    main()
