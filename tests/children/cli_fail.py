"""Rank 1 raises through @record; the other ranks say ready and wait to be stopped."""

import os
import signal

from aioproc.errors import record


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    if rank == 1:
        raise ValueError(f"boom from rank {rank}")
    print(f"rank {rank} ready", flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
