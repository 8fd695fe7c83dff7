"""Rank 0 fails (exit 3) on attempts below argv[1]; every other exit is a success."""

import os
import sys

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
print(f"attempt {attempt} rank {rank}", flush=True)
sys.exit(3 if rank == 0 and attempt < int(sys.argv[1]) else 0)
