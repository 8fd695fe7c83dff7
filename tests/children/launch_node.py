"""One node of a job launched with ``aioproc.launcher``, as a tool's process would launch it.

argv: ``BACKEND ENDPOINT RUN_ID NNODES NPROC RDZV_CONF_JSON [hold]``.  The node
calls the blocking ``elastic_launch(config, report)()`` in its main thread;
each worker returns its torchrun environment.  On success the node prints
``VALUES <json>`` (the return values by global rank) and exits 0; a
``ChildFailedError`` exits 1, a ``SignalException`` prints ``SIGNAL <name>``
and exits 3.

With ``hold``, each worker writes its pid to ``$LAUNCH_NODE_OUT/<rank>.pid``
and sleeps until stopped: the test signals the node once every pid is there.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from aioproc.errors import ChildFailedError
from aioproc.launcher import LaunchConfig, elastic_launch
from aioproc.signals import SignalException

KEYS = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "ROLE_NAME",
)


def report(hold: bool) -> dict[str, str | None]:
    if hold:
        out = os.environ["LAUNCH_NODE_OUT"]
        path = os.path.join(out, f"{os.environ['RANK']}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)  # whole, or not there
        time.sleep(60)
    return {key: os.environ.get(key) for key in KEYS}


def main() -> int:
    backend, endpoint, run_id, nnodes, nproc, conf = sys.argv[1:7]
    hold = sys.argv[7:] == ["hold"]
    low, _, high = nnodes.partition(":")
    config = LaunchConfig(
        min_nodes=int(low),
        max_nodes=int(high or low),
        nproc_per_node=int(nproc),
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=json.loads(conf),
        max_restarts=0,
        shutdown_timeout=5,
    )
    try:
        values = elastic_launch(config, report)(hold)
    except ChildFailedError as e:
        print(e, file=sys.stderr)
        return 1
    except SignalException as e:
        print(f"SIGNAL {signal.Signals(e.sigval).name}", flush=True)
        return 3
    print("VALUES " + json.dumps(values), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
