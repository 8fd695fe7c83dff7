"""Several ``LocalElasticAgent``s of different roles, as coroutines of one process.

    role_agents.py ENDPOINT JOB ROLE:NPROC [ROLE:NPROC ...]

Runs one agent per ``ROLE:NPROC`` (the real etcd handler, function workers),
all in one job of exactly that many nodes.  Every worker returns the rank
variables of its environment; once every agent's run has ended, prints one
JSON line per agent: ``{"agent", "role", "nproc", "state", "workers",
"values"}``, where ``workers`` is the agent's ``WorkerGroup`` as
``[local_rank, global_rank, role_rank, world_size, role_world_size]`` rows
and ``values`` the workers' environments keyed by global rank.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from aioproc.agent import LocalElasticAgent, WorkerSpec
from aioproc.rendezvous import RendezvousParameters, create_handler

RANK_VARS = (
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
)


def rank_env() -> dict[str, str]:
    return {k: os.environ[k] for k in RANK_VARS}


async def main() -> None:
    endpoint, job = sys.argv[1], sys.argv[2]
    roles = [(role, int(n)) for role, n in (arg.split(":") for arg in sys.argv[3:])]
    agents = []
    for role, nproc in roles:
        params = RendezvousParameters(
            "etcd",
            endpoint,
            job,
            len(roles),
            len(roles),
            local_addr="127.0.0.1",
            join_timeout=40,
            last_call_timeout=30,  # the round completes by max_nodes, never by last call
            lease_ttl=10,  # a loaded machine must not fence anyone
        )
        spec = WorkerSpec(
            role=role,
            local_world_size=nproc,
            entrypoint=rank_env,
            max_restarts=0,
            rdzv_handler=create_handler(params),
        )
        agents.append(LocalElasticAgent(spec, exit_barrier_timeout=30, grace_period=5))
    results = await asyncio.gather(*(agent.run() for agent in agents))
    for i, (agent, result) in enumerate(zip(agents, results, strict=True)):
        group = agent.get_worker_group()
        workers = [
            [w.local_rank, w.global_rank, w.role_rank, w.world_size, w.role_world_size]
            for w in group.workers
        ]
        record = {
            "agent": i,
            "role": agent.spec.role,
            "nproc": agent.spec.local_world_size,
            "state": result.state.value,
            "group_rank": group.group_rank,
            "workers": workers,
            "values": result.return_values,
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
