"""The P1, P2, P3 and P6 workloads through torch's ``start_processes``, when installed.

torch is not a dependency: without it these rows are skipped.  Its API
blocks, so it is called in the main thread with no event loop running,
between the aioproc rounds (not through ``asyncio.to_thread``: torch only
installs its signal handlers from the main thread, and it polls anyway).
The signal handlers it installs are put back after every call.

Here the candidate is aioproc and the baseline torch: ratio < 1 means
aioproc is faster.  Both run the whole life cycle, start to closed, since
torch's ``wait()`` closes the group before it returns.  torch's ``wait()``
polls: it is given ``period=TORCH_POLL_PERIOD`` (its default is 1 s, which
would dominate every figure).  torch's spawn workers import torch (about
1.5 CPU-s each here), so function workloads run with ``cfg.torch_fn_n``
workers on both sides, and ``cfg.torch_rounds`` rounds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import _workers
from _util import (
    Config,
    ReadyFifo,
    Row,
    assert_gone,
    interleaved_sync_baseline,
    rows_from,
)
from bench_close import READY_TIMEOUT, aioproc_close
from bench_core import TRUE
from bench_failure import StampFile, aioproc_failure

import aioproc

TORCH_POLL_PERIOD = 0.01
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def torch_mp() -> Any | None:
    """``torch.distributed.elastic.multiprocessing``, or None if torch is missing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Failed to initialize NumPy" and the like
        try:
            import torch.distributed.elastic.multiprocessing as tmp
        except ImportError:
            return None
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # "Closing process ..." etc.
    return tmp


@contextlib.contextmanager
def torch_call() -> Iterator[str]:
    """Around one torch group: a private log dir, quiet workers, our signal handlers back.

    ``PYTHONWARNINGS=ignore`` is set only while torch spawns its workers (they
    inherit the environment): each would otherwise print a NumPy warning
    while importing torch.
    """
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    log_dir = tempfile.mkdtemp(prefix="aioproc-bench-torch-")
    try:
        yield log_dir
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        shutil.rmtree(log_dir, ignore_errors=True)


def _start(
    tmp: Any,
    name: str,
    entrypoint: Any,
    args: dict[int, tuple[Any, ...]],
    log_dir: str,
    start_method: str = "spawn",
) -> Any:
    old = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = "ignore"
    try:
        return tmp.start_processes(
            name,
            entrypoint,
            args=args,
            envs={r: {} for r in args},
            logs_specs=tmp.DefaultLogsSpecs(log_dir=log_dir),
            start_method=start_method,
        )
    finally:
        if old is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = old


def torch_run(tmp: Any, entrypoint: Any, n: int, start_method: str = "spawn") -> float:
    """Start -> wait() (which closes) for ``n`` workers that all succeed."""
    args: dict[int, tuple[Any, ...]] = {r: ((r,) if callable(entrypoint) else ()) for r in range(n)}
    with torch_call() as log_dir:
        t0 = time.perf_counter()
        pc = _start(tmp, "tp", entrypoint, args, log_dir, start_method)
        result = pc.wait(period=TORCH_POLL_PERIOD)
        dt = time.perf_counter() - t0
    if result is None or result.is_failed():
        raise AssertionError(f"torch: group failed: {result}")
    if callable(entrypoint) and result.return_values != {r: r for r in range(n)}:
        raise AssertionError(f"torch: wrong return values: {result.return_values}")
    return dt


def torch_failure(tmp: Any, n: int, delay: float) -> float:
    """P3 through torch: rank 0's exit time -> wait() returns."""
    with StampFile() as stamp, torch_call() as log_dir:
        pc = _start(
            tmp, "tp3", _workers.fail_first, {r: (r, delay, stamp.path) for r in range(n)}, log_dir
        )
        result = pc.wait(period=TORCH_POLL_PERIOD)
        t_end = time.time()
        pids = pc.pids()
        assert_gone([pids[r] for r in range(1, n)], "P3 torch: after wait()")
        if result is None or 0 not in result.failures:
            raise AssertionError(f"P3 torch: rank 0 should have failed: {result}")
        return t_end - stamp.read()


def torch_close(tmp: Any, n: int) -> float:
    """P6 through torch: close() of ``n`` workers blocked in their function."""
    with ReadyFifo(n) as fifo, torch_call() as log_dir:
        pc = _start(
            tmp, "tp6", _workers.ready_then_sleep, {r: (fifo.path,) for r in range(n)}, log_dir
        )
        try:
            fifo.wait_blocking(READY_TIMEOUT)
            t0 = time.perf_counter()
            pc.close()
            dt = time.perf_counter() - t0
        finally:
            pc.close()
        assert_gone(list(pc.pids().values()), "P6 torch: after close()")
        return dt


async def aioproc_run(entrypoint: Any, n: int) -> float:
    """aioproc's whole life cycle for the same workload: start -> wait -> close."""
    args: dict[int, tuple[Any, ...]] = {r: ((r,) if callable(entrypoint) else ()) for r in range(n)}
    t0 = time.perf_counter()
    async with aioproc.start_processes("tp", entrypoint, args, {r: {} for r in range(n)}) as pc:
        result = await pc.wait()
    dt = time.perf_counter() - t0
    if result is None or result.is_failed():
        raise AssertionError(f"aioproc: group failed: {result}")
    return dt


def _rows(
    cfg: Config,
    bench: str,
    baseline: Callable[[], float],
    candidate: Callable[[], Any],
    rounds: int,
) -> list[Row]:
    series = interleaved_sync_baseline(cfg, baseline, candidate, rounds)
    return rows_from(
        f"{bench} (aioproc vs torch)",
        series,
        None,  # no target: torch is a reference point, not a bar
        note=f"baseline: torch {rounds} rounds, wait(period={TORCH_POLL_PERIOD})",
    )


def torch_rows(cfg: Config) -> list[Row] | str:
    """The comparison rows, or the reason they were skipped."""
    tmp = torch_mp()
    if tmp is None:
        return "torch not installed: skipped"
    import torch

    fn_n, p2_n, tr = cfg.torch_fn_n, cfg.p2_ns[-1] if cfg.quick else 256, cfg.torch_rounds
    delay = cfg.p3_delay
    rows: list[Row] = []
    rows += _rows(
        cfg,
        f"P1 {fn_n} function workers: start -> results -> closed",
        lambda: torch_run(tmp, _workers.ret_rank, fn_n),
        lambda: aioproc_run(_workers.ret_rank, fn_n),
        tr,
    )
    rows += _rows(
        cfg,
        f"P2 {p2_n} binary workers {TRUE}: start -> done -> closed",
        lambda: torch_run(tmp, TRUE, p2_n),
        lambda: aioproc_run(TRUE, p2_n),
        max(tr, min(cfg.rounds, 5)),  # binaries are cheap: more rounds
    )
    rows += _rows(
        cfg,
        f"P3 {fn_n} function workers: rank 0 exit -> wait() returns",
        lambda: torch_failure(tmp, fn_n, delay),
        lambda: aioproc_failure(fn_n, delay),
        tr,
    )
    rows += _rows(
        cfg,
        f"P6 close() of {fn_n} running function workers",
        lambda: torch_close(tmp, fn_n),
        lambda: aioproc_close(fn_n),
        tr,
    )
    for r in rows:
        r.note += f"; torch {torch.__version__}"
    return rows
