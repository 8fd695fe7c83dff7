"""A supervisor that starts groups with per-rank limits, one after another, for crash tests.

argv: <backend> <kill_after>
    backend: "cgroup1" or "cgroup2", the only mechanism its limits may use
    kill_after: 0 to run until killed from outside; N to SIGKILL itself right
        after it made its N-th cgroup directory (mid-start, workers or not)

Prints "ready" once imported, then "started N" as each group has started.
Each group has two ranks, each with a memory and a pids limit of its own;
groups alternate between function and binary workers, which exit at once.
``AIOPROC_LOOP=uvloop`` runs it on uvloop.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import sys
from typing import Any

import aioproc
from aioproc._group import resources

_made = 0


def _kill_after(count: int) -> None:
    """SIGKILL this process right after its ``count``-th cgroup directory exists."""
    mkdir = pathlib.Path.mkdir
    mine = f"aioproc-{os.getpid()}-"

    def counting(self: pathlib.Path, *args: Any, **kwargs: Any) -> None:
        global _made
        mkdir(self, *args, **kwargs)
        if self.name.startswith(mine):
            _made += 1
            if _made == count:
                os.kill(os.getpid(), signal.SIGKILL)

    pathlib.Path.mkdir = counting  # type: ignore[method-assign]


async def main() -> None:
    limits = aioproc.Limits(memory="256M", pids=64)
    quiet = aioproc.DefaultLogsSpecs(log_dir=os.devnull)
    print("ready", flush=True)
    n = 0
    while True:
        entry: Any = sys.executable if n % 2 else os.getpid
        args = {r: ("-c", "pass") if n % 2 else () for r in (0, 1)}
        async with aioproc.start_processes(
            "crash", entry, args, {0: {}, 1: {}}, quiet, limits=limits, sinks=[]
        ) as pc:
            print("started", n, flush=True)
            await pc.wait()
        n += 1


if __name__ == "__main__":
    resources.BACKENDS = (sys.argv[1],)
    if int(sys.argv[2]):
        _kill_after(int(sys.argv[2]))
    if os.environ.get("AIOPROC_LOOP") == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
