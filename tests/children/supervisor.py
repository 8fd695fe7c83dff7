"""A supervisor process for the no-orphans test: killed with SIGKILL by the test.

argv: <fifo>.  Starts 4 function workers and 4 binary workers, each of which
starts a `sleep 1000` grandchild and reports "<worker pid> <grandchild pid>"
on <fifo>, then blocks.
"""

import asyncio
import os
import signal
import subprocess
import sys

import aioproc

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(fifo: str) -> None:
    sleeper = subprocess.Popen(["sleep", "1000"])
    with open(fifo, "w") as f:
        f.write(f"{os.getpid()} {sleeper.pid}\n")
    while True:
        signal.pause()


async def main(fifo: str) -> None:
    script = os.path.join(HERE, "grandchild.py")
    fns = await aioproc.start_processes(
        "fn", worker, {r: (fifo,) for r in range(4)}, {r: {} for r in range(4)}
    )
    bins = await aioproc.start_processes(
        "bin",
        sys.executable,
        {r: (script, fifo, "wait") for r in range(4)},
        {r: {} for r in range(4)},
    )
    await fns.wait()
    await bins.wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
