"""Fault injection: a supervisor SIGKILLed at random moments, cancellation at random points.

The promise under test: whatever happens to the supervisor or to the task
driving a group, no worker and no worker's descendant outlives it, and
nothing (fd, thread, temp dir) is left in the supervisor.

A worker's pid is known to the supervisor only once it is started, and a
grandchild's never, so every worker and grandchild carries a marker in its
environment and reports its own pid to a file; after each fault the test
waits (pidfds, bounded) until no reported pid and no process on the machine
carrying the marker still runs.  The cancellation soak is
``benchmarks/soak_cancel.py`` with fewer iterations.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from helpers import CHILDREN_DIR, REPO_ROOT, loop_name, release_fifo
from proc_utils import Fifo

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import soak_cancel
from soak_cancel import clean_up, describe, reported_pids, survivors

SUPERVISOR = os.path.join(CHILDREN_DIR, "fault_supervisor.py")
# the supervisor must import this checkout's aioproc, not an installed one
SUPERVISOR_ENV = {**os.environ, "PYTHONPATH": REPO_ROOT}
SIGKILL_ITERATIONS = 5  # per phase and per event loop: 10 per phase in all
START_ITERATIONS = 8  # the start phase gets more: an orphan needs a kill inside a launch
SOAK_ITERATIONS = 40  # per event loop: 80 in all
RUN_WORKERS = 12  # chatty workers of fault_supervisor.py's run mode
SEED = int(os.environ.get("AIOPROC_FAULT_SEED", random.randrange(1 << 30)))


async def kill_supervisor_at_random(
    tmp_path: Path, mode: str, ready: str, max_delay: float, iterations: int
) -> list[str]:
    """Start ``fault_supervisor.py <mode>``, SIGKILL it 0..``max_delay`` s after it
    says ``ready``, and return a line for every process that outlived it.

    In ``run`` mode the workers start chattering when the test opens their gate.
    """
    rng = random.Random(f"{SEED}-{mode}-{loop_name()}")
    problems: list[str] = []
    for i in range(iterations):
        mark = uuid.uuid4().hex
        report = str(tmp_path / f"report-{i}")
        with release_fifo(f"{report}.gate") as go:
            async with Fifo(tmp_path / f"status-{i}") as status:
                sup = subprocess.Popen(
                    [sys.executable, SUPERVISOR, mode, loop_name(), status.path, report, mark],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    env={**SUPERVISOR_ENV, "TMPDIR": str(tmp_path)},  # kept logs go there
                )
                delay = rng.uniform(0, max_delay)
                try:
                    assert await status.lines(1, timeout=30) == [ready]
                    go(RUN_WORKERS)
                    await asyncio.sleep(delay)  # the random moment of the fault
                finally:
                    sup.kill()
                    sup.wait(timeout=10)
        alive = await survivors(mark, reported_pids(report))
        if alive:
            problems.append(
                f"{mode} #{i}, SIGKILL {delay:.3f} s after {ready!r}: still running "
                + ", ".join(describe(p) for p in sorted(alive))
            )
            await clean_up(mark, alive)
        shutil.rmtree(f"{report}.logs", ignore_errors=True)
    return problems


async def test_supervisor_sigkilled_while_starting_leaves_no_process(tmp_path: Path) -> None:
    # 64 binary workers then 4 function workers take some 0.1-0.2 s to launch
    problems = await kill_supervisor_at_random(
        tmp_path, "start", "starting", 0.15, START_ITERATIONS
    )
    assert problems == [], f"seed {SEED}:\n" + "\n".join(problems)


async def test_supervisor_sigkilled_while_teeing_heavy_output_leaves_no_process(
    tmp_path: Path,
) -> None:
    problems = await kill_supervisor_at_random(tmp_path, "run", "running", 0.3, SIGKILL_ITERATIONS)
    assert problems == [], f"seed {SEED}:\n" + "\n".join(problems)


async def test_supervisor_sigkilled_while_closing_leaves_no_process(tmp_path: Path) -> None:
    # half the binary workers ignore SIGTERM: close() takes its 1 s grace, then SIGKILLs
    problems = await kill_supervisor_at_random(
        tmp_path, "close", "closing", 1.2, SIGKILL_ITERATIONS
    )
    assert problems == [], f"seed {SEED}:\n" + "\n".join(problems)


async def test_cancelling_start_wait_close_at_random_points_leaves_nothing() -> None:
    found = await soak_cancel.soak(SOAK_ITERATIONS, SEED)
    assert found.total() == 0, f"seed {SEED} on {loop_name()}: {found.summary()}\n" + "\n".join(
        found.details
    )
    assert found.iterations == SOAK_ITERATIONS
