"""Where P6's ``close()`` of 64 workers spends its time against the exits alone.

    python benchmarks/bench_close_split.py [--rounds N] [--loop asyncio|uvloop|both]

A diagnosis, not a target check.  Per loop, interleaved round by round, the
same 64 workers as P6 (``_workers.ready_then_sleep``, all inside their
function when the clock starts):

- ``exits, raw workers``: plain interpreters as in P6's baseline, SIGTERMed
  one after the other by a plain loop over ``os.kill``, then waited for
  with one blocking ``poll`` over their pidfds (readable once a process has
  exited): the kernel's work alone, no event loop turn until all are gone;
- ``exits, aioproc workers``: the same for aioproc's function workers (own
  process group, ``os.killpg``), which ``close()`` then finds exited;
- ``P6 raw``: P6's baseline (``send_signal`` each, then ``await`` all);
- ``P6 close()``: P6's candidate.

The first two rows are the floor for each kind of worker on this machine:
what ``close()`` adds is the last row minus the second, what the kind of
worker adds is the second row minus the first.  Medians over rounds, in ms.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

from _util import LOOPS, run_on, uvloop_available
from bench_close import READY_TIMEOUT, aioproc_close, aioproc_workers, raw_close, raw_workers

N = 64


def _kill_and_wait(pids: list[int], kill: Callable[[int, int], None]) -> float:
    """SIGTERM every pid, then block until every one has exited; seconds taken."""
    fds = [os.pidfd_open(pid) for pid in pids]
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        left = len(fds)
        t0 = time.perf_counter()
        for pid in pids:
            kill(pid, signal.SIGTERM)
        while left:
            for fd, _ in poller.poll(READY_TIMEOUT * 1000):
                poller.unregister(fd)
                left -= 1
        return time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)


async def raw_exits(n: int) -> float:
    async with raw_workers(n) as procs:
        return _kill_and_wait([p.pid for p in procs], os.kill)


async def aioproc_exits(n: int) -> float:
    async with aioproc_workers(n) as pc:
        # each worker leads its own group, which close() signals
        return _kill_and_wait(list(pc.pids().values()), os.killpg)


ROWS: dict[str, Callable[[int], Awaitable[float]]] = {
    "exits, raw workers": raw_exits,
    "exits, aioproc workers": aioproc_exits,
    "P6 raw": raw_close,
    "P6 close()": aioproc_close,
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--loop", choices=(*LOOPS, "both"), default="both")
    args = parser.parse_args(argv)
    loops: tuple[str, ...] = LOOPS if args.loop == "both" else (args.loop,)
    if "uvloop" in loops and not uvloop_available():
        loops = tuple(lp for lp in loops if lp != "uvloop")
    print(f"- {N} workers, {args.rounds} rounds (+1 warm-up), medians in ms")
    print()
    print("| loop | what | time |")
    print("|---|---|---|")
    for loop in loops:

        async def rounds() -> dict[str, list[float]]:
            times: dict[str, list[float]] = {name: [] for name in ROWS}
            for i in range(args.rounds + 1):
                for name, fn in ROWS.items():
                    dt = await fn(N)
                    if i:  # the first round warms the caches up
                        times[name].append(dt)
            return times

        times = run_on(loop, rounds)
        for name, samples in times.items():
            print(f"| {loop} | {name} | {statistics.median(samples) * 1e3:.1f} |")
    print()
    print(f"- python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
