"""P5: the supervisor's thread count with N live workers, for two N.

N binary workers ``sleep 30`` are started; once ``start_processes`` returns
(every worker launched and watched) the parent's threads are counted, both
as the OS sees them (``Threads:`` in ``/proc/self/status``) and as
``threading.active_count()``; then the group is closed.  The baseline is the
same count with the loop running and no worker.  The target is absolute
(<= 4 OS threads), and the two sizes together show it does not grow with N.
"""

from __future__ import annotations

import threading

from _util import Config, Row, Series, Target, interleaved, os_thread_count, rows_from

import aioproc

SLEEP = "sleep"


async def idle_threads() -> float:
    return float(os_thread_count())


class ThreadProbe:
    """Candidate measurement; remembers ``threading.active_count()`` too."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.py_threads: list[int] = []

    async def __call__(self) -> float:
        n = self.n
        pc = await aioproc.start_processes(
            "p5", SLEEP, args={r: ("30",) for r in range(n)}, envs={r: {} for r in range(n)}
        )
        try:
            if pc.poll() is not None:
                raise AssertionError("P5: workers ended early")
            count = os_thread_count()
            self.py_threads.append(threading.active_count())
        finally:
            await pc.close()
        return float(count)


def p5(cfg: Config) -> list[Row]:
    rows: list[Row] = []
    rounds = max(1, min(cfg.rounds, 3))  # a count, not a time: few rounds suffice
    for n in cfg.p5_ns:
        probe = ThreadProbe(n)
        series: dict[str, tuple[Series, Series]] = interleaved(
            cfg, idle_threads, probe, rounds=rounds
        )
        rows += rows_from(
            f"P5 parent OS threads, {n} live workers",
            series,
            Target("max", 4, "threads"),
            unit="threads",
            note=f"baseline: no worker; threading.active_count() max {max(probe.py_threads)}",
            timed=False,
        )
    return rows
