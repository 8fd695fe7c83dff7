"""Worker ranks over several hosts and roles: torch's ``_assign_worker_ranks``.

Each agent publishes its role and local world size through the rendezvous;
every worker's ``RANK``, ``WORLD_SIZE``, ``ROLE_RANK`` and ``ROLE_WORLD_SIZE``
are then those torch's ``SimpleElasticAgent._assign_worker_ranks`` gives it
(``torch_assignment`` below restates torch's algorithm).  The end-to-end
check with agents of three roles meeting through a real etcd is
``test_rendezvous_etcd.py::test_agents_of_three_roles_get_torchs_role_ranks``.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from aioproc.agent import WorkerSpec
from aioproc.agent._workers import worker_env
from aioproc.rendezvous import RendezvousInfo, RendezvousNode, RendezvousParameters
from aioproc.rendezvous.static import StaticRendezvousHandler


def torch_assignment(nodes: list[tuple[str, int]]) -> list[tuple[int, int, int, int]]:
    """torch's ``_assign_worker_ranks`` for ``nodes`` (``(role, nproc)`` in group-rank order).

    Returns each node's ``(base_global_rank, global_world_size,
    base_role_rank, role_world_size)``, as torch's rank-0 agent computes
    them from every agent's ``_RoleInstanceInfo``: both bases are running
    sums in group-rank order, the role's over the nodes of that role only.
    """
    role_sizes: dict[str, int] = defaultdict(int)
    global_size = 0
    for role, nproc in nodes:
        role_sizes[role] += nproc
        global_size += nproc
    base_global_rank = 0
    role_ranks: dict[str, int] = defaultdict(int)
    assigned = []
    for role, nproc in nodes:
        assigned.append((base_global_rank, global_size, role_ranks[role], role_sizes[role]))
        base_global_rank += nproc
        role_ranks[role] += nproc
    return assigned


def expected_env(nodes: list[tuple[str, int]], group_rank: int, local_rank: int) -> dict[str, str]:
    """The rank variables torchrun gives ``local_rank`` of the node at ``group_rank``."""
    role, nproc = nodes[group_rank]
    base, world, role_base, role_world = torch_assignment(nodes)[group_rank]
    return {
        "LOCAL_RANK": str(local_rank),
        "RANK": str(base + local_rank),
        "GROUP_RANK": str(group_rank),
        "ROLE_RANK": str(role_base + local_rank),
        "ROLE_NAME": role,
        "LOCAL_WORLD_SIZE": str(nproc),
        "WORLD_SIZE": str(world),
        "GROUP_WORLD_SIZE": str(len(nodes)),
        "ROLE_WORLD_SIZE": str(role_world),
    }


def rank_vars(env: dict[str, str]) -> dict[str, str]:
    keys = expected_env([("r", 1)], 0, 0)
    return {k: env[k] for k in keys}


def info_for(nodes: list[tuple[str, int]], group_rank: int) -> RendezvousInfo:
    return RendezvousInfo(
        3,
        group_rank,
        tuple(
            RendezvousNode(f"n{i}", f"10.0.0.{i}", 29500, nproc, role)
            for i, (role, nproc) in enumerate(nodes)
        ),
    )


def spec_for(role: str, nproc: int) -> WorkerSpec:
    return WorkerSpec(role=role, local_world_size=nproc, entrypoint="/bin/true")


def test_reference_sums_nprocs_in_group_rank_order_per_role() -> None:
    # worked by hand from torch's code: global ranks run over every node,
    # role ranks over the nodes of the role, both in group-rank order
    nodes = [("master", 1), ("trainer", 2), ("ps", 1), ("trainer", 3), ("ps", 2)]
    assert torch_assignment(nodes) == [
        (0, 9, 0, 1),
        (1, 9, 0, 5),
        (3, 9, 0, 3),
        (4, 9, 2, 5),
        (7, 9, 1, 3),
    ]


@pytest.mark.parametrize("seed", range(25))
def test_every_worker_gets_torchs_ranks_whatever_the_roles_and_nprocs(seed: int) -> None:
    rng = random.Random(seed)
    roles = ["master", "trainer", "ps", "default"][: rng.randint(1, 4)]
    nodes = [(rng.choice(roles), rng.randint(1, 4)) for _ in range(rng.randint(1, 9))]
    seen_ranks: list[int] = []
    seen_role_ranks: dict[str, list[int]] = defaultdict(list)
    for group_rank, (role, nproc) in enumerate(nodes):
        info = info_for(nodes, group_rank)
        for local_rank in range(nproc):
            env = worker_env(spec_for(role, nproc), "job", local_rank, 0, "h", 1, info)
            assert rank_vars(env) == expected_env(nodes, group_rank, local_rank)
            seen_ranks.append(int(env["RANK"]))
            seen_role_ranks[role].append(int(env["ROLE_RANK"]))
    # what a user relies on: each rank once, each role's ranks 0..size-1 once
    assert sorted(seen_ranks) == list(range(sum(n for _, n in nodes)))
    for role, ranks in seen_role_ranks.items():
        assert sorted(ranks) == list(range(sum(n for r, n in nodes if r == role)))


def test_one_host_role_ranks_are_the_local_ranks() -> None:
    env = worker_env(spec_for("trainer", 3), "job", 2, 0, "127.0.0.1", 29500)
    assert rank_vars(env) == expected_env([("trainer", 3)], 0, 2)


async def test_static_rendezvous_takes_every_node_to_run_this_nodes_role() -> None:
    # no store, nothing exchanged: each of the fixed nodes runs this node's
    # nproc and role, as a static torchrun job launched alike on every host
    params = RendezvousParameters("static", "10.0.0.1:29400", "job", 3, 3, node_rank=1)
    handler = StaticRendezvousHandler(params)
    async with handler.session(2, None, role="trainer"):
        info = await handler.next_rendezvous()
    nodes = [("trainer", 2)] * 3
    for local_rank in range(2):
        env = worker_env(spec_for("trainer", 2), "job", local_rank, 0, "h", 1, info)
        assert rank_vars(env) == expected_env(nodes, 1, local_rank)


@pytest.mark.parametrize("seed", range(25))
def test_the_etcd_leaders_seats_give_every_node_torchs_ranks(seed: int) -> None:
    # each node reads its own seat only: the leader's figures must be the ones
    # torch computes from every node, and survive the trip through etcd
    from aioproc.rendezvous._etcd_schema import Seat, assign

    rng = random.Random(seed)
    roles = ["master", "trainer", "ps", "default"][: rng.randint(1, 4)]
    nodes = [(rng.choice(roles), rng.randint(1, 4)) for _ in range(rng.randint(1, 9))]
    full = info_for(nodes, 0).nodes
    seats = assign(7, "beef", full)
    assert [s.group_rank for s in seats] == list(range(len(nodes)))
    for group_rank, seat in enumerate(seats):
        again = Seat.parse(seat.node_id, seat.value())
        assert again == seat
        info = again.info()
        assert (info.round, info.group_rank, info.nodes) == (7, group_rank, ())
        assert (info.master_addr, info.master_port) == ("10.0.0.0", 29500)
        role, nproc = nodes[group_rank]
        for local_rank in range(nproc):
            env = worker_env(spec_for(role, nproc), "job", local_rank, 0, "h", 1, info)
            assert rank_vars(env) == expected_env(nodes, group_rank, local_rank)
