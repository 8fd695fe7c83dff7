"""P6: ``close()`` of N running function workers that exit on SIGTERM.

Every worker runs ``_workers.ready_then_sleep``: it writes one byte to a FIFO
(see ``_util.ReadyFifo`` for why a FIFO) and then blocks in ``time.sleep``.
The clock starts only when all N bytes have arrived, i.e. every worker is
inside its function, and stops when ``await pc.close()`` returns; then every
worker must be gone and reaped.

Baseline: the same workers as raw subprocesses; SIGTERM to each, then await
them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import tempfile
import time
from collections.abc import AsyncIterator

import _workers
from _util import Config, ReadyFifo, Row, Target, assert_gone, interleaved, rows_from

import aioproc

READY_TIMEOUT = 60.0


@contextlib.asynccontextmanager
async def aioproc_workers(n: int, log_dir: str | None = None) -> AsyncIterator[aioproc.PContext]:
    """P6's group, every worker inside its function; closed on the way out."""
    with ReadyFifo(n) as fifo:
        pc = await aioproc.start_processes(
            "p6",
            _workers.ready_then_sleep,
            args={r: (fifo.path,) for r in range(n)},
            envs={r: {} for r in range(n)},
            logs_specs=aioproc.DefaultLogsSpecs(log_dir),
        )
        try:
            await fifo.wait(READY_TIMEOUT)
            if pc.poll() is not None:
                raise AssertionError(f"P6: workers ended before close(): {pc.poll()}")
            yield pc
        finally:
            await pc.close()


@contextlib.asynccontextmanager
async def raw_workers(n: int) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """P6's baseline processes, each inside its function; killed and awaited on the way out."""
    with ReadyFifo(n) as fifo:
        procs = [
            await asyncio.create_subprocess_exec(
                *_workers.script("ready_then_sleep", fifo.path, "60")
            )
            for _ in range(n)
        ]
        try:
            await fifo.wait(READY_TIMEOUT)
            yield procs
        finally:
            for p in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            await asyncio.gather(*(p.wait() for p in procs))


async def aioproc_close(n: int, log_dir: str | None = None) -> float:
    async with aioproc_workers(n, log_dir) as pc:
        t0 = time.perf_counter()
        await pc.close()
        dt = time.perf_counter() - t0
    assert_gone(list(pc.pids().values()), "P6 aioproc: after close()")
    return dt


async def raw_close(n: int) -> float:
    async with raw_workers(n) as procs:
        t0 = time.perf_counter()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        await asyncio.gather(*(p.wait() for p in procs))
        dt = time.perf_counter() - t0
    assert_gone([p.pid for p in procs], "P6 baseline")
    return dt


def p6(cfg: Config) -> list[Row]:
    n = cfg.p6_n
    series = interleaved(cfg, lambda: raw_close(n), lambda: aioproc_close(n))
    rows = rows_from(
        f"P6 close() of {n} running function workers",
        series,
        Target("ratio", 1.1),  # a ratio: an absolute limit depends on the machine
        note="baseline: raw subprocesses, SIGTERM each -> all awaited",
    )
    # the same with a log_dir of the caller's, which close() never prunes:
    # what the stop costs apart from pruning the temp dir
    with tempfile.TemporaryDirectory(prefix="p6-logs-") as given:
        series = interleaved(cfg, lambda: raw_close(n), lambda: aioproc_close(n, given))
    return rows + rows_from(
        f"P6 close() of {n} running function workers, log_dir given (nothing pruned)",
        series,
        None,
        note="info: P6 less the temp dir's prune; baseline as above",
    )
