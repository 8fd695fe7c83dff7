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

Two more columns say whether the time is the CPUs' or the waits': the
benchmark process's own CPU over the window (``RUSAGE_SELF``: the loop and
aioproc's helper thread; the blocking ``poll`` rows spend next to none),
and the machine's idle CPU over it (``/proc/stat``, both CPUs, counted in
10 ms ticks, so a mean over rounds rather than a median).  When the
baseline leaves no CPU idle, whatever the supervisor spends beyond the
baseline's own CPU can only be paid for by a longer window: at best half
of it on two CPUs, all of it when spent after the last exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import select
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from _util import LOOPS, assert_gone, run_on, uvloop_available
from bench_close import READY_TIMEOUT, aioproc_workers, raw_workers

N = 64
_TICK = 1 / os.sysconf("SC_CLK_TCK")


@dataclass
class Window:
    """What one timed stop cost: wall time, own CPU, the machine's idle CPU (s)."""

    wall: float = 0.0
    cpu: float = 0.0
    idle: float = 0.0


def _idle() -> float:
    """Idle CPU since boot, all CPUs together, in seconds (``/proc/stat``)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = f.readline().split()
    return (int(fields[4]) + int(fields[5])) * _TICK  # idle + iowait


def _own_cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


@contextlib.contextmanager
def window() -> Iterator[Window]:
    """Time the block: wall, this process's CPU and the machine's idle CPU."""
    w = Window()
    idle0, cpu0, t0 = _idle(), _own_cpu(), time.perf_counter()
    yield w
    w.wall = time.perf_counter() - t0
    w.cpu, w.idle = _own_cpu() - cpu0, _idle() - idle0


def _kill_and_wait(pids: list[int], kill: Callable[[int, int], None]) -> Window:
    """SIGTERM every pid, then block until every one has exited."""
    fds = [os.pidfd_open(pid) for pid in pids]
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        left = len(fds)
        with window() as w:
            for pid in pids:
                kill(pid, signal.SIGTERM)
            while left:
                for fd, _ in poller.poll(READY_TIMEOUT * 1000):
                    poller.unregister(fd)
                    left -= 1
        return w
    finally:
        for fd in fds:
            os.close(fd)


async def raw_exits(n: int) -> Window:
    async with raw_workers(n) as procs:
        return _kill_and_wait([p.pid for p in procs], os.kill)


async def aioproc_exits(n: int) -> Window:
    async with aioproc_workers(n) as pc:
        # each worker leads its own group, which close() signals
        return _kill_and_wait(list(pc.pids().values()), os.killpg)


async def raw_close(n: int) -> Window:
    """P6's baseline, as ``bench_close.raw_close``."""
    async with raw_workers(n) as procs:
        with window() as w:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            await asyncio.gather(*(p.wait() for p in procs))
    return w


async def aioproc_close(n: int) -> Window:
    """P6's candidate, as ``bench_close.aioproc_close``."""
    async with aioproc_workers(n) as pc:
        with window() as w:
            await pc.close()
    assert_gone(list(pc.pids().values()), "P6 aioproc: after close()")
    return w


ROWS: dict[str, Callable[[int], Awaitable[Window]]] = {
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
    print(f"- {N} workers, {args.rounds} rounds (+1 warm-up), medians in ms (idle: mean)")
    print()
    print("| loop | what | time | own CPU | idle CPU (mean) |")
    print("|---|---|---|---|---|")
    for loop in loops:

        async def rounds() -> dict[str, list[Window]]:
            times: dict[str, list[Window]] = {name: [] for name in ROWS}
            for i in range(args.rounds + 1):
                for name, fn in ROWS.items():
                    w = await fn(N)
                    if i:  # the first round warms the caches up
                        times[name].append(w)
            return times

        times = run_on(loop, rounds)
        for name, ws in times.items():
            wall = statistics.median(w.wall for w in ws) * 1e3
            cpu = statistics.median(w.cpu for w in ws) * 1e3
            idle = statistics.mean(w.idle for w in ws) * 1e3
            print(f"| {loop} | {name} | {wall:.1f} | {cpu:.1f} | {idle:.1f} |")
    print()
    print(f"- python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
