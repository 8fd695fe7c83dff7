"""Writes this worker's environment to <argv[1]>/env<RANK>.json; a line to each stream."""

import json
import os
import sys

rank = os.environ["RANK"]
with open(os.path.join(sys.argv[1], f"env{rank}.json"), "w") as f:
    json.dump(dict(os.environ), f)
print(f"out of {rank}")
print(f"err of {rank}", file=sys.stderr)
