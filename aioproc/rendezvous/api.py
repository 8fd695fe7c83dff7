"""The rendezvous vocabulary: the handler's contract, parameters, errors, a round's result.

Names follow torch's ``torch.distributed.elastic.rendezvous``:
``RendezvousHandler`` is what every backend implements (the agent calls
nothing else), ``RendezvousParameters`` describes where and how agents
meet, ``RendezvousInfo`` what a completed round gives each agent, and the
errors::

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

import abc
import math
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "DEFAULT_ROLE",
    "RendezvousAssignment",
    "RendezvousHandler",
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
class RendezvousAssignment:
    """What one node's workers need of a completed round, without the other nodes.

    torch's ``SimpleElasticAgent._assign_worker_ranks`` walks the nodes in
    group-rank order: global ranks count every node's workers, role ranks
    only the workers of the nodes with this node's role.  A backend that
    assigns the ranks once for everyone (the etcd rendezvous: the round's
    leader) gives each node these figures instead of every node's record,
    so that a node reads O(1) data per round, however large the world.

    Attributes:
        group_world_size: how many nodes the world has.
        world_size: how many workers the world has, on every node.
        base_global_rank: the global rank of this node's local rank 0.
        role: this node's role.
        base_role_rank: the role rank of this node's local rank 0.
        role_world_size: how many workers of this node's role the world has.
        master_addr, master_port: group rank 0's address and reserved port.
    """

    group_world_size: int
    world_size: int
    base_global_rank: int
    role: str
    base_role_rank: int
    role_world_size: int
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class RendezvousInfo:
    """What a completed round gives this agent.

    The ranks of this node's workers follow torch's
    ``SimpleElasticAgent._assign_worker_ranks``: walking the nodes in
    group-rank order, global ranks count every node's workers
    (``base_global_rank``, ``world_size``), role ranks only the workers of
    nodes with this node's role (``base_role_rank``, ``role_world_size``).

    A backend gives either every node (``nodes``: the figures are computed
    from them) or this node's ``assignment`` alone (the figures are read
    from it, and ``nodes`` may be empty): the etcd rendezvous does the
    latter, so that no host reads a record of every host at each round
    (its handler's ``world()`` reads the nodes when they are wanted).

    Attributes:
        round: the round's number (0 first).
        group_rank: this node's rank among the nodes.
        nodes: every node, in group-rank order, each with its nproc and
            role; empty when the backend gives ``assignment``.
        assignment: this node's figures, when the backend assigned them.

    Raises:
        ValueError: neither ``nodes`` nor ``assignment`` is given, or
            ``group_rank`` is not a rank of the world.
    """

    round: int
    group_rank: int
    nodes: tuple[RendezvousNode, ...] = ()
    assignment: RendezvousAssignment | None = None

    def __post_init__(self) -> None:
        size = self.assignment.group_world_size if self.assignment is not None else len(self.nodes)
        if size == 0:
            raise ValueError("a RendezvousInfo needs the world's nodes or this node's assignment")
        if not 0 <= self.group_rank < size:
            raise ValueError(f"group_rank {self.group_rank} is not a rank of {size} node(s)")

    @property
    def group_world_size(self) -> int:
        if self.assignment is not None:
            return self.assignment.group_world_size
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        if self.assignment is not None:
            return self.assignment.world_size
        return sum(n.nproc for n in self.nodes)

    @property
    def base_global_rank(self) -> int:
        """Global rank of this node's local rank 0 (torch's assignment)."""
        if self.assignment is not None:
            return self.assignment.base_global_rank
        return sum(n.nproc for n in self.nodes[: self.group_rank])

    @property
    def role(self) -> str:
        """This node's role."""
        if self.assignment is not None:
            return self.assignment.role
        return self.nodes[self.group_rank].role

    @property
    def base_role_rank(self) -> int:
        """Role rank of this node's local rank 0: the workers of its role on the nodes before it."""
        if self.assignment is not None:
            return self.assignment.base_role_rank
        role = self.role
        return sum(n.nproc for n in self.nodes[: self.group_rank] if n.role == role)

    @property
    def role_world_size(self) -> int:
        """How many workers of this node's role the world has, on every node."""
        if self.assignment is not None:
            return self.assignment.role_world_size
        role = self.role
        return sum(n.nproc for n in self.nodes if n.role == role)

    @property
    def master_addr(self) -> str:
        if self.assignment is not None:
            return self.assignment.master_addr
        return self.nodes[0].addr

    @property
    def master_port(self) -> int:
        if self.assignment is not None:
            return self.assignment.master_port
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


