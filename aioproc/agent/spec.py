"""What the agent runs: ``WorkerSpec``, ``RestartPolicy``, ``WorkerState``, ``RunResult``."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._base import public_module
from .._base.checks import check_duration, check_env, check_exec_text, check_preload
from .._errors.failure import ProcessFailure
from .._func.boot import check_worker_loop
from .._group.resources import CpusArg, LimitsArg, check_cpus, check_limits
from .._group.restart import RestartPolicy
from ..logs import Std
from ..results import Usage

if TYPE_CHECKING:
    from ..rendezvous.api import RendezvousHandler

__all__ = ["RestartPolicy", "RunResult", "WorkerSpec", "WorkerState"]

public_module(__name__, RestartPolicy)  # shared with the cluster runner, named here


class WorkerState(str, enum.Enum):
    """State of a worker group, with torchelastic's names."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        return state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)


@dataclass
class WorkerSpec:
    """A role's workers on this host (torchelastic's ``WorkerSpec``, one node).

    Attributes:
        role: the role name (``ROLE_NAME``; prefixes ``[role<rank>]:``).
        local_world_size: number of workers.
        entrypoint: a callable (function workers) or an executable (binary
            workers; use ``sys.executable`` and a script in ``args`` for
            Python scripts, as torchrun does).
        args: arguments for every worker; ``"${local_rank}"`` inside a string
            argument is replaced by the worker's local rank.
        max_restarts: restarts of the whole group allowed after failures.
        monitor_interval: accepted for torch compatibility.  aioproc notices
            a worker's exit the moment it happens and runs no periodic health
            check, so this value bounds nothing.
        redirects, tee, local_ranks_filter: as in ``DefaultLogsSpecs``.
        master_addr, master_port: rendezvous address for the workers
            (``MASTER_ADDR``/``MASTER_PORT``); a free port when not given.
            Over several hosts they override the rendezvous's address, each
            on its own, as in torch (``spec.master_addr or`` group rank 0's).
        env: extra environment for every worker.
        restart_policy: backoff and expected exit codes between attempts.
        watchdog: enable ``aioproc.timer`` watchdog timers in the workers.
        duplicate_stdout_filters, duplicate_stderr_filters: as in
            ``start_processes``.
        preload: modules the forkserver template imports before forking the
            workers (with the agent's ``start_method="forkserver"``); the
            agent keeps the template up across restarts.
        rdzv_handler: a ``RendezvousHandler`` (from
            ``aioproc.rendezvous.create_handler``, or of a backend of one's
            own) for a job over several hosts (each runs an agent); None:
            this host alone.  Group rank 0 publishes its address through the
            rendezvous; ``master_addr``/``master_port``, when given, win.
        virtual_local_rank: torch's virtual local rank mode: every worker
            gets ``LOCAL_RANK=0`` and ``CUDA_VISIBLE_DEVICES`` naming only
            its own GPU (see ``visible_device``).
        limits: resource limits of every attempt's workers, as
            ``start_processes(limits=...)`` takes them: one ``aioproc.Limits``
            for each rank (a cgroup per rank), or ``{local_rank: Limits}`` (a
            rank not named runs unlimited); None: no limit.
        cpus: the CPUs each worker may run on, as ``start_processes(cpus=...)``
            takes them: a list of CPU ids for every rank, ``"numa:<node>"``,
            ``"round-robin"`` (one CPU each, in turn), or ``{local_rank:
            list}``; None: wherever this process may run.
        worker_loop: the event loop a coroutine-function ``entrypoint`` runs
            on in each worker, ``"asyncio"`` or ``"uvloop"``, as
            ``start_processes(worker_loop=...)`` takes it.
    """

    role: str
    local_world_size: int
    entrypoint: Callable[..., Any] | str
    args: Sequence[Any] = ()
    max_restarts: int = 3
    monitor_interval: float = 0.1
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    local_ranks_filter: set[int] | None = None
    master_addr: str | None = None
    master_port: int | None = None
    env: Mapping[str, str] | None = None
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    watchdog: bool = False
    duplicate_stdout_filters: Sequence[str] | None = None
    duplicate_stderr_filters: Sequence[str] | None = None
    preload: Sequence[str] = ()
    rdzv_handler: RendezvousHandler | None = None
    virtual_local_rank: bool = False
    limits: LimitsArg = None
    cpus: CpusArg = None
    worker_loop: str = "asyncio"

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not self.role:
            raise ValueError(f"WorkerSpec.role must be a non-empty str, got {self.role!r}")
        if (
            isinstance(self.local_world_size, bool)
            or not isinstance(self.local_world_size, int)
            or self.local_world_size <= 0
        ):
            raise ValueError(
                f"WorkerSpec.local_world_size must be a positive int, got {self.local_world_size!r}"
            )
        check_exec_text("WorkerSpec.role", self.role)  # it becomes ROLE_NAME
        if not isinstance(self.entrypoint, str) and not callable(self.entrypoint):
            raise TypeError(
                f"WorkerSpec.entrypoint must be a callable or a str, got {self.entrypoint!r}"
            )
        if isinstance(self.entrypoint, str):
            check_exec_text("WorkerSpec.entrypoint", self.entrypoint)
        if isinstance(self.args, (str, bytes)) or not isinstance(self.args, Sequence):
            raise TypeError(f"WorkerSpec.args must be a tuple, got {self.args!r}")
        if isinstance(self.entrypoint, str):  # a binary's args become its command line
            for i, arg in enumerate(self.args):
                check_exec_text(f"WorkerSpec.args[{i}]", str(arg))
        check_duration("WorkerSpec.monitor_interval", self.monitor_interval)
        if (
            isinstance(self.max_restarts, bool)
            or not isinstance(self.max_restarts, int)
            or self.max_restarts < 0
        ):
            raise ValueError(
                f"WorkerSpec.max_restarts must be an int >= 0, got {self.max_restarts!r}"
            )
        if self.master_port is not None and not (
            isinstance(self.master_port, int) and 0 < self.master_port < 65536
        ):
            raise ValueError(f"WorkerSpec.master_port must be a TCP port, got {self.master_port!r}")
        if self.env is not None:
            check_env("WorkerSpec.env", self.env)
        self.preload = check_preload("forkserver", self.preload)  # the agent checks the method
        if self.master_addr is not None:
            if not isinstance(self.master_addr, str):
                raise TypeError(
                    f"WorkerSpec.master_addr must be a host name or address, "
                    f"got {self.master_addr!r}"
                )
            check_exec_text("WorkerSpec.master_addr", self.master_addr)  # it becomes MASTER_ADDR
        if not isinstance(self.restart_policy, RestartPolicy):
            raise TypeError(
                f"WorkerSpec.restart_policy must be a RestartPolicy, got {self.restart_policy!r}"
            )
        if self.rdzv_handler is not None:
            from ..rendezvous.api import RendezvousHandler

            if not isinstance(self.rdzv_handler, RendezvousHandler):
                raise TypeError(
                    f"WorkerSpec.rdzv_handler must be an aioproc.rendezvous.RendezvousHandler "
                    f"(from aioproc.rendezvous.create_handler), got {self.rdzv_handler!r}"
                )
        if not isinstance(self.virtual_local_rank, bool):
            raise TypeError(
                f"WorkerSpec.virtual_local_rank must be a bool, got {self.virtual_local_rank!r}"
            )
        if self.virtual_local_rank:
            self.visible_device(self.local_world_size - 1)  # every rank has a device
        # checked now, so a bad limit or CPU set fails before any attempt starts;
        # the checks' messages start with the argument's name, which is ours too
        try:
            self.limits = check_limits(self.limits, self.local_world_size)
            check_cpus(self.cpus, self.local_world_size)
            self.worker_loop = check_worker_loop(self.worker_loop)
        except (TypeError, ValueError) as e:
            raise type(e)(f"WorkerSpec.{e}") from None
        self.args = tuple(self.args)

    def visible_device(self, local_rank: int) -> str:
        """``CUDA_VISIBLE_DEVICES`` of ``local_rank`` with ``virtual_local_rank`` (torch's).

        The local rank's entry of this process's ``CUDA_VISIBLE_DEVICES``,
        or the local rank itself when that is not set.

        Raises:
            ValueError: ``CUDA_VISIBLE_DEVICES`` names fewer devices than
                the local ranks (torch raises the same).
        """
        parent = os.environ.get("CUDA_VISIBLE_DEVICES")
        if parent is None:
            return str(local_rank)
        devices = parent.split(",")
        if local_rank >= len(devices):
            raise ValueError(
                f"virtual local rank: local rank {local_rank} has no GPU of its own: "
                f"CUDA_VISIBLE_DEVICES={parent!r} names {len(devices)}"
            )
        return devices[local_rank].strip()

    def get_entrypoint_name(self) -> str:
        """The entrypoint's name (torch's method of the same name)."""
        if isinstance(self.entrypoint, str):
            return self.entrypoint.rsplit("/", 1)[-1]
        return getattr(self.entrypoint, "__qualname__", repr(self.entrypoint))


