"""A supervisor whose console is a terminal: 4 workers drawing tqdm bars.

    python out_tqdm_supervisor.py <log_dir> <mode>       # supervisor
    python out_tqdm_supervisor.py worker <rank> <mode>   # one worker (binary)

The supervisor runs 4 binary workers with ``tee=Std.ALL`` and one
``ConsoleSink`` on its own stdout/stderr, which the test connects to a
pseudo-terminal.  Each worker draws a tqdm bar (on its stderr, as tqdm does)
to 100.  In mode ``bars`` that is all; in mode ``mixed`` a worker also prints
an ordinary line to stdout every 25 steps (``tqdm.write``), so ordinary lines
must scroll above the status lines of the other ranks.  In mode ``parentbar``
the workers behave as in ``mixed`` while the supervisor draws its own tqdm
bar (one step per finished worker) and routes worker lines through
``ConsoleSink(write=tqdm.write)``, so they must never garble that bar.

Standard library, aioproc and tqdm only.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

N_WORKERS = 4
STEPS = 100


def worker(rank: int, mode: str) -> None:
    from tqdm import tqdm

    bar = tqdm(
        total=STEPS,
        desc=f"bar{rank}",
        file=sys.stderr,
        mininterval=0,
        miniters=1,
        ncols=60,
        ascii=True,
    )
    for i in range(STEPS):
        # spread the updates over time so redraws interleave across ranks
        time.sleep(0.003)
        bar.update(1)
        if mode in ("mixed", "parentbar") and i % 25 == 24:
            tqdm.write(f"rank {rank} reached {i + 1}", file=sys.stdout)
            sys.stdout.flush()
    bar.close()


async def supervise(log_dir: str, mode: str) -> int:
    import aioproc
    from aioproc import ConsoleSink, DefaultLogsSpecs, Std

    here = os.path.abspath(__file__)
    n = N_WORKERS
    if mode == "parentbar":
        return await supervise_with_own_bar(log_dir, here)
    async with aioproc.start_processes(
        "bar",
        sys.executable,
        args={r: (here, "worker", str(r), mode) for r in range(n)},
        envs={r: {} for r in range(n)},
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
        sinks=[ConsoleSink()],
    ) as pc:
        result = await pc.wait()
    assert result is not None
    return 1 if result.is_failed() else 0


async def supervise_with_own_bar(log_dir: str, here: str) -> int:
    from tqdm import tqdm

    import aioproc
    from aioproc import ConsoleSink, DefaultLogsSpecs, Std

    n = N_WORKERS
    bar = tqdm(total=n, desc="parent", file=sys.stderr, mininterval=0, ncols=60, ascii=True)

    def on_event(event: aioproc.context.WorkerEvent) -> None:
        if event.kind == "exited":
            bar.update(1)

    async with aioproc.start_processes(
        "bar",
        sys.executable,
        args={r: (here, "worker", str(r), "parentbar") for r in range(n)},
        envs={r: {} for r in range(n)},
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
        sinks=[ConsoleSink(write=tqdm.write)],
        on_event=on_event,
    ) as pc:
        result = await pc.wait()
    bar.close()
    assert result is not None
    return 1 if result.is_failed() else 0


def main() -> int:
    if sys.argv[1] == "worker":
        worker(int(sys.argv[2]), sys.argv[3])
        return 0
    return asyncio.run(supervise(sys.argv[1], sys.argv[2]))


if __name__ == "__main__":
    sys.exit(main())
