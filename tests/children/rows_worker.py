"""A worker that appends the time to ``<out>/<LOCAL_RANK>.rows`` every 20 ms, forever.

argv: <out>.  As a training loop writes its steps: a test can tell whether
the worker runs (rows are added) or is stopped.
"""

import os
import sys
import time

path = os.path.join(sys.argv[1], f"{os.environ['LOCAL_RANK']}.rows")
with open(path, "a") as rows:
    while True:
        rows.write(f"{time.time()!r}\n")
        rows.flush()
        time.sleep(0.02)
