"""The rendezvous vocabulary: parameters, errors, what a completed round returns.

Names follow torch's ``torch.distributed.elastic.rendezvous``:
``RendezvousParameters`` describes where and how agents meet,
``RendezvousInfo`` what a completed round gives each agent, and the errors::

    RendezvousError (RuntimeError)
     +-- RendezvousTimeoutError       the round did not complete in join_timeout
     +-- RendezvousConnectionError    the store could not be reached in join_timeout,
                                      or answered as no store does
     +-- RendezvousClosedError        the job is over (finished, or stopped) when
                                      this agent arrived, or stopped since
     +-- RendezvousGracefulExitError  the job finished while this agent was in it
                                      (waiting for a place): nothing is left to do
     +-- RendezvousStateError         the job's keys are corrupt (written by
                                      something else than its agents)
     +-- RendezvousLeaseLostError     this agent lost its lease: fenced
     +-- RendezvousJobFailedError     the job failed (on some host), or too few
                                      hosts are left to go on
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_ROLE",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousInfo",
    "RendezvousJobFailedError",
    "RendezvousLeaseLostError",
    "RendezvousNode",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "WorldChange",
]


class RendezvousError(RuntimeError):
    """Base of the rendezvous errors."""


class RendezvousTimeoutError(RendezvousError):
    """The round did not complete within ``join_timeout``."""


class RendezvousConnectionError(RendezvousError):
    """The store could not be reached within ``join_timeout``, or is no store.

    The message names the endpoint and the last error seen.
    """


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed: the job finished, or an agent stopped it.

    An agent that finds its job closed when it arrives ran nothing: as with
    torchrun, whose agent lets this error end the run, that is a failure
    (``aioproc run`` exits 1), so a reused run id never passes for a job
    that ran.

    Attributes:
        finished: True when the job finished (its workers succeeded); False
            when an agent stopped it.
    """

    def __init__(self, message: str, finished: bool = False) -> None:
        super().__init__(message)
        self.finished = finished


class RendezvousGracefulExitError(RendezvousError):
    """The job finished while this agent was part of it: nothing is left to do.

    Raised to an agent that joined and waited for a place (or re-joined
    after running) when the job finished meanwhile; not a failure (torch's
    name and meaning).
    """


class RendezvousStateError(RendezvousError):
    """The job's keys in the store are corrupt: a value no agent writes.

    Something else writes under the job's prefix; every agent of the job
    fails with this error, naming the key.
    """


class RendezvousLeaseLostError(RendezvousError):
    """This agent lost its lease (etcd unreachable, partition): it was fenced."""