class RendezvousHandler(abc.ABC):
    """What a rendezvous backend implements: torch's ``RendezvousHandler``, awaited.

    A backend is a subclass registered by name
    (``aioproc.rendezvous.register_backend``); ``create_handler`` builds it
    as ``cls(params)`` from a ``RendezvousParameters`` whose ``backend`` is
    that name, and the handler goes into ``WorkerSpec.rdzv_handler``.  The
    agent calls only what is declared here, in this order: it enters
    ``session()`` once per run, then, for each attempt, awaits
    ``next_rendezvous()`` and races its workers with ``wait_for_change()``;
    after the workers succeeded it awaits ``exit_barrier()``, after a final
    failure ``report_failure()``, and when it is stopped ``shutdown()``.
    Where torch's method blocks, this one is a coroutine; a coroutine that
    waits on other hosts must be cancellable, since a stop cancels it.

    The class attributes describe the backend before any handler is built;
    ``aioproc run`` reads them to check its flags and to choose what it
    passes as options, so no part of aioproc compares backend names.

    Attributes:
        elastic: True (the default): the rendezvous forms the world itself
            (``min_nodes`` to ``max_nodes`` hosts, group ranks assigned in
            the round) and may change it (``wait_for_change``).  False: a
            fixed world whose node ranks the launcher gives: ``aioproc run``
            then needs ``--nnodes N`` and passes ``node_rank``,
            ``master_addr`` and ``master_port`` as options (torchrun's
            ``--node-rank``, ``--master-addr``, ``--master-port``).
        needs_endpoint: whether ``aioproc run`` refuses to start without
            ``--rdzv-endpoint``; ``endpoint_help`` says what it names.
        needs_run_id: whether ``aioproc run`` refuses to start without
            ``--rdzv-id`` (a store that outlives jobs: a reused id meets an
            old job).
        hosts_store: whether an agent may serve the rendezvous's store
            itself; ``aioproc run`` then passes its ``--log-dir`` as the
            ``data_dir`` option (unless given), where the store keeps its data.
        addr: the address this host is known by in the rendezvous (``""``
            when the backend has none); failures name it.
    """

    elastic: ClassVar[bool] = True
    needs_endpoint: ClassVar[bool] = True
    endpoint_help: ClassVar[str] = "HOST:PORT"
    needs_run_id: ClassVar[bool] = False
    hosts_store: ClassVar[bool] = False
    addr: str = ""

    @property
    def fence_grace(self) -> float:
        """Seconds a fenced host's workers get between SIGTERM and SIGKILL.

        A backend with leases (``session``'s ``lease_renewed``) fences a
        host whose lease it cannot renew: its workers must be gone before
        the others re-form the world without it.  0 (the default) for a
        backend without leases, which never fences.
        """
        return 0.0

    # ------------------------------------------------------------ torch's API

    @abc.abstractmethod
    def get_backend(self) -> str:
        """The name the backend is registered by (``params.backend``)."""

    @abc.abstractmethod
    def get_run_id(self) -> str:
        """The job's id: agents with the same id meet."""

    @abc.abstractmethod
    def is_closed(self) -> bool:
        """Whether the job is over (closed by ``set_closed``/``shutdown`` on some host)."""

    @abc.abstractmethod
    async def set_closed(self) -> None:
        """Close the job for every host: later rounds raise ``RendezvousClosedError``."""

    @abc.abstractmethod
    def num_nodes_waiting(self) -> int:
        """Hosts waiting to join while this host's world runs (0 when none, or unknown)."""

    @abc.abstractmethod
    async def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round; return its world once it completed with this host.

        Raises:
            RendezvousTimeoutError: no round completed with this host in time.
            RendezvousClosedError: the job is over, or was stopped.
            RendezvousGracefulExitError: the job finished while this host
                waited for a round: nothing is left to do (not a failure).
            RendezvousConnectionError: the store could not be reached.
            RendezvousError: any other reason the job cannot go on here.

        Cancellation: a stop of the agent cancels it; a cancelled join must
        leave nothing that makes other hosts wait for this one.
        """

    @abc.abstractmethod
    async def shutdown(self) -> bool:
        """End the job for every host after a stop (signal, ``stop()``, cancellation).

        Returns:
            Whether the job was closed; False when there was nothing to
            close or the store could not be reached.  Never raises for that.

        Cancellation: the agent shields it; it must end in bounded time.
        """

    # ---------------------------------------------------------- aioproc's own

    @abc.abstractmethod
    def session(
        self,
        local_world_size: int,
        lease_renewed: Callable[[float], None] | None = None,
        role: str = DEFAULT_ROLE,
    ) -> AbstractAsyncContextManager[Any]:
        """This host's membership for one run: an async context manager.

        The agent enters it before the first round and leaves it when the
        run ends (shielded).  Every round this host joins publishes
        ``local_world_size`` and ``role``, so that every host assigns ranks
        as torch does (``RendezvousInfo``).

        Args:
            local_world_size: this host's number of workers.
            lease_renewed: called after each renewal of this host's lease
                (if the backend has leases) with the ``time.monotonic()`` by
                which it fences itself unless renewed again; the agent's
                guardian then kills the workers, after ``fence_grace``.
            role: the role of this host's workers.
        """

    @abc.abstractmethod
    async def wait_for_change(self) -> WorldChange:
        """Return when the running world must be re-formed (never, for a fixed world).

        Raises:
            RendezvousJobFailedError: the job failed on another host.
            RendezvousClosedError: another host stopped the job.
            RendezvousLeaseLostError: this host was fenced.

        Cancellation: the agent cancels it when its workers end first.
        """

    @abc.abstractmethod
    async def exit_barrier(self, timeout: float) -> WorldChange | None:
        """After this host's workers succeeded: wait (at most ``timeout``) for the other hosts'.

        Returns:
            None once the job is done (or the wait timed out); or the
            change that makes the world re-form meanwhile, in which these
            workers run again.
        """

    @abc.abstractmethod
    async def report_failure(self, failure: Mapping[str, Any]) -> None:
        """Tell every host that the job failed here for good.

        Args:
            failure: the root cause as JSON-able fields (``rank``,
                ``local_rank``, ``pid``, ``exitcode``, ``message``, ...); the
                other hosts raise ``RendezvousJobFailedError`` carrying it.
        """


_BOOL = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


class RendezvousParameters:
    """Where and how the agents of a job meet (torch's ``RendezvousParameters``).

    Args:
        backend: the name of a registered backend: ``"c10d"``, ``"etcd"``
            (dynamic, through an etcd v3 server), ``"static"`` (fixed node
            ranks, no store), or one registered by another package.
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
