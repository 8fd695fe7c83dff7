"""Static rendezvous (torchrun's ``--node-rank``/``--master-addr`` mode): no store.

Every node is told its rank and the world's size; nothing is exchanged, so
the world never changes and nothing notices a lost host (as in torch).
Without a store, no node learns another's nproc or role: every node is taken
to run as many workers as this one, in this one's role (torch exchanges both
through rank 0's TCPStore, which aioproc does not host), so role ranks equal
global ranks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .api import (
    DEFAULT_ROLE,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousNode,
    RendezvousParameters,
    WorldChange,
)

__all__ = ["StaticRendezvousHandler"]


class StaticRendezvousHandler(RendezvousHandler):
    """A fixed world of ``min_nodes == max_nodes`` nodes, each with the same nproc.

    Options: ``node_rank`` (required; torch's launcher spells it ``rank``),
    ``master_addr`` (default: the endpoint's host), ``master_port``
    (default: the endpoint's port).
    """

    elastic = False  # the launcher gives each node its rank and the master's address
    needs_endpoint = False  # the master's address stands for it

    def __init__(self, params: RendezvousParameters) -> None:
        from .api import parse_endpoint

        if params.min_nodes != params.max_nodes:
            raise ValueError(
                f"the static rendezvous needs a fixed number of nodes, got "
                f"{params.min_nodes}:{params.max_nodes}"
            )
        key = "node_rank" if "node_rank" in params.config else "rank"
        rank = params.get_as_int(key)
        if rank is None or not 0 <= rank < params.max_nodes:
            raise ValueError(
                f"node_rank must be in [0, {params.max_nodes}) for the static rendezvous, "
                f"got {params.get(key)!r}"
            )
        host, port = parse_endpoint(params.endpoint or "127.0.0.1:29500", 29500)
        self._params = params
        self.node_rank = rank
        self.master_addr = str(params.get("master_addr") or host)
        self.master_port = int(params.get_as_int("master_port") or port)
        self._nproc = 1
        self._role = DEFAULT_ROLE
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"<StaticRendezvousHandler {self._params.run_id} node {self.node_rank} of "
            f"{self._params.max_nodes} master {self.master_addr}:{self.master_port}>"
        )

    def get_backend(self) -> str:
        return "static"

    def get_run_id(self) -> str:
        return self._params.run_id

    @property
    def min_nodes(self) -> int:
        return self._params.min_nodes

    @property
    def max_nodes(self) -> int:
        return self._params.max_nodes

    def is_closed(self) -> bool:
        return self._closed

    async def set_closed(self) -> None:
        """Only this node learns of it: there is no store to tell the others."""
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def session(
        self,
        local_world_size: int,
        lease_renewed: Callable[[float], None] | None = None,
        role: str = DEFAULT_ROLE,
    ) -> _NoSession:
        """Nothing to connect to; no lease (``lease_renewed`` is never called).

        Every node of the world is taken to run ``local_world_size`` workers
        of ``role`` (see the module docstring).
        """
        self._nproc = local_world_size
        self._role = role
        return _NoSession()

    async def next_rendezvous(self) -> RendezvousInfo:
        n = self._params.max_nodes
        nodes = tuple(
            RendezvousNode(
                f"node{i}",
                self.master_addr if i == 0 else "",
                self.master_port,
                self._nproc,
                self._role,
            )
            for i in range(n)
        )
        return RendezvousInfo(0, self.node_rank, nodes)

    async def wait_for_change(self) -> WorldChange:
        """Never returns: a static world does not change."""
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def exit_barrier(self, timeout: float) -> WorldChange | None:
        """Nothing to wait for: there is no store to meet in."""
        return None

    async def report_failure(self, failure: object) -> None:
        """Nobody to tell: there is no store."""

    async def shutdown(self) -> bool:
        return True


class _NoSession:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None
