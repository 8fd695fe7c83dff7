"""Rank 1 overruns a watchdog timer; the other ranks wait to be stopped."""

import os
import signal
import time

from aioproc.timer import expires

rank = int(os.environ["RANK"])
print(f"rank {rank} ready", flush=True)
if rank == 1:
    with expires(after=0.3, scope="stuck step"):
        time.sleep(60)
while True:
    signal.pause()
