"""Says "ready <pid>" and waits for a signal; with argv "stubborn" it ignores SIGTERM and SIGINT."""

import os
import signal
import sys

if "stubborn" in sys.argv[1:]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
# one write: python -u prints a line and its newline in two, which interleave
# with other workers' when they share the console
sys.stdout.write(f"ready {os.getpid()}\n")
while True:
    signal.pause()
