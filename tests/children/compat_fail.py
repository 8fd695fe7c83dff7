"""Fails the same way under torchrun (torch's @record) and aioproc run (aioproc's @record).

argv[1]: "raise" (rank 1 raises ValueError) or "exit" (rank 0 exits 3, no error file).
"""

import os
import sys
import time

try:
    from torch.distributed.elastic.multiprocessing.errors import record
except ImportError:
    from aioproc import record


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    if sys.argv[1] == "raise" and rank == 1:
        raise ValueError(f"rank {rank} refuses")
    if sys.argv[1] == "exit" and rank == 0:
        os._exit(3)  # no error file: not even @record sees this
    time.sleep(30)  # the failing rank is the first failure; this one is stopped


main()
