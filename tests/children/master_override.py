"""One agent of a one-host etcd job whose spec names the master's address (torch's override).

    master_override.py ENDPOINT JOB ADDR|- PORT|-

Runs a ``LocalElasticAgent`` (the real etcd handler, one function worker)
with ``WorkerSpec(master_addr=ADDR, master_port=PORT)`` (``-``: not given),
as torch's ``check_master_addr_port_override`` scenario does, and prints one
JSON line: ``{"state", "worker": [MASTER_ADDR, MASTER_PORT], "group":
[master_addr, master_port], "rendezvous": [addr, port]}`` (what the worker
saw, the agent's ``WorkerGroup``, and group rank 0's address in the round).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from aioproc.agent import LocalElasticAgent, WorkerSpec
from aioproc.rendezvous import RendezvousInfo, RendezvousParameters, create_handler


def master_env() -> list[str]:
    return [os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]]


async def main() -> None:
    endpoint, job, addr, port = sys.argv[1:5]
    params = RendezvousParameters(
        "etcd", endpoint, job, 1, 1, local_addr="127.0.0.1", join_timeout=30, lease_ttl=10
    )
    handler = create_handler(params)
    rounds: list[RendezvousInfo] = []
    next_rendezvous = handler.next_rendezvous

    async def recorded() -> RendezvousInfo:
        info = await next_rendezvous()
        rounds.append(info)
        return info

    handler.next_rendezvous = recorded  # type: ignore[method-assign]
    spec = WorkerSpec(
        role="trainer",
        local_world_size=1,
        entrypoint=master_env,
        max_restarts=0,
        master_addr=None if addr == "-" else addr,
        master_port=None if port == "-" else int(port),
        rdzv_handler=handler,
    )
    agent = LocalElasticAgent(spec, exit_barrier_timeout=10, grace_period=5)
    result = await agent.run()
    group = agent.get_worker_group()
    record = {
        "state": result.state.value,
        "worker": result.return_values.get(0),
        "group": [group.master_addr, group.master_port],
        "rendezvous": [rounds[0].master_addr, rounds[0].master_port] if rounds else None,
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
