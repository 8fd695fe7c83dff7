"""Prints torchrun's environment as seen by one worker of `aioproc run`.

argv: anything; echoed back as ARGS=... (checks argument passing).
"""

import json
import os
import signal
import sys

KEYS = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
)

report = {key: os.environ.get(key) for key in KEYS}
report["ARGS"] = sys.argv[1:]
# SIG_DFL, not SIG_IGN: the agent's own SIGHUP handling must not leak into workers
hup = signal.getsignal(signal.SIGHUP)
report["SIGHUP"] = "default" if hup == signal.SIG_DFL else repr(hup)
report["PID"] = os.getpid()
# a session and a process group of its own, as every worker
report["LEADER"] = os.getsid(0) == os.getpgrp() == os.getpid()
# one write: python -u prints a line and its newline in two, which interleave
# with other workers' when they share the console
sys.stdout.write("ENV " + json.dumps(report, sort_keys=True) + "\n")