class RendezvousJobFailedError(RendezvousError):
    """The job failed: a host's workers failed for good, or too few hosts remain.

    Attributes:
        failure: what the failing agent published about its root cause
            (``host``, ``rank``, ``local_rank``, ``pid``, ``exitcode``,
            ``message``, ``timestamp``), or None when no worker failed (too
            few hosts left).
    """

    def __init__(self, message: str, failure: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.failure = dict(failure) if failure is not None else None


DEFAULT_ROLE = "default"
"""The role of a node that names none (torch's ``DEFAULT_ROLE``)."""


@dataclass(frozen=True)
class RendezvousNode:
    """One agent of a completed round.

    Attributes:
        node_id: unique id of the agent (``addr_pid_random``).
        addr: the address the host is known by (``--local-addr``).
        port: a free port on ``addr``, reserved for ``MASTER_PORT`` should
            this node be group rank 0.
        nproc: its ``local_world_size``.
        role: the role of its workers (``WorkerSpec.role``): ranks within a
            role are counted over the nodes of that role only.
    """

    node_id: str
    addr: str
    port: int
    nproc: int
    role: str = DEFAULT_ROLE


@dataclass(frozen=True)
class RendezvousInfo:
    """What a completed round gives this agent.

    The ranks of this node's workers follow torch's
    ``SimpleElasticAgent._assign_worker_ranks``: walking the nodes in
    group-rank order, global ranks count every node's workers
    (``base_global_rank``, ``world_size``), role ranks only the workers of
    nodes with this node's role (``base_role_rank``, ``role_world_size``).

    Attributes:
        round: the round's number (0 first).
        group_rank: this node's rank among the nodes.
        nodes: every node, in group-rank order, each with its nproc and role.
    """

    round: int
    group_rank: int
    nodes: tuple[RendezvousNode, ...]

    @property
    def group_world_size(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    @property
    def base_global_rank(self) -> int:
        """Global rank of this node's local rank 0 (torch's assignment)."""
        return sum(n.nproc for n in self.nodes[: self.group_rank])

    @property
    def role(self) -> str:
        """This node's role."""
        return self.nodes[self.group_rank].role

    @property
    def base_role_rank(self) -> int:
        """Role rank of this node's local rank 0: the workers of its role on the nodes before it."""
        role = self.role
        return sum(n.nproc for n in self.nodes[: self.group_rank] if n.role == role)

    @property
    def role_world_size(self) -> int:
        """How many workers of this node's role the world has, on every node."""
        role = self.role
        return sum(n.nproc for n in self.nodes if n.role == role)

    @property
    def master_addr(self) -> str:
        return self.nodes[0].addr

    @property
    def master_port(self) -> int:
        return self.nodes[0].port


@dataclass(frozen=True)
class WorldChange:
    """Why the running world must be re-formed.

    Attributes:
        reason: a sentence for the logs.
        lost: the hosts (addresses) lost since the round completed; a loss
            consumes a restart, a node arriving or a member restarting does not.
    """

    reason: str
    lost: tuple[str, ...] = ()


_BOOL = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


class RendezvousParameters:
    """Where and how the agents of a job meet (torch's ``RendezvousParameters``).

    Args:
        backend: ``"etcd"`` (dynamic, through an etcd v3 server) or
            ``"static"`` (fixed node ranks, no store).
        endpoint: ``HOST:PORT`` of the store (etcd's client URL address).
        run_id: the job's id; agents with the same id meet.
        min_nodes, max_nodes: the round completes with ``max_nodes``
            agents, or with at least ``min_nodes`` once ``last_call_timeout``
            has passed since the ``min_nodes``-th arrived.
        local_addr: the address this host is known by (``MASTER_ADDR`` when
            it is group rank 0).
        **kwargs: the backend's options (``--rdzv-conf``): ``join_timeout``
            (600 s), ``last_call_timeout`` (30 s), ``lease_ttl`` (3 s, the
            time a lost host goes unnoticed at most), ``close_timeout`` (30 s),
            ``node_rank`` (static), ``master_port`` (static).
    """

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(backend, str) or not backend.strip():
            raise ValueError(f"the rendezvous backend must be a non-empty str, got {backend!r}")
        if not isinstance(run_id, str) or not run_id.strip():
            raise ValueError(f"the run id must be a non-empty str, got {run_id!r}")
        for name, value in (("min_nodes", min_nodes), ("max_nodes", max_nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if max_nodes < min_nodes:
            raise ValueError(f"max_nodes ({max_nodes}) must be >= min_nodes ({min_nodes})")
        if local_addr is not None and (not isinstance(local_addr, str) or not local_addr):
            raise ValueError(f"local_addr must be a host name or address, got {local_addr!r}")
        self.backend = backend.strip()
        self.endpoint = endpoint.strip() if isinstance(endpoint, str) else endpoint
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.local_addr = local_addr
        self.config: dict[str, Any] = dict(kwargs)

    def __repr__(self) -> str:
        return (
            f"RendezvousParameters(backend={self.backend!r}, endpoint={self.endpoint!r}, "
            f"run_id={self.run_id!r}, min_nodes={self.min_nodes}, max_nodes={self.max_nodes}, "
            f"local_addr={self.local_addr!r}, config={self.config!r})"
        )

    def get(self, key: str, default: Any = None) -> Any:
        """The option ``key`` (torch's accessor)."""
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.config.get(key, default)
        if value is None or isinstance(value, bool):
            return value
        try:
            return _BOOL[str(value).strip().lower()]
        except KeyError:
            raise ValueError(f"rdzv option {key} must be a boolean, got {value!r}") from None

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        value = self.config.get(key, default)
        if value is None:
            return None
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"rdzv option {key} must be an integer, got {value!r}") from None

    def get_seconds(self, key: str, default: float, minimum: float = 0.0) -> float:
        """The option ``key`` as a finite number of seconds >= ``minimum``."""
        value = self.config.get(key, default)
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = math.nan
        if isinstance(value, bool) or not math.isfinite(seconds) or seconds < minimum:
            raise ValueError(
                f"rdzv option {key} must be a number of seconds >= {minimum:g}, got {value!r}"
            )
        return seconds


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``HOST[:PORT]`` (IPv6 in brackets) as ``(host, port)``.

    Raises:
        ValueError: an empty host or a port that is not 1-65535.
    """
    text = endpoint.strip()
    host, colon, port_text = text.rpartition(":")
    if not colon or host.endswith(":") or (text.startswith("[") and not host.endswith("]")):
        host, port_text = text, ""
    host = host.strip("[]")
    port = default_port
    if port_text:
        port = int(port_text) if port_text.isdigit() else -1
    if not host or not 0 < port < 65536:
        raise ValueError(f"expected HOST:PORT such as localhost:2379, got {endpoint!r}")
    return host, port
