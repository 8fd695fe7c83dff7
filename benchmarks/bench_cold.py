"""Cold start: how long the first ``start_processes`` of a process holds its loop.

    python benchmarks/bench_cold.py [--rounds N] [--loop asyncio|uvloop|both]

``import aioproc`` loads nothing heavy, so the first group a process starts
imports and compiles the rest (anyio's asyncio backend, the boot code of
function workers) on the running loop.  ``aioproc.preimport()`` does that
at start-up instead.  Each round runs a fresh interpreter (``--child``) that
imports ``start_processes``, optionally calls ``preimport()``, then starts
and closes one group on a loop whose heartbeat (a ``call_soon`` chain, so
it works on uvloop too) records the longest gap between two beats: the
longest stretch the loop ran something else.  A second group in the same
process is the reference (everything warm).

Rows: the first start's longest hold without and with ``preimport()``
(target <= 5 ms with it), each against the second start's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from _util import Config, Row, Sample, Series, Target, rows_from, standalone_main

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("function", "binary")


def _child(argv: list[str]) -> None:
    """``--child LOOP PRE KIND``: print the first and second start's longest hold (s)."""
    loop_name, pre, kind = argv
    sys.path.insert(0, os.path.dirname(HERE))
    import asyncio

    import aioproc
    from aioproc import start_processes

    if pre == "pre":
        aioproc.preimport()
    longest = [0.0]

    def beat(loop: asyncio.AbstractEventLoop, last: float) -> None:
        now = time.perf_counter()
        longest[0] = max(longest[0], now - last)
        loop.call_soon(beat, loop, now)

    def ret(rank: int) -> int:
        return rank

    async def one() -> float:
        longest[0] = 0.0
        if kind == "function":
            pc = await start_processes("cold", ret, args={0: (0,)}, envs={0: {}})
        else:
            pc = await start_processes("cold", "/bin/true", args={0: ()}, envs={0: {}})
        result = await pc.wait()
        await pc.close()
        if result is None or result.failures:
            raise AssertionError(f"cold start: {result}")
        return longest[0]

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        loop.call_soon(beat, loop, time.perf_counter())
        await asyncio.sleep(0.01)  # the heartbeat runs before the clock starts
        return await one(), await one()

    if loop_name == "uvloop":
        import uvloop

        first, second = uvloop.run(main())
    else:
        first, second = asyncio.run(main())
    print(json.dumps({"first": first, "second": second}))


def _measure(loop: str, pre: str, kind: str) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", loop, pre, kind],
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["first"], got["second"]


def cold(cfg: Config) -> list[Row]:
    rows: list[Row] = []
    for kind in KINDS:
        for pre, label, target in (
            ("nopre", "without preimport()", None),
            ("pre", "after preimport()", Target("max", 0.005, "ms")),
        ):
            series: dict[str, tuple[Series, Series]] = {}
            for loop in cfg.loops:
                base, cand = Series(), Series()
                for _ in range(cfg.rounds):
                    first, second = _measure(loop, pre, kind)
                    base.samples.append(Sample(second, 0.0, 0.0))
                    cand.samples.append(Sample(first, 0.0, 0.0))
                series[loop] = (base, cand)
            rows += rows_from(
                f"cold: longest loop hold of a process's first start, {kind} worker, {label}",
                series,
                target,
                note="baseline: the second start in the same process; "
                f"median of {cfg.rounds} fresh interpreters",
            )
    return rows


if __name__ == "__main__":
    standalone_main(__doc__, cold, _child)
