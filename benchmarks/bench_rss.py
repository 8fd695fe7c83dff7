"""RSS: the supervisor's peak memory with a slow async sink (backpressure).

One binary worker writes 1 GB of numbered 1000-byte lines to a tee'd stdout;
the only sink is an async callback that yields to the event loop on every
line, so it is slower than the worker.  Without backpressure the lines pile
up in the supervisor (peak RSS about the data size); with it the worker is
paused while the sink's queue is full.

Each round runs the supervisor in a fresh subprocess (``--child``) and reads
its ``VmHWM`` (peak resident memory) at the end; the baseline is its
``VmRSS`` before the group starts (interpreter + aioproc).  Every round
checks that every line reached the sink, in order, and the log file is
complete.  Figures are medians over rounds.

Target: peak RSS < 100 MB.  ``--quick`` (CI): 100 MB of output, one round.

    python benchmarks/bench_rss.py [--quick] [--rounds N] [--loop asyncio|uvloop|both]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from _util import Config, Row, Target, standalone_main

LINE = 1000  # bytes per line, newline included
WORKER = (
    "import os, sys\n"
    "n, width = int(sys.argv[1]), int(sys.argv[2])\n"
    "pad = b'.' * (width - 9)\n"
    "batch = 64\n"
    "for start in range(0, n, batch):\n"
    "    stop = min(n, start + batch)\n"
    "    chunk = b''.join(b'%08d' % i + pad + b'\\n' for i in range(start, stop))\n"
    "    view = memoryview(chunk)\n"
    "    while view:\n"
    "        view = view[os.write(1, view):]\n"
)


def _vm(field: str) -> int:
    """A ``/proc/self/status`` figure, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise LookupError(field)


async def _child_main(mb: int, log_dir: str) -> dict[str, object]:
    import asyncio

    import aioproc
    from aioproc import DefaultLogsSpecs, OutputLine, Std

    n = mb * (1 << 20) // LINE
    got = 0
    disorder = 0

    async def slow(rec: OutputLine) -> None:
        nonlocal got, disorder
        if int(rec.line[:8]) != got:
            disorder += 1
        got += 1
        await asyncio.sleep(0)

    base = _vm("VmRSS")
    spec = DefaultLogsSpecs(log_dir=log_dir, tee=Std.OUT)
    args = {0: ("-c", WORKER, str(n), str(LINE))}
    async with aioproc.start_processes(
        "rss", sys.executable, args, {0: {}}, spec, sinks=[slow]
    ) as pc:
        result = await pc.wait()
        complete = os.path.getsize(pc.stdouts[0]) == n * LINE
    ok = result is not None and not result.is_failed() and got == n and not disorder and complete
    return {"base": base, "peak": _vm("VmHWM"), "ok": ok, "lines": got, "want": n}


def _child(loop: str, mb: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import asyncio

    with tempfile.TemporaryDirectory(prefix="bench-rss-") as logs:
        if loop == "uvloop":
            import uvloop

            out = uvloop.run(_child_main(mb, logs))
        else:
            out = asyncio.run(_child_main(mb, logs))
    print(json.dumps(out), flush=True)


def measure(loop: str, mb: int) -> tuple[float, float]:
    """(peak RSS, RSS before the group), in MB, of one supervisor run."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", loop, str(mb)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"supervisor failed: {proc.stderr[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if not res["ok"]:
        raise AssertionError(f"lines lost or reordered: {res}")
    return res["peak"] / 2**20, res["base"] / 2**20


def rss(cfg: Config) -> list[Row]:
    mb = 100 if cfg.quick else 1024
    rounds = 1 if cfg.quick else max(1, cfg.rounds // 3)
    rows = []
    for loop in cfg.loops:
        samples = [measure(loop, mb) for _ in range(rounds)]
        peak = statistics.median(s[0] for s in samples)
        base = statistics.median(s[1] for s in samples)
        rows.append(
            Row(
                f"RSS: parent peak, {mb} MB through tee to a slow async sink",
                loop,
                round(peak, 1),
                round(base, 1),
                "MB",
                Target("max", 100, "MB"),
                note=f"baseline: RSS before the group; median of {rounds} run(s); "
                "every line checked",
                timed=False,
            )
        )
    return rows


def main() -> None:
    standalone_main(__doc__ or "", rss, lambda argv: _child(argv[0], int(argv[1])))


if __name__ == "__main__":
    main()
