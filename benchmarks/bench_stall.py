"""Stall: the longest event-loop stall while the supervisor's stdout is stuck.

The supervisor runs in a subprocess (``--child``) whose stdout is a pipe
nobody reads.  One worker floods its tee'd stdout (100-byte lines) to the
default ``ConsoleSink``.  A timer task sleeps 1 ms at a time and records
how late each wake-up is; the largest lateness is the longest stall of the
loop (exit detection, timers and signals all wait that long).  Baseline:
the same measurement, same process, before the group starts (an idle loop).
Then the group is closed; its duration is noted.

Before the console writer was non-blocking the supervisor froze in write()
for good; target: max stall < 20 ms.  Figures are medians over rounds (one
fresh supervisor each).  ``--quick`` (CI): 1 s of measurement, 1 round.

    python benchmarks/bench_stall.py [--quick] [--rounds N] [--loop asyncio|uvloop|both]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from _util import Config, Row, Target, standalone_main

WORKER = (
    "import os\n"
    "chunk = b''.join(b'%08d' % i + b'.' * 91 + b'\\n' for i in range(655))\n"
    "while True:\n"
    "    view = memoryview(chunk)\n"
    "    while view:\n"
    "        view = view[os.write(1, view):]\n"
)


async def _worst_lateness(seconds: float) -> float:
    import asyncio
    import time

    worst = 0.0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        await asyncio.sleep(0.001)
        worst = max(worst, time.monotonic() - t0 - 0.001)
    return worst


async def _child_main(seconds: float, log_dir: str) -> dict[str, float]:
    import time

    import aioproc
    from aioproc import DefaultLogsSpecs, Std

    idle = await _worst_lateness(seconds)
    spec = DefaultLogsSpecs(log_dir=log_dir, tee=Std.OUT)
    pc = await aioproc.start_processes("stall", sys.executable, {0: ("-c", WORKER)}, {0: {}}, spec)
    try:
        stuck = await _worst_lateness(seconds)
    finally:
        t0 = time.monotonic()
        await pc.close()
        close_s = time.monotonic() - t0
    return {"idle": idle, "stuck": stuck, "close": close_s}


def _child(loop: str, seconds: float) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import asyncio
    import logging

    logging.disable(logging.WARNING)  # the dropped-lines warning is expected here
    with tempfile.TemporaryDirectory(prefix="bench-stall-") as logs:
        if loop == "uvloop":
            import uvloop

            out = uvloop.run(_child_main(seconds, logs))
        else:
            out = asyncio.run(_child_main(seconds, logs))
    print(json.dumps(out), file=sys.stderr, flush=True)


def measure(loop: str, seconds: float) -> dict[str, float]:
    r, w = os.pipe()  # the supervisor's stdout: never read
    try:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", loop, str(seconds)],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60 + 2 * seconds,
            check=False,
        )
    finally:
        os.close(r)
        os.close(w)
    if proc.returncode != 0:
        raise RuntimeError(f"supervisor failed: {proc.stderr[-2000:]}")
    res: dict[str, float] = json.loads(proc.stderr.strip().splitlines()[-1])
    return res


def stall(cfg: Config) -> list[Row]:
    seconds = 1.0 if cfg.quick else 3.0
    rounds = 1 if cfg.quick else max(1, cfg.rounds // 3)
    rows = []
    for loop in cfg.loops:
        samples = [measure(loop, seconds) for _ in range(rounds)]
        close_s = statistics.median(s["close"] for s in samples)
        rows.append(
            Row(
                "stall: max event-loop stall, stdout a stuck pipe, worker flooding tee",
                loop,
                statistics.median(s["stuck"] for s in samples),
                statistics.median(s["idle"] for s in samples),
                "ms",
                Target("max", 0.020, "ms"),
                note=f"baseline: idle loop; {seconds:g} s measured, median of {rounds} run(s); "
                f"close() took {close_s * 1e3:.0f} ms",
                timed=False,
            )
        )
    return rows


def main() -> None:
    standalone_main(__doc__ or "", stall, lambda argv: _child(argv[0], float(argv[1])))


if __name__ == "__main__":
    main()
