"""A cluster run's supervisor, SIGKILLed by the test (no orphans).

argv: <fifo>.  Runs 3 tasks that write their pid to <fifo> and block.
"""

import asyncio
import os
import sys
import time

from aioproc import cluster


def task(fifo: str) -> None:
    with open(fifo, "w") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        time.sleep(1000)


if __name__ == "__main__":
    asyncio.run(cluster.run(task, {"worker": 2, "ps": 1}, args=(sys.argv[1],), timeout=None))
