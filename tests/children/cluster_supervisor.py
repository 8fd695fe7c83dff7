"""A cluster run's supervisor, SIGKILLed by the test (no orphans).

argv: <fifo> [grandchild].  Runs 3 tasks that write their pid to <fifo> and
block; with "grandchild", each first starts `sleep 1000` in its own process
group and writes "<pid> <grandchild pid>".
"""

import asyncio
import os
import subprocess
import sys
import time

from aioproc import cluster


def task(fifo: str, grandchild: bool) -> None:
    line = f"{os.getpid()}"
    if grandchild:
        line += f" {subprocess.Popen(['sleep', '1000']).pid}"
    with open(fifo, "w") as f:
        f.write(f"{line}\n")
    while True:
        time.sleep(1000)


if __name__ == "__main__":
    args = (sys.argv[1], sys.argv[2:] == ["grandchild"])
    asyncio.run(cluster.run(task, {"worker": 2, "ps": 1}, args=args, timeout=None))
