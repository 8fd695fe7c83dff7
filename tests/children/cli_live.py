"""A few lines, one on stderr, and a progress bar drawn with carriage returns.

argv[1] (optional): attempts that fail with exit 3 before one succeeds.
"""

import os
import sys
import time

rank = int(os.environ["LOCAL_RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for k in range(3):
    print(f"rank {rank} line {k}", flush=True)
    time.sleep(0.02)  # pacing only: the output is what is checked
print(f"rank {rank} warning", file=sys.stderr, flush=True)
for i in range(0, 101, 10):
    sys.stdout.write(f"\rrank {rank} progress {i:3d}%")
    sys.stdout.flush()
    time.sleep(0.02)
sys.stdout.write("\n")
print(f"rank {rank} done", flush=True)
if len(sys.argv) > 1 and attempt < int(sys.argv[1]):
    sys.exit(3)
