"""A cluster run's supervisor, SIGKILLed by the test (no orphans).

argv: <fifo> [grandchild | barrier].  Runs 3 tasks that write their pid to
<fifo> and block; with "grandchild", each first starts `sleep 1000` in the
task's own process group and writes "<pid> <grandchild pid>".  With "barrier", an
``aioproc.run`` group of 3 ranks instead: ranks 0 and 1 do the same, then
call ``barrier()``, which rank 2 (writing its pid alone) never reaches; rank
1 calls it 1.5 s late, once the test has (most likely) killed the supervisor.
"""

import asyncio
import os
import subprocess
import sys
import time

import aioproc
from aioproc import cluster


def task(fifo: str, grandchild: bool) -> None:
    line = f"{os.getpid()}"
    if grandchild:
        line += f" {subprocess.Popen(['sleep', '1000']).pid}"
    with open(fifo, "w") as f:
        f.write(f"{line}\n")
    while True:
        time.sleep(1000)


def rank_task(fifo: str, rank: int) -> None:
    if rank == 2:
        task(fifo, False)
    line = f"{os.getpid()} {subprocess.Popen(['sleep', '1000']).pid}"
    with open(fifo, "w") as f:
        f.write(f"{line}\n")
    if rank == 1:
        time.sleep(1.5)
    cluster.barrier()


if __name__ == "__main__":
    fifo, mode = sys.argv[1], sys.argv[2:]
    if mode == ["barrier"]:
        runs = aioproc.run(rank_task, 3, args={r: (fifo, r) for r in range(3)})
        asyncio.run(runs)
    else:
        args = (fifo, mode == ["grandchild"])
        asyncio.run(cluster.run(task, {"worker": 2, "ps": 1}, args=args, timeout=None))
