"""A supervisor for the stuck-console and backpressure tests, run in a subprocess of its own.

    out_pressure.py stall LOG_DIR LOOP   stdout is a pipe nobody reads
    out_pressure.py rss LOG_DIR LOOP MB  MB through tee to a slow async sink

``stall``: one worker floods its tee'd stdout forever; a timer task measures
how late its wake-ups are for a second, then the group is closed.
``rss``: one worker writes MB megabytes of numbered lines; an async sink that
yields to the loop on every line checks that every line arrives, in order.
Either prints one line ``RESULT {json}`` on stderr.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sys
import time

import aioproc
from aioproc import DefaultLogsSpecs, OutputLine, Std

FLOOD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out_flood.py")
LINE = 1000  # bytes per line out_flood.py writes


def vm(field: str) -> int:
    """A ``/proc/self/status`` figure in kB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise LookupError(field)


async def stall(log_dir: str) -> dict[str, object]:
    spec = DefaultLogsSpecs(log_dir=log_dir, tee=Std.OUT)
    pc = await aioproc.start_processes(
        "w", sys.executable, {0: (FLOOD, "0", str(LINE))}, {0: {}}, spec
    )
    worst = 0.0
    t_end = time.monotonic() + 1.0
    while time.monotonic() < t_end:
        t0 = time.monotonic()
        await asyncio.sleep(0.01)
        worst = max(worst, time.monotonic() - t0 - 0.01)
    pid = pc.pids()[0]
    t0 = time.monotonic()
    await pc.close()
    return {
        "max_late": worst,
        "close_s": time.monotonic() - t0,
        "log_bytes": os.path.getsize(pc.stdouts[0]),
        "pid_gone": not os.path.exists(f"/proc/{pid}"),
        "stdout_nonblocking": bool(fcntl.fcntl(1, fcntl.F_GETFL) & os.O_NONBLOCK),
    }


async def rss(log_dir: str, mb: int) -> dict[str, object]:
    n = mb * (1 << 20) // LINE
    got = 0
    disorder = 0

    async def slow(rec: OutputLine) -> None:
        nonlocal got, disorder
        if int(rec.line[:8]) != got:
            disorder += 1
        got += 1
        await asyncio.sleep(0)

    base = vm("VmRSS")
    spec = DefaultLogsSpecs(log_dir=log_dir, tee=Std.OUT)
    async with aioproc.start_processes(
        "w", sys.executable, {0: (FLOOD, str(n), str(LINE))}, {0: {}}, spec, sinks=[slow]
    ) as pc:
        result = await pc.wait()
        log_bytes = os.path.getsize(pc.stdouts[0])
    return {
        "base_kb": base,
        "hwm_kb": vm("VmHWM"),
        "lines": got,
        "want": n,
        "disorder": disorder,
        "failed": result is None or result.is_failed(),
        "log_bytes": log_bytes,
        "want_bytes": n * LINE,
    }


def main() -> None:
    mode, log_dir, loop = sys.argv[1:4]
    coro = stall(log_dir) if mode == "stall" else rss(log_dir, int(sys.argv[4]))
    if loop == "uvloop":
        import uvloop

        out = uvloop.run(coro)
    else:
        out = asyncio.run(coro)
    print("RESULT " + json.dumps(out), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