@dataclass
class Worker:
    """One worker of a ``WorkerGroup`` (torchelastic's ``Worker``).

    Attributes:
        local_rank: rank on this host.
        global_rank, role_rank: ranks among all workers and among the
            role's workers (with one host, both equal ``local_rank``);
            ``-1`` before the first attempt.
        world_size, role_world_size: the matching sizes; ``-1`` before the
            first attempt.
        id: the worker process's pid while its attempt runs (as torch's
            local agent), else None.
    """

    local_rank: int
    global_rank: int = -1
    role_rank: int = -1
    world_size: int = -1
    role_world_size: int = -1
    id: Any = None


@dataclass
class WorkerGroup:
    """The workers of a ``WorkerSpec`` as the agent runs them (torch's ``WorkerGroup``).

    Returned by ``LocalElasticAgent.get_worker_group()``; the agent updates
    the same object as it runs, as torch's agent does.

    Attributes:
        spec: what the workers run.
        workers: one ``Worker`` per local rank, in rank order.
        state: the group's ``WorkerState``.
        group_rank, group_world_size: this host's rank and the number of
            hosts (``0`` and ``1``); None before the first attempt.
        master_addr, master_port: the workers' ``MASTER_ADDR`` and
            ``MASTER_PORT``; None before the first attempt.
        store: always None: aioproc hosts no agent store (so the workers
            get ``TORCHELASTIC_USE_AGENT_STORE=False``).
    """

    spec: WorkerSpec
    workers: list[Worker] = field(default_factory=list)
    state: WorkerState = WorkerState.INIT
    group_rank: int | None = None
    group_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    store: None = None

    def __post_init__(self) -> None:
        if not self.workers:
            self.workers = [Worker(local_rank=r) for r in range(self.spec.local_world_size)]


@dataclass
class RunResult:
    """Outcome of ``LocalElasticAgent.run()``, keyed by global rank.

    ``log_dir`` is the run's log directory while it exists (``""`` when a
    private temp dir held nothing worth keeping).  ``usage`` is what each
    worker of the last attempt used (``aioproc.Usage``, read at its reap),
    keyed by global rank like ``return_values``; empty when no attempt ran.  ``message`` says why a
    run over several hosts ended without a local worker's failure (a lost
    host, another host's failure, a timed-out rendezvous); else ``""``.
    """

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    log_dir: str = ""
    message: str = ""
    host: str = ""  # where the failures happened, when not on this host alone
    usage: dict[int, Usage] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED
