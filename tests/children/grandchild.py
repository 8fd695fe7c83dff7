"""Worker that starts `sleep 1000` in its own process group, reports, then waits or exits.

argv: <fifo> <mode> where mode is "wait" (block until signalled), "exit"
(exit 0 at once, leaving the grandchild behind) or "ignore-term" (ignore
SIGTERM, then block).  Writes "<worker pid> <grandchild pid>\n" to <fifo>.
"""

import os
import signal
import subprocess
import sys

fifo, mode = sys.argv[1], sys.argv[2]
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
sleeper = subprocess.Popen(["sleep", "1000"])
with open(fifo, "w") as f:
    f.write(f"{os.getpid()} {sleeper.pid}\n")
if mode == "exit":
    os._exit(0)
while True:
    signal.pause()
