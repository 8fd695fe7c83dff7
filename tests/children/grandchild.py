"""Worker that starts `sleep 1000`, reports, then waits or exits.

argv: <fifo> <mode> where mode is "wait" (block until signalled), "exit"
(exit 0 at once, leaving the grandchild behind), "ignore-term" (ignore
SIGTERM, then block) or "setsid" (as "wait", with the grandchild in a session
of its own: it leaves the worker's process group but keeps its environment).
The grandchild is in the worker's process group otherwise.  Writes
"<worker pid> <grandchild pid>\n" to <fifo>.
"""

import os
import signal
import subprocess
import sys

fifo, mode = sys.argv[1], sys.argv[2]
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
sleeper = subprocess.Popen(["sleep", "1000"], start_new_session=mode == "setsid")
with open(fifo, "w") as f:
    f.write(f"{os.getpid()} {sleeper.pid}\n")
if mode == "exit":
    os._exit(0)
while True:
    signal.pause()
