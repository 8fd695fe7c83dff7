"""A toy training script for ``aioproc run`` (it runs unchanged under torchrun).

    aioproc run --nproc-per-node 4 examples/train.py --steps 20

Each worker reads torchrun's environment, draws a progress bar on stderr with
``\\r`` updates and prints its result.  Standard library only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"rank {rank}/{world} starting (master {master}, attempt {attempt})", flush=True)
    loss = 1.0
    for step in range(1, args.steps + 1):
        time.sleep(0.05)
        loss *= 0.9
        print(f"\rstep {step}/{args.steps} loss {loss:.4f}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr, flush=True)
    print(f"rank {rank} done: final loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
