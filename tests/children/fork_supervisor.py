"""A supervisor for the forkserver fault test: the test SIGKILLs it at random moments.

argv: <loop> <status> <report>.  Says "starting" on the FIFO <status>, keeps
a forkserver template up (its pid goes to <report> as "<pid> 0"), starts
3 forked function workers that each start a ``sleep`` grandchild and report
"<worker pid> <grandchild pid>" to <report>, says "started" and blocks until
killed.  Run it with ``AIOPROC_FAULT_MARK`` in its environment: the template
inherits it, and so do the workers' /proc environ and the grandchildren.
"""

from __future__ import annotations

import asyncio
import sys
import warnings

import fault_worker
import fork_funcs

import aioproc
from aioproc import DefaultLogsSpecs, Std


async def main(status: str, report: str) -> None:
    warnings.simplefilter("ignore")
    fault_worker.report_line(status, "starting\n")
    server = await aioproc.open_forkserver(["json"])
    fault_worker.report_line(report, f"{server.pid} 0\n")
    await aioproc.start_processes(
        "fork",
        fork_funcs.with_grandchild,
        {r: (report,) for r in range(3)},
        {r: {} for r in range(3)},
        DefaultLogsSpecs(f"{report}.logs", redirects=Std.ALL),
        start_method="forkserver",
        preload=["json"],
    )
    fault_worker.report_line(status, "started\n")
    await asyncio.Event().wait()


if __name__ == "__main__":
    loop_kind, status_path, report_path = sys.argv[1:4]
    if loop_kind == "uvloop":
        import uvloop

        uvloop.run(main(status_path, report_path))
    else:
        asyncio.run(main(status_path, report_path))
