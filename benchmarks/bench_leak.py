"""Leak check: many start/close cycles leave the fd and child counts unchanged.

Each cycle starts 2 ``/bin/true`` binary workers and closes the group at once
(so some cycles stop still-running workers, some find them exited).  The
counts are taken after a few warm-up cycles (the loop's own lazily created
fds) and after all cycles, inside one event loop per loop kind.
"""

from __future__ import annotations

from _util import Config, Row, Target, child_pids, fd_count, os_thread_count, run_on

import aioproc

WARMUP_CYCLES = 5


async def cycle() -> None:
    pc = await aioproc.start_processes(
        "leak", "/bin/true", args={0: (), 1: ()}, envs={0: {}, 1: {}}
    )
    await pc.close()


async def leak_counts(cycles: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    for _ in range(WARMUP_CYCLES):
        await cycle()
    before = (fd_count(), len(child_pids()), os_thread_count())
    for _ in range(cycles):
        await cycle()
    after = (fd_count(), len(child_pids()), os_thread_count())
    return before, after


def leak(cfg: Config) -> list[Row]:
    rows: list[Row] = []
    n = cfg.leak_cycles
    for loop in cfg.loops:
        before, after = run_on(loop, lambda: leak_counts(n))
        for i, what in enumerate(("open fds", "child processes")):
            rows.append(
                Row(
                    f"leak: {what} after {n} start/close cycles (2 x /bin/true)",
                    loop,
                    after[i],
                    before[i],
                    what.split()[-1],
                    Target("equal"),
                    note=f"before {before[i]}, after {after[i]}; threads {before[2]} -> {after[2]}",
                    timed=False,
                )
            )
    return rows
