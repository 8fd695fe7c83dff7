"""This host's workers, one attempt at a time: ``Workers``, owned by the agent.

One attempt is one ``start_processes`` group.  ``Workers.run`` gives every
worker torchrun's environment (``worker_env``), shows the workers in the
agent's ``WorkerGroup``, starts the group, waits for it (all-or-nothing,
event driven: an exit is noticed when it happens) or for ``stop()`` (or,
over several hosts, for ``Hosts.stop_on_change``), closes it, and returns
the attempt's ``RunResult`` keyed by global rank.  What happens to the
workers is published as ``AgentEvent``s through the agent's ``publish``.

The restart loop, the run's state and its end are the agent's: this module
does not import ``local``, it hears of the agent through callbacks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio

from .._errors.summary import ChildFailedError
from .._group.rank_launcher import SinkLike
from .._limits.capacity import Capacity
from .._supervisor.spec import GroupSpec
from ..context import PContext, RunProcsResult, WorkerEvent
from ..logs import LogsSpecs
from ..signals import pending_signal
from . import events as ev
from ._hosts import Hosts, Publish
from .spec import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState

if TYPE_CHECKING:
    from ..rendezvous import RendezvousInfo
    from .watchdog import WatchdogServer

__all__ = [
    "LOCAL_RANK_MACRO",
    "AssignedRanks",
    "Workers",
    "assigned_ranks",
    "free_port",
    "substitute",
    "worker_env",
]

logger = logging.getLogger("aioproc")

LOCAL_RANK_MACRO = "${local_rank}"


class Workers:
    """The agent's workers: one ``PContext`` group per attempt.

    Read by the agent: ``group`` (its ``get_worker_group()``), ``pids``
    (the current or last attempt's), ``pc`` (the running attempt's group,
    for ``stop()``), ``signalled`` (a signal was announced this run; the
    agent resets it when a run starts).

    Args:
        spec: what to run.
        run_id: ``TORCHELASTIC_RUN_ID``.
        logs_specs: where the workers' logs go.
        log_line_prefix_template: the console prefix of each worker's lines.
        start_method: ``"spawn"`` or ``"forkserver"``.
        grace_period: seconds between the stop signal and SIGKILL.
        sinks: where tee'd lines go (converted once; they live across
            attempts and are never closed here).
        preload: the modules a function worker's template imports.
        publish: the agent's ``_publish``.
        starting: called with the attempt's number once its environment is
            ready, before the group is made (the agent's ``attempt_started``).
        stop_asked: waits for ``stop()`` and returns its (signal, grace period).
        capacity: the process budget each attempt's group reserves its
            slots from (given back when the attempt's workers are reaped).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        run_id: str,
        logs_specs: LogsSpecs,
        log_line_prefix_template: str | None,
        start_method: str,
        grace_period: float,
        sinks: Sequence[SinkLike] | None,
        preload: Sequence[str],
        publish: Publish,
        starting: Callable[[int], None],
        stop_asked: Callable[[], Awaitable[tuple[int, float]]],
        capacity: Capacity | None = None,
    ) -> None:
        self._spec = spec
        self._run_id = run_id
        # every attempt's group: this, with the attempt's args, envs and fds
        self._base = GroupSpec(
            spec.role,
            spec.entrypoint,
            {},
            {},
            logs_specs,
            log_line_prefix_template,
            start_method,
            grace_period=grace_period,
            sinks=sinks,
            duplicate_stdout_filters=spec.duplicate_stdout_filters,
            duplicate_stderr_filters=spec.duplicate_stderr_filters,
            on_event=self._on_worker_event,
            close_sinks=False,  # they live across attempts; closed when run() ends
            preload=preload,
            limits=spec.limits,
            capacity=capacity,
            cpus=spec.cpus,
            role=spec.role,
            worker_loop=spec.worker_loop,
        )
        self._publish = publish
        self._starting = starting
        self._stop_asked = stop_asked
        self.group = WorkerGroup(spec)
        self.pids: dict[int, int] = {}
        self._watchdog_expired: dict[int, str] = {}
        self.signalled = False
        self.pc: PContext | None = None  # the current attempt's group

    def __repr__(self) -> str:
        return f"<Workers {self._spec.role} x{self._spec.local_world_size} pids={self.pids}>"

    async def run(
        self,
        attempt: int,
        master_addr: str,
        master_port: int,
        watchdog: WatchdogServer | None,
        hosts: Hosts,
        info: RendezvousInfo | None = None,
    ) -> RunResult:
        """Run one attempt: start the workers, wait for them (or for a stop), close them.

        Args:
            attempt: ``TORCHELASTIC_RESTART_COUNT``.
            master_addr, master_port: rank 0's address with one host (over
                several hosts, ``info``'s unless the spec gives its own).
            watchdog: the run's watchdog server, if ``spec.watchdog``.
            hosts: the run's multi-host coordination.
            info: this attempt's rendezvous round, over several hosts.

        Returns:
            The attempt's ``RunResult`` keyed by global rank (FAILED or
            SUCCEEDED; a failure's message is the watchdog's when it fired),
            with each worker's usage.

        Cancellation: the workers are stopped (SIGTERM, then SIGKILL after
        the grace period; shielded and bounded) before it propagates.
        """
        spec = self._spec
        n = spec.local_world_size
        if info is not None:  # torch's rule: the spec's own address wins over the round's
            master_addr = spec.master_addr or info.master_addr
            master_port = spec.master_port or info.master_port
        ranks = assigned_ranks(n, info)
        base = ranks.base_global_rank
        envs = {
            r: worker_env(spec, self._run_id, r, attempt, master_addr, master_port, info)
            for r in range(n)
        }
        if watchdog is not None:
            for env in envs.values():
                env.update(watchdog.env())
        args = {r: substitute(spec.args, r) for r in range(n)}
        self.pids = {}
        self._watchdog_expired = {}
        self._starting(attempt)
        group = self.group
        group.group_rank = info.group_rank if info is not None else 0
        group.group_world_size = info.group_world_size if info is not None else 1
        group.master_addr, group.master_port = master_addr, master_port
        group.workers = [
            Worker(
                local_rank=r,
                global_rank=base + r,
                role_rank=ranks.base_role_rank + r,
                world_size=ranks.world_size,
                role_world_size=ranks.role_world_size,
            )
            for r in range(n)
        ]
        pass_fds = watchdog.pass_fds() if watchdog is not None else ()
        pc = PContext._from_spec(
            dataclasses.replace(self._base, args=args, envs=envs, pass_fds=pass_fds)
        )
        # known to stop() from here: start() has begun by its first await
        self.pc = pc
        try:
            result = await self._supervise(pc, watchdog, hosts)
        finally:
            self.pc = None
        for rank, scope in self._watchdog_expired.items():
            if rank in result.failures:
                result.failures[rank].message = scope
        state = WorkerState.FAILED if result.is_failed() else WorkerState.SUCCEEDED
        # keyed by global rank, as torch's RunResult
        values = {base + r: v for r, v in result.return_values.items()}
        failures = {base + r: f for r, f in result.failures.items()}
        usage = {base + r: u for r, u in result.usage.items()}
        if failures:
            # torch's ChildFailedError takes the failure of the earliest whole
            # second and, among equals, the first in the dict: the root cause
            # goes first, so a sibling stopped in that second is never taken for it
            root, _ = ChildFailedError(spec.role, failures).get_first_failure()
            failures = {root: failures.pop(root), **failures}
        return RunResult(state, values, failures, usage=usage)

    async def _supervise(
        self, pc: PContext, watchdog: WatchdogServer | None, hosts: Hosts
    ) -> RunProcsResult:
        """Start the group, wait for it (or for ``stop()``), close it."""
        async with pc:
            if watchdog is not None:
                watchdog.set_workers(pc.pids())
            try:
                result = await self._wait_or_stop(pc, hosts)
            except BaseException as e:
                # announce a signal before the workers are stopped with it
                sigval = getattr(e, "sigval", None) or pending_signal()
                if sigval is not None:
                    self.signalled = True
                    self._publish(ev.SIGNAL_RECEIVED, signal=signal.Signals(sigval).name)
                raise
        return result

    async def _wait_or_stop(self, pc: PContext, hosts: Hosts) -> RunProcsResult:
        """The group's result; if ``stop()`` asks first, stop the group as asked.

        The stopper is a task of this attempt's task group, so exactly one
        close (``stop()``'s signal and grace period) runs, in this attempt.
        Over several hosts, ``Hosts.stop_on_change`` is another such task.
        """
        errors: list[Exception] = []

        async def stop_when_asked() -> None:
            request = await self._stop_asked()
            try:
                await pc.close(*request)
            except Exception as e:  # surfaced by run(), outside the task group
                errors.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_when_asked)
            if hosts.handler is not None:
                # over several hosts: a world change stops the group too
                tg.start_soon(hosts.stop_on_change, pc, errors)
            result = await pc.wait()
            tg.cancel_scope.cancel()  # a close in progress is shielded: it finishes
        if errors:
            raise errors[0]
        assert result is not None
        return result

    # ------------------------------------------------------------- callbacks

    def _on_worker_event(self, event: WorkerEvent) -> None:
        if event.kind == "stopping":
            # a signal stops the group (e.g. one arriving while it starts):
            # announce it before any worker is signalled, once
            if not self.signalled and event.exitcode is not None:
                self.signalled = True
                self._publish(ev.SIGNAL_RECEIVED, signal=signal.Signals(-event.exitcode).name)
            return
        if event.kind == "started":
            self.pids[event.local_rank] = event.pid
            self._publish(
                ev.WORKER_STARTED,
                time=event.time,
                local_rank=event.local_rank,
                rank=event.local_rank,
                pid=event.pid,
            )
        else:
            code = event.exitcode
            sig = None
            if code is not None and code < 0:
                try:
                    sig = signal.Signals(-code).name
                except ValueError:
                    sig = f"signal {-code}"
            self._publish(
                ev.WORKER_EXITED,
                time=event.time,
                local_rank=event.local_rank,
                rank=event.local_rank,
                pid=event.pid,
                exitcode=code,
                signal=sig,
                usage=event.usage,
                oom=event.oom,
            )

    def on_watchdog_expired(self, local_rank: int, pid: int, scope: str, after: float) -> None:
        """The run's ``WatchdogServer`` callback: the failure's message, and an event."""
        message = f"watchdog timer '{scope}' expired after {after:g} s"
        self._watchdog_expired[local_rank] = message
        self._publish(
            ev.WATCHDOG_FIRED, local_rank=local_rank, rank=local_rank, pid=pid, message=message
        )


