"""Rank 0 fails (exit 3) on attempts listed in argv[1] (comma-separated); prints its env.

Prints one JSON line with the torchrun variables and the monotonic time it started.
"""

import json
import os
import sys
import time

fail_on = {int(a) for a in sys.argv[1].split(",") if a}
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
keys = [
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
]
print(
    json.dumps(
        {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[2:], "t": time.monotonic()}
    ),
    flush=True,
)
if attempt in fail_on and os.environ["LOCAL_RANK"] == "0":
    print(f"failing on attempt {attempt}", file=sys.stderr, flush=True)
    sys.exit(3)
