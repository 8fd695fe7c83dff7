"""Launch 4 function workers and 2 binary workers, supervise them, print results.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import asyncio
import os
import sys

import aioproc
from aioproc import DefaultLogsSpecs, Std


def square(x: int) -> dict[str, int]:
    """A function worker: runs in its own interpreter, returns a picklable value."""
    return {"rank": int(os.environ["RANK"]), "pid": os.getpid(), "square": x * x}


async def main() -> None:
    # 4 function workers, all-or-nothing: results by local rank
    result = await aioproc.run(
        square,
        nprocs=4,
        args={r: (r + 1,) for r in range(4)},
        envs={r: {"RANK": str(r)} for r in range(4)},
    )
    for rank, value in result.return_values.items():
        print(f"function worker {rank}: {value}")

    # 2 binary workers whose stdout is tee'd: prefixed on the console and kept in files
    specs = DefaultLogsSpecs(tee=Std.OUT)
    async with aioproc.start_processes(
        "bin",
        sys.executable,
        args={r: ("-c", f"print('hello from binary worker {r}')") for r in range(2)},
        envs={r: {} for r in range(2)},
        logs_specs=specs,
    ) as pc:
        result2 = await pc.wait()
    assert result2 is not None
    for rank, path in result2.stdouts.items():
        with open(path) as f:
            print(f"binary worker {rank}: exit ok, stdout.log = {f.read().strip()!r}")

    # a failure is reported with the worker's own traceback
    try:
        await aioproc.run(int, nprocs=2, args=("not a number",))
    except aioproc.ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"root cause: local rank {rank} exited {failure.exitcode}: {e.__cause__!r}")


if __name__ == "__main__":
    asyncio.run(main())
