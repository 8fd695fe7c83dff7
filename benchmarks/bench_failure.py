"""P3: from the first worker's failure to ``wait()`` returning with the group gone.

N function workers; rank 0 dies (``os._exit(1)``) after a delay, the others
sleep and die of the default SIGTERM action.  The figure is
``time.time()`` in the parent right after ``wait()`` returns minus the
``time.time()`` rank 0 wrote just before exiting.  When ``wait()`` returns,
every other worker must be gone and reaped (``os.kill(pid, 0)`` raises
``ProcessLookupError``).

Baseline: the same workers as raw subprocesses; the parent awaits the first
exit, SIGTERMs the rest and awaits them: the floor of an event-driven
all-or-nothing stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time

import _workers
from _util import Config, Row, Target, assert_gone, interleaved, rows_from

import aioproc


class StampFile:
    """A private path where rank 0 writes its exit time."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="aioproc-bench-")
        self.path = os.path.join(self._dir, "exit-time")

    def read(self) -> float:
        with open(self.path) as f:
            return float(f.read())

    def __enter__(self) -> StampFile:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


async def aioproc_failure(n: int, delay: float) -> float:
    with StampFile() as stamp:
        pc = await aioproc.start_processes(
            "p3",
            _workers.fail_first,
            args={r: (r, delay, stamp.path) for r in range(n)},
            envs={r: {} for r in range(n)},
        )
        try:
            result = await pc.wait()
            t_end = time.time()
            pids = pc.pids()
            assert_gone([pids[r] for r in range(1, n)], "P3 aioproc: after wait()")
        finally:
            await pc.close()
        assert result is not None
        if 0 not in result.failures or result.failures[0].exitcode != 1:
            raise AssertionError(f"P3: rank 0 should fail with exit code 1: {result.failures}")
        return t_end - stamp.read()


async def raw_failure(n: int, delay: float) -> float:
    with StampFile() as stamp:
        procs = [
            await asyncio.create_subprocess_exec(
                *_workers.script("fail_first", str(r), str(delay), stamp.path)
            )
            for r in range(n)
        ]
        waits = [asyncio.ensure_future(p.wait()) for p in procs]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for p in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.send_signal(signal.SIGTERM)
            await asyncio.gather(*waits)
            t_end = time.time()
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
            await asyncio.gather(*waits, return_exceptions=True)
        if procs[0].returncode != 1:
            raise AssertionError(f"P3 baseline: rank 0 exit code {procs[0].returncode}")
        assert_gone([p.pid for p in procs[1:]], "P3 baseline")
        return t_end - stamp.read()


def p3(cfg: Config) -> list[Row]:
    n, delay = cfg.p3_n, cfg.p3_delay
    series = interleaved(cfg, lambda: raw_failure(n, delay), lambda: aioproc_failure(n, delay))
    return rows_from(
        f"P3 {n} function workers: rank 0 exit -> wait() returns, all gone",
        series,
        Target("max", 0.010, "ms"),
        note="baseline: raw subprocesses, first exit -> SIGTERM rest -> all awaited",
    )