def worker_env(
    spec: WorkerSpec,
    run_id: str,
    local_rank: int,
    attempt: int,
    master_addr: str,
    master_port: int,
    info: RendezvousInfo | None = None,
) -> dict[str, str]:
    """torchrun's environment for ``local_rank`` in ``attempt`` (``spec.env`` beneath it)."""
    n = spec.local_world_size
    ranks = assigned_ranks(n, info)
    env = dict(spec.env or {})
    env.update(
        LOCAL_RANK=str(local_rank),
        RANK=str(ranks.base_global_rank + local_rank),
        GROUP_RANK=str(info.group_rank if info is not None else 0),
        ROLE_RANK=str(ranks.base_role_rank + local_rank),
        ROLE_NAME=spec.role,
        LOCAL_WORLD_SIZE=str(n),
        WORLD_SIZE=str(ranks.world_size),
        GROUP_WORLD_SIZE=str(info.group_world_size if info is not None else 1),
        ROLE_WORLD_SIZE=str(ranks.role_world_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        TORCHELASTIC_RESTART_COUNT=str(attempt),
        TORCHELASTIC_MAX_RESTARTS=str(spec.max_restarts),
        TORCHELASTIC_RUN_ID=run_id,
        # no agent store here: with "True", torch's env:// rendezvous
        # would connect to a store nobody hosts instead of rank 0's own
        TORCHELASTIC_USE_AGENT_STORE="False",
    )
    nccl = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    env.setdefault(nccl, os.environ.get(nccl, "1"))  # torchrun's default; spec.env wins
    if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in env and n > 1:
        if local_rank == 0 and attempt == 0:
            logger.warning(
                "Setting OMP_NUM_THREADS=1 for each of the %d workers to avoid "
                "overloading the host; tune it for best performance.",
                n,
            )
        env["OMP_NUM_THREADS"] = "1"
    if spec.virtual_local_rank:
        # torch's virtual local rank: each worker sees its own GPU only, as device 0
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = spec.visible_device(local_rank)
    return env


class AssignedRanks(NamedTuple):
    """Where this host's workers stand: its local rank 0's ranks, and the sizes."""

    base_global_rank: int
    world_size: int
    base_role_rank: int
    role_world_size: int


def assigned_ranks(local_world_size: int, info: RendezvousInfo | None) -> AssignedRanks:
    """torch's ``_assign_worker_ranks`` for this host (``info``: its round, None: one host).

    Over several hosts, every host published its nproc and role in the
    rendezvous; ``RendezvousInfo`` walks the hosts in group-rank order, as
    torch's rank-0 agent does.  With one host, role and global ranks are
    the local ranks.
    """
    if info is None:
        return AssignedRanks(0, local_world_size, 0, local_world_size)
    return AssignedRanks(
        info.base_global_rank, info.world_size, info.base_role_rank, info.role_world_size
    )


def substitute(args: Sequence[Any], local_rank: int) -> tuple[Any, ...]:
    """torchrun's ``${local_rank}`` macro in string arguments."""
    return tuple(
        a.replace(LOCAL_RANK_MACRO, str(local_rank)) if isinstance(a, str) else a for a in args
    )


def free_port(addr: str) -> int:
    """A port free on ``addr`` now (rank 0's ``MASTER_PORT`` with one host)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])
