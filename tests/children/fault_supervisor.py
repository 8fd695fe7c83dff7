"""A supervisor process for the fault tests: the test SIGKILLs it at chosen moments.

argv: <mode> <loop> <status> [<report> <mark>]; <loop> is "asyncio" or "uvloop".
Every worker gets ``AIOPROC_FAULT_MARK=<mark>`` in its environment and it,
and its grandchild, append their pids to <report>; the supervisor appends
the worker pids it learns from ``pc.pids()`` too.  Lines appended to <status>
(a FIFO the test reads; not stdout, which workers inherit and orphans would
hold open) tell the test where the supervisor is:

- ``start``: "starting", then 64 binary workers and 4 function workers,
  then "started".
- ``run``: 8 binary and 4 function workers, tee'd to log files under
  <report>.logs; "running" once started.  Each worker then waits for a byte
  on the FIFO <report>.gate (the test's go) and writes to stdout as fast as
  it can.  (Not before: on uvloop a flood from the first ranks starves the
  launch of the next ones for tens of seconds.)
- ``close``: 8 binary workers (half ignore SIGTERM) and 2 function workers;
  "closing", then both groups are closed (grace 1 s); "closed".
- ``reuse``: one ``/bin/true`` worker; "exited <pid>" once it has exited
  (the group is not closed).
- ``guardian``: group A of 2 binary workers, "ready-a <pids>"; after a line
  on stdin, group B of 2, "ready-b <pids>".

Then it blocks until killed.
"""

from __future__ import annotations

import asyncio
import sys
import warnings

import fault_worker
from fault_worker import MARK_VAR, SH_CHATTY, SH_STUBBORN, SH_WORKER

import aioproc
from aioproc import DefaultLogsSpecs, Std

STATUS = ""


def say(text: str) -> None:
    fault_worker.report_line(STATUS, text + "\n")


def discard(line: object) -> None:
    pass


async def group(
    name: str,
    entry: object,
    args: dict[int, tuple[object, ...]],
    mark: str,
    report: str,
    **kwargs: object,
) -> aioproc.PContext:
    envs = {r: {MARK_VAR: mark} for r in args}
    pc = await aioproc.start_processes(name, entry, args, envs, **kwargs)  # type: ignore[arg-type]
    fault_worker.report_line(report, "".join(f"{p} 0\n" for p in pc.pids().values()))
    return pc


async def main(mode: str, report: str, mark: str) -> None:
    warnings.simplefilter("ignore")  # ForcedKillWarning on stderr is noise here
    if mode == "start":
        say("starting")
        await group(
            "bin", "/bin/sh", {r: ("-c", SH_WORKER, "f", report) for r in range(64)}, mark, report
        )
        await group("fn", fault_worker.fn_worker, {r: (report,) for r in range(4)}, mark, report)
        say("started")
    elif mode == "run":
        specs = {"sinks": [discard]}
        await group(
            "bin",
            "/bin/sh",
            {r: ("-c", SH_CHATTY, "f", report, f"{report}.gate") for r in range(8)},
            mark,
            report,
            logs_specs=DefaultLogsSpecs(f"{report}.logs", tee=Std.ALL),
            **specs,
        )
        await group(
            "fn",
            fault_worker.fn_worker,
            {r: (report, f"{report}.gate") for r in range(4)},
            mark,
            report,
            logs_specs=DefaultLogsSpecs(f"{report}.logs", tee=Std.ALL),
            **specs,
        )
        say("running")
    elif mode == "close":
        bins = await group(
            "bin",
            "/bin/sh",
            {r: ("-c", SH_STUBBORN if r % 2 else SH_WORKER, "f", report) for r in range(8)},
            mark,
            report,
        )
        fns = await group(
            "fn", fault_worker.fn_worker, {r: (report,) for r in range(2)}, mark, report
        )
        say("closing")
        await asyncio.gather(bins.close(timeout=1), fns.close(timeout=1))
        say("closed")
    elif mode == "reuse":
        pc = await aioproc.start_processes("reuse", "/bin/true", {0: ()}, {0: {}})
        await pc.wait()
        say(f"exited {pc.pids()[0]}")
    elif mode == "guardian":
        a = await group(
            "a", "/bin/sh", {r: ("-c", SH_WORKER, "f", report) for r in range(2)}, mark, report
        )
        say("ready-a " + " ".join(map(str, a.pids().values())))
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        b = await group(
            "b", "/bin/sh", {r: ("-c", SH_WORKER, "f", report) for r in range(2)}, mark, report
        )
        say("ready-b " + " ".join(map(str, b.pids().values())))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    await asyncio.Event().wait()  # until the test kills us


if __name__ == "__main__":
    mode, loop_kind, STATUS = sys.argv[1:4]
    rest = [*sys.argv[4:], "", ""]
    if loop_kind == "uvloop":
        import uvloop

        uvloop.run(main(mode, rest[0], rest[1]))
    else:
        asyncio.run(main(mode, rest[0], rest[1]))
