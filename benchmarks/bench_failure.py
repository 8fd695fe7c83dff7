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

The floor row adds, by hand, what the stop promises beyond that baseline:
nothing a worker left in its process group survives, and no signal goes
to a recycled pid.  Each worker leads its own session; the leaders are
watched with pidfds and stay unreaped zombies (their group ids cannot be
recycled) until ``/proc`` is scanned for live members of their groups and
a SIGKILL has swept each group; only then are they reaped.  aioproc does
this and more (records, error files, pipes, the guardian), so the floor
is what any stop with these promises costs on this host.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time

import _workers
from _util import Config, Row, Series, Target, assert_gone, interleaved_all, rows_from

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


def _live_members(pgids: set[int]) -> list[int]:
    """Live processes in ``pgids`` other than the leaders (one ``/proc`` scan)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in pgids:
            continue
        try:
            if os.getpgid(int(name)) not in pgids:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        if stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z":
            found.append(int(name))
    return found


async def guarded_failure(n: int, delay: float) -> float:
    loop = asyncio.get_running_loop()
    with StampFile() as stamp:
        procs = [
            subprocess.Popen(
                _workers.script("fail_first", str(r), str(delay), stamp.path),
                start_new_session=True,
            )
            for r in range(n)
        ]
        fds = [os.pidfd_open(p.pid) for p in procs]
        exits = [loop.create_future() for _ in procs]
        for fd, fut in zip(fds, exits, strict=True):
            loop.add_reader(fd, lambda f=fut: f.done() or f.set_result(None))
        try:
            await asyncio.wait(exits, return_when=asyncio.FIRST_COMPLETED)
            for p in procs:  # exited leaders too: what they left is in their group
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
            await asyncio.wait(exits)
            pgids = {p.pid for p in procs}
            assert _live_members(pgids) == []  # nothing left: no wait for descendants
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            for p in procs:
                _, status = os.waitpid(p.pid, 0)
                p.returncode = os.waitstatus_to_exitcode(status)
            t_end = time.time()
        finally:
            for fd in fds:
                loop.remove_reader(fd)
                os.close(fd)
            for p in procs:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        if procs[0].returncode != 1:
            raise AssertionError(f"P3 floor: rank 0 exit code {procs[0].returncode}")
        assert_gone([p.pid for p in procs[1:]], "P3 floor")
        return t_end - stamp.read()


def p3(cfg: Config) -> list[Row]:
    n, delay = cfg.p3_n, cfg.p3_delay
    # the three stops in every round: the floor row and the aioproc rows
    # then compare the same rounds
    raw, floor, ours = 0, 1, 2
    runs = interleaved_all(
        cfg,
        [
            lambda: raw_failure(n, delay),
            lambda: guarded_failure(n, delay),
            lambda: aioproc_failure(n, delay),
        ],
    )

    def pair(base: int, cand: int) -> dict[str, tuple[Series, Series]]:
        return {loop: (series[base], series[cand]) for loop, series in runs.items()}

    return (
        rows_from(
            f"P3 {n} function workers: rank 0 exit -> wait() returns, all gone",
            pair(raw, ours),
            Target("max", 0.010, "ms"),
            note="baseline: raw subprocesses, first exit -> SIGTERM rest -> all awaited",
        )
        + rows_from(
            f"P3 {n} workers: the no-orphans floor against raw",
            pair(raw, floor),
            None,
            note="info: the raw baseline plus, by hand, the stop's group scan, sweep and late reap",
        )
        + rows_from(
            f"P3 {n} function workers: aioproc against the no-orphans floor",
            pair(floor, ours),
            None,
            note="info: baseline: the floor row's stop (the same rounds as the rows above)",
        )
    )
