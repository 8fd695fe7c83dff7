"""A supervisor whose worker is itself a supervisor (nested), for SIGKILL tests.

argv: outer <grandchild.py> <fifo>   start one worker: this script as ``inner``
      inner <grandchild.py> <fifo>   start two grandchild.py workers

Both levels keep their logs in a private temp dir (``DefaultLogsSpecs()``
under ``$TMPDIR``) and run until killed; ``AIOPROC_LOOP=uvloop`` runs them
on uvloop.
"""

from __future__ import annotations

import asyncio
import os
import sys

import aioproc


async def main(level: str, grandchild: str, fifo: str) -> None:
    if level == "outer":
        args = {0: (__file__, "inner", grandchild, fifo)}
    else:
        args = {r: (grandchild, fifo, "wait") for r in (0, 1)}
    async with aioproc.start_processes(
        level, sys.executable, args, {r: {} for r in args}, aioproc.DefaultLogsSpecs()
    ) as pc:
        await pc.wait()


if __name__ == "__main__":
    level, grandchild, fifo = sys.argv[1:4]
    if os.environ.get("AIOPROC_LOOP") == "uvloop":
        import uvloop

        uvloop.run(main(level, grandchild, fifo))
    else:
        asyncio.run(main(level, grandchild, fifo))
