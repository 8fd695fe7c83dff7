"""``LocalElasticAgent``: run a role's workers on this host, restart on failure.

One attempt is one ``start_processes`` group.  The agent gives every worker
torchrun's environment, waits for the group (all-or-nothing, event driven:
an exit is noticed when it happens), and on failure stops the whole group,
waits the restart policy's backoff and starts the next attempt, logging
into ``attempt_<n>`` beside the earlier attempts' logs, while restarts
remain.  Everything that happens is published as an ``AgentEvent``.

``stop()`` ends the run, as torchelastic's agent treats a stop: it never
restarts.  The run's own task does the stopping (one close per attempt,
with the signal and grace period ``stop()`` was given); ``stop()`` asks and
waits for the run to end.  A ``stop()`` while the workers are already
being stopped (by an earlier ``stop()`` or a signal) can only cut that
stop's grace period short: it closes the attempt's group again, which
brings the SIGKILL forward.

Over several hosts (``spec.rdzv_handler``), each attempt starts with a
rendezvous round that gives the host its group rank and the world; while
the workers run, the handler's ``wait_for_change()`` races the group: a
host lost, arriving or re-joining stops the workers and starts a new round
(a lost host costs a restart, as a failure does), a lost lease (fencing)
stops them within the lease's TTL, another host's final failure ends the
run with that root cause.  A stop closes the rendezvous for every host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from .._base.checks import check_duration, check_path_name, check_preload, check_start_method
from .._base.shield import shielded
from .._errors.failure import ProcessFailure
from .._errors.summary import ChildFailedError
from .._func import template as _template
from .._func.script import script_dirs
from .._group.rank_launcher import SinkLike
from .._group.rank_launcher import make_sinks as _make_sinks
from .._proc import lifeline as _lifeline
from ..context import PContext, RunProcsResult, WorkerEvent
from ..logs import DefaultLogsSpecs, LogsSpecs
from ..signals import pending_signal
from ..sinks import close_sinks
from . import events as ev
from .events import HISTORY_SIZE, STREAM_BUFFER, AgentEvent, EventHub, EventStream
from .spec import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState

if TYPE_CHECKING:
    from ..rendezvous import RendezvousError, RendezvousHandler, RendezvousInfo, WorldChange
    from .watchdog import WatchdogServer

__all__ = ["LocalElasticAgent"]

logger = logging.getLogger("aioproc")

LOCAL_RANK_MACRO = "${local_rank}"

FAILURE_SETTLE = 1.0
"""Seconds a failed attempt on several hosts waits for a world change in flight.

When another host stops its workers for a new round, a worker here that was
talking to them can fail before this host's watch delivers the same change;
such a failure is the change's doing and must not spend a restart."""


class LocalElasticAgent:
    """Runs ``spec`` on this host with restarts (torchelastic's local agent).

    The positional order is torch's (>= 2.2): ``LocalElasticAgent(spec,
    logs_specs, start_method, exit_barrier_timeout,
    log_line_prefix_template)``; aioproc's own options are keyword-only.

    Args:
        spec: what to run.
        logs_specs: where the workers' logs go (a ``LogsSpecs``); None:
            ``DefaultLogsSpecs`` with ``log_dir`` and the spec's
            redirects/tee/local_ranks_filter.
        start_method: ``"spawn"`` or ``"forkserver"``: function workers are
            forked from a template that imported ``spec.preload``; the agent
            holds it for its whole run, so every restart reuses it.
        exit_barrier_timeout: over several hosts, how long a host whose
            workers succeeded waits for the other hosts' workers before it
            closes the job; unused with one host.
        log_line_prefix_template: the console prefix of each worker's lines,
            with ``${role_name}``, ``${rank}`` and ``${local_rank}`` (torch's
            ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``, which ``aioproc run``
            reads); None: ``[{role}{local_rank}]:``. Never read from nor
            written to ``os.environ``.
        log_dir: base directory of the logs when ``logs_specs`` is None
            (torch's layout); ``None``: a private temp dir.
        grace_period: seconds between the stop signal and SIGKILL.
        run_id: ``TORCHELASTIC_RUN_ID`` (default: a random id).
        sinks: where tee'd lines go (see ``start_processes``).
        on_event: called with every ``AgentEvent`` (synchronously: keep it
            quick).
        event_history_size: how many of the last events ``event_history``
            keeps (default ``events.HISTORY_SIZE``, 1000).

    Raises:
        TypeError: ``spec`` is not a ``WorkerSpec``, ``logs_specs`` not a
            ``LogsSpecs`` (as when ``start_method`` is passed second, in
            the order of torch < 2.2), or ``log_line_prefix_template`` not a
            str.
        ValueError: a bad start method, duration, run id or history size;
            ``log_dir`` given together with ``logs_specs``.

    Usage::

        result = await LocalElasticAgent(spec).run()
        async with LocalElasticAgent(spec, DefaultLogsSpecs(log_dir="logs")) as agent:
            result = await agent.run()
    """

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs | None = None,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
        *,
        log_dir: str | None = None,
        grace_period: float = 30.0,
        run_id: str | None = None,
        sinks: Sequence[SinkLike] | None = None,
        on_event: Callable[[AgentEvent], Any] | None = None,
        event_history_size: int = HISTORY_SIZE,
    ) -> None:
        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"spec must be a WorkerSpec, got {spec!r}")
        if logs_specs is not None and not isinstance(logs_specs, LogsSpecs):
            raise TypeError(
                f"logs_specs must be a LogsSpecs (the second argument, as in torch >= 2.2), "
                f"got {logs_specs!r}"
            )
        if logs_specs is not None and log_dir is not None:
            raise ValueError(
                f"give log_dir={log_dir!r} or logs_specs, not both (logs_specs has its own log_dir)"
            )
        if log_line_prefix_template is not None and not isinstance(log_line_prefix_template, str):
            raise TypeError(
                f"log_line_prefix_template must be a str, got {log_line_prefix_template!r}"
            )
        check_start_method(start_method)
        self._preload = check_preload(start_method, spec.preload)
        grace_period = check_duration("grace_period", grace_period)
        exit_barrier_timeout = check_duration("exit_barrier_timeout", exit_barrier_timeout)
        if run_id is not None:
            check_path_name("run_id", run_id)
        if (
            isinstance(event_history_size, bool)
            or not isinstance(event_history_size, int)
            or event_history_size <= 0
        ):
            raise ValueError(
                f"event_history_size must be a positive int, got {event_history_size!r}"
            )
        if logs_specs is None:
            logs_specs = DefaultLogsSpecs(
                log_dir=log_dir,
                redirects=spec.redirects,
                tee=spec.tee,
                local_ranks_filter=spec.local_ranks_filter,
            )
        self._spec = spec
        self._worker_group = WorkerGroup(spec)
        self._log_line_prefix_template = log_line_prefix_template
        self._start_method = start_method
        self._exit_barrier_timeout = exit_barrier_timeout
        self._logs_specs = logs_specs
        self._grace_period = float(grace_period)
        self._run_id = run_id or uuid.uuid4().hex[:12]
        # converted once: the same sink objects serve every attempt
        self._sinks = _make_sinks(sinks) if sinks is not None else None
        self._events = EventHub(event_history_size)
        if on_event is not None:
            self._events.add_callback(on_event)
        self._state = WorkerState.INIT
        self._restart_count = 0
        self._remaining_restarts = spec.max_restarts
        self._running = False
        self._pids: dict[int, int] = {}
        self._watchdog_expired: dict[int, str] = {}
        self._signalled = False
        # set by stop() while a run is going on: (signal, grace period)
        self._stop_request: tuple[int, float] | None = None
        self._stop_requested: anyio.Event | None = None
        self._run_ended: anyio.Event | None = None
        self._run_task: asyncio.Task[Any] | None = None
        self._pc: PContext | None = None  # the current attempt's group
        # set when the rendezvous ends the current attempt (a world change, or an error)
        self._world_change: WorldChange | RendezvousError | None = None
        self._failed_host = ""  # the host whose failure ended a run over several hosts
        self._rdzv_scope: anyio.CancelScope | None = None  # while joining a rendezvous

    def __repr__(self) -> str:
        return (
            f"<LocalElasticAgent {self._spec.role} x{self._spec.local_world_size} "
            f"{self._state.value} restarts={self._restart_count}/{self._spec.max_restarts}>"
        )

    # ----------------------------------------------------------------- state

    @property
    def spec(self) -> WorkerSpec:
        return self._spec

    @property
    def state(self) -> WorkerState:
        return self._state

    @property
    def restart_count(self) -> int:
        return self._restart_count

    @property
    def run_id(self) -> str:
        return self._run_id

    def get_worker_group(self, role: str | None = None) -> WorkerGroup:
        """The workers as torch's ``get_worker_group`` shows them.

        The same object every call, refreshed by each call: ``state`` is
        the agent's, each worker's ``id`` its pid while its attempt runs.

        Args:
            role: accepted for torch's signature; this agent runs one role.

        Returns:
            The agent's ``WorkerGroup``.
        """
        group = self._worker_group
        group.state = self._state
        for worker in group.workers:
            worker.id = self._pids.get(worker.local_rank)
        return group

    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of the current attempt's workers."""
        return dict(self._pids)

    def events(self, maxsize: int = STREAM_BUFFER) -> EventStream:
        """An async iterator of events from now until ``run()`` returns.

        The agent never waits for the reader: it buffers up to ``maxsize``
        events for it, then drops the oldest; the reader is told with an
        ``events_dropped`` event (and ``stream.dropped`` counts them).
        """
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize <= 0:
            raise ValueError(f"maxsize must be a positive int, got {maxsize!r}")
        return self._events.subscribe(maxsize)

    def add_event_handler(self, fn: Callable[[AgentEvent], Any]) -> None:
        self._events.add_callback(fn)

    @property
    def event_history(self) -> list[AgentEvent]:
        """The last ``event_history_size`` events, oldest first."""
        return list(self._events.history)

    # ------------------------------------------------------------------- run

    async def run(self) -> RunResult:
        """Run the workers until they succeed or the restarts are used up.

        Returns:
            ``RunResult`` keyed by global rank: SUCCEEDED with the return
            values, FAILED with the last attempt's failures, or STOPPED
            (with how each worker ended) when ``stop()`` ended the run;
            a stop never consumes a restart or starts an attempt.

        Raises:
            SignalException: when run inside ``translate_signals`` and a
                signal arrives; the workers are stopped with that signal first.

        Cancellation: the current attempt's workers are stopped (SIGTERM,
        then SIGKILL after the grace period; shielded and bounded) before the
        cancellation propagates.
        """
        if self._running:
            raise RuntimeError(f"{self!r} is already running")
        self._running = True
        self._run_task = asyncio.current_task()
        self._signalled = False
        self._stop_request = None
        self._stop_requested = anyio.Event()
        self._run_ended = anyio.Event()
        spec = self._spec
        policy = spec.restart_policy
        master_addr = spec.master_addr or "127.0.0.1"
        master_port = spec.master_port or _free_port(master_addr)
        consecutive = 0
        watchdog: WatchdogServer | None = None
        if spec.watchdog:
            from .watchdog import WatchdogServer

            watchdog = WatchdogServer(self._on_watchdog_expired)
        template: _template.Template | None = None
        handler = spec.rdzv_handler
        info: RendezvousInfo | None = None
        rendezvous = contextlib.AsyncExitStack()
        # The lease fence kept by the guardian, not by this loop: the workers
        # die by the end of the fence's grace period even while this process
        # is stopped, starved or wedged, before etcd can expire the lease
        # and the other hosts re-form without this one.  The guardian hears
        # of renewals once per grace period: it never fences before this
        # loop would (at the deadline itself).
        fence = _lifeline.Fence()
        try:
            if handler is not None:

                def renewed(deadline: float, grace: float = handler.fence_grace) -> None:
                    fence.renew(deadline + grace, lag=grace)

                opened = await self._open_session(
                    rendezvous, handler.session(spec.local_world_size, renewed)
                )
                if opened is not None:
                    return opened
            if watchdog is not None:
                await watchdog.start()
            if self._start_method == "forkserver":
                # one lease for the whole run: every attempt forks from this
                # template (binaries other than Python scripts are spawned)
                ranks = range(spec.local_world_size)
                head = script_dirs(spec.entrypoint, {r: _substitute(spec.args, r) for r in ranks})
                if not isinstance(spec.entrypoint, str) or head:
                    template = await _template.acquire(self._preload, head)
            while True:
                if self._stop_request is not None:  # during the watchdog's start
                    return self._finish(WorkerState.STOPPED, {}, {})
                attempt = self._restart_count
                if handler is not None:
                    joined = await self._rendezvous(handler)
                    if isinstance(joined, RunResult):
                        return joined
                    info = joined
                started = time.monotonic()
                with fence.scope():
                    result = await self._run_attempt(
                        attempt, master_addr, master_port, watchdog, info
                    )
                if self._world_change is not None and self._stop_request is None:
                    ended = self._on_world_change(self._world_change)
                    if ended is not None:
                        return ended
                    continue  # a new round, the same attempt number unless a host was lost
                if not result.is_failed():
                    if handler is not None:
                        # the other hosts' workers may still run: wait for them (bounded)
                        change = await self._exit_barrier(handler)
                        if change is not None:
                            ended = self._on_world_change(change)
                            if ended is not None:
                                return ended
                            continue  # the world re-forms: these workers run again in it
                    return self._finish(WorkerState.SUCCEEDED, result.return_values, {})
                if self._stop_request is not None:
                    # the end, as torchelastic treats a stop: never a restart
                    return self._finish(WorkerState.STOPPED, result.return_values, result.failures)
                if handler is not None and handler.get_backend() != "static":
                    change = await self._change_in_flight(handler)
                    if change is not None:
                        ended = self._on_world_change(change)
                        if ended is not None:
                            return ended
                        continue  # a new round: this failure was the change's doing
                root_rank, root = ChildFailedError(spec.role, result.failures).get_first_failure()
                if root.exitcode in policy.expected_exit_codes:
                    return self._finish(
                        WorkerState.SUCCEEDED,
                        result.return_values,
                        result.failures,
                        f"rank {root_rank} exited with expected exit code {root.exitcode}",
                    )
                self._publish(
                    ev.ATTEMPT_FAILED,
                    local_rank=root_rank,
                    rank=root_rank,
                    pid=root.pid,
                    exitcode=root.exitcode,
                    signal=root.signal_name() if root.exitcode < 0 else None,
                    message=_text(root.message),
                )
                if policy.reset_after is not None and (
                    time.monotonic() - started >= policy.reset_after
                ):
                    self._remaining_restarts = spec.max_restarts
                    consecutive = 0
                if self._remaining_restarts <= 0:
                    if handler is not None:
                        # every host must stop and report this root cause
                        await self._report_failure(handler, _failure_record(root_rank, root))
                    return self._finish(WorkerState.FAILED, result.return_values, result.failures)
                self._remaining_restarts -= 1
                self._restart_count += 1
                delay = policy.delay(consecutive)
                consecutive += 1
                self._state = WorkerState.UNHEALTHY
                self._publish(
                    ev.RESTART_SCHEDULED,
                    delay=delay,
                    message=f"restart {self._restart_count} of {spec.max_restarts} "
                    f"in {delay:.3g} s",
                )
                if delay > 0:
                    # the policy's backoff delay, cut short by stop()
                    with anyio.move_on_after(delay):
                        await self._stop_requested.wait()
                if self._stop_request is not None:
                    # stopped during the backoff: the scheduled restart never happens
                    self._restart_count -= 1
                    self._remaining_restarts += 1
                    return self._finish(WorkerState.STOPPED, result.return_values, result.failures)
        except BaseException as e:
            if not isinstance(e, Exception) or _is_signal(e):
                self._state = WorkerState.STOPPED
                sigval = getattr(e, "sigval", None) or pending_signal()
                if sigval is not None and not self._signalled:
                    self._publish(ev.SIGNAL_RECEIVED, signal=signal.Signals(sigval).name)
            else:
                self._state = WorkerState.FAILED
            raise
        finally:
            fence.close()
            if handler is not None:
                if self._state == WorkerState.STOPPED:
                    # a stop (signal, stop(), cancellation) closes the job on every host
                    await shielded(handler.shutdown())
                # bounded: revoking the lease and closing the connection time out
                with anyio.CancelScope(shield=True):
                    await rendezvous.aclose()
            if template is not None:
                await shielded(_template.release(template))
            if watchdog is not None:
                await watchdog.aclose()
            # bounded, and never raises for a sink's sake
            await close_sinks(list(self._sinks or ()))
            self._running = False
            self._events.close()
            self._run_ended.set()

    async def _open_session(
        self, stack: contextlib.AsyncExitStack, session: contextlib.AbstractAsyncContextManager[Any]
    ) -> RunResult | None:
        """Enter the rendezvous ``session`` into ``stack``; the run's end if it does not open.

        A store not reached within the join timeout ends the run (FAILED,
        with the handler's one-line reason); a stop while connecting ends
        it at once (STOPPED).
        """
        from ..rendezvous import RendezvousError

        try:
            # stop() cancels this scope, as it does a rendezvous
            with anyio.CancelScope() as self._rdzv_scope:
                await stack.enter_async_context(session)
        except RendezvousError as e:
            return self._finish(WorkerState.FAILED, {}, {}, str(e))
        finally:
            self._rdzv_scope = None
        if self._stop_request is not None:
            return self._finish(WorkerState.STOPPED, {}, {})
        return None

    async def _rendezvous(self, handler: RendezvousHandler) -> RendezvousInfo | RunResult:
        """The next round's info, or the run's end (a stop, or the rendezvous failed)."""
        from ..rendezvous import RendezvousError, RendezvousGracefulExitError

        assert self._stop_requested is not None
        self._publish(ev.RENDEZVOUS_STARTED, message=f"joining the rendezvous of {handler!r}")
        info: RendezvousInfo | None = None
        try:
            # stop() cancels this scope: a stop during the rendezvous ends the run at once
            with anyio.CancelScope() as self._rdzv_scope:
                if self._stop_request is None:
                    info = await handler.next_rendezvous()
        except RendezvousGracefulExitError as e:
            # the job finished while this node waited for a round: nothing left to do
            return self._finish(WorkerState.SUCCEEDED, {}, {}, str(e))
        except RendezvousError as e:
            # a job found closed on arrival ran nothing here: no success (torchrun exits 1 too)
            return self._finish(WorkerState.FAILED, {}, {}, str(e))
        finally:
            self._rdzv_scope = None
        if info is None:
            return self._finish(WorkerState.STOPPED, {}, {})
        self._publish(
            ev.RENDEZVOUS_COMPLETED,
            message=f"round {info.round}: group rank {info.group_rank} of "
            f"{info.group_world_size} nodes, world size {info.world_size}",
        )
        return info

    async def _report_failure(self, handler: RendezvousHandler, record: dict[str, Any]) -> None:
        from ..rendezvous import RendezvousError

        try:
            await handler.report_failure(record)
        except RendezvousError as e:  # fenced meanwhile: the others see the lost lease
            logger.warning("could not tell the other hosts of this failure: %s", e)

    async def _change_in_flight(
        self, handler: RendezvousHandler
    ) -> WorldChange | RendezvousError | None:
        """A world change that arrives within ``FAILURE_SETTLE`` of a failed attempt."""
        from ..rendezvous import RendezvousError

        try:
            with anyio.move_on_after(FAILURE_SETTLE):
                return await handler.wait_for_change()
        except RendezvousError as e:
            return e
        return None

    async def _exit_barrier(
        self, handler: RendezvousHandler
    ) -> WorldChange | RendezvousError | None:
        """Wait for the other hosts' workers; a change if the world re-forms meanwhile."""
        from ..rendezvous import RendezvousError

        try:
            return await handler.exit_barrier(self._exit_barrier_timeout)
        except RendezvousError as e:
            return e

    def _on_world_change(self, change: WorldChange | RendezvousError) -> RunResult | None:
        """After the rendezvous ended an attempt: the run's end, or None to re-join."""
        from ..rendezvous import RendezvousClosedError, RendezvousJobFailedError

        self._world_change = None
        if isinstance(change, RendezvousClosedError):
            state = WorkerState.SUCCEEDED if change.finished else WorkerState.FAILED
            return self._finish(state, {}, {}, str(change))
        if isinstance(change, Exception):
            failures: dict[int, Any] = {}
            if isinstance(change, RendezvousJobFailedError) and change.failure is not None:
                rank, failure = _remote_failure(change.failure)
                failures[rank] = failure
                self._failed_host = str(change.failure.get("host", ""))
            return self._finish(WorkerState.FAILED, {}, failures, str(change))
        self._publish(ev.WORLD_CHANGED, message=change.reason)
        if change.lost:  # a lost host costs a restart, as a failure does
            spec = self._spec
            if self._remaining_restarts <= 0:
                return self._finish(
                    WorkerState.FAILED,
                    {},
                    {},
                    f"{change.reason}, and no restarts are left (max_restarts={spec.max_restarts})",
                )
            self._remaining_restarts -= 1
            self._restart_count += 1
        return None

    async def _run_attempt(
        self,
        attempt: int,
        master_addr: str,
        master_port: int,
        watchdog: WatchdogServer | None,
        info: RendezvousInfo | None = None,
    ) -> RunResult:
        spec = self._spec
        n = spec.local_world_size
        if info is not None:
            master_addr, master_port = info.master_addr, info.master_port
        base = info.base_global_rank if info is not None else 0
        envs = {r: self._worker_env(r, attempt, master_addr, master_port, info) for r in range(n)}
        if watchdog is not None:
            for env in envs.values():
                env.update(watchdog.env())
        args = {r: _substitute(spec.args, r) for r in range(n)}
        self._pids = {}
        self._watchdog_expired = {}
        self._state = WorkerState.HEALTHY
        self._publish(ev.ATTEMPT_STARTED, message=f"attempt {attempt}")
        group = self._worker_group
        world = info.world_size if info is not None else n
        group.group_rank = info.group_rank if info is not None else 0
        group.group_world_size = info.group_world_size if info is not None else 1
        group.master_addr, group.master_port = master_addr, master_port
        group.workers = [
            Worker(
                local_rank=r,
                global_rank=base + r,
                role_rank=base + r,
                world_size=world,
                role_world_size=world,
            )
            for r in range(n)
        ]
        pc = PContext(
            spec.role,
            spec.entrypoint,
            args,
            envs,
            self._logs_specs,
            self._log_line_prefix_template,
            self._start_method,
            grace_period=self._grace_period,
            sinks=self._sinks,
            duplicate_stdout_filters=spec.duplicate_stdout_filters,
            duplicate_stderr_filters=spec.duplicate_stderr_filters,
            pass_fds=watchdog.pass_fds() if watchdog is not None else (),
            on_event=self._on_worker_event,
            close_sinks=False,  # they live across attempts; closed when run() ends
            preload=self._preload,
        )
        # known to stop() from here: start() has begun by its first await
        self._pc = pc
        try:
            result = await self._supervise_attempt(pc, watchdog)
        finally:
            self._pc = None
        for rank, scope in self._watchdog_expired.items():
            if rank in result.failures:
                result.failures[rank].message = scope
        state = WorkerState.FAILED if result.is_failed() else WorkerState.SUCCEEDED
        # keyed by global rank, as torch's RunResult
        values = {base + r: v for r, v in result.return_values.items()}
        failures = {base + r: f for r, f in result.failures.items()}
        return RunResult(state, values, failures)

    async def _supervise_attempt(
        self, pc: PContext, watchdog: WatchdogServer | None
    ) -> RunProcsResult:
        """Start the group, wait for it (or for ``stop()``), close it."""
        async with pc:
            if watchdog is not None:
                watchdog.set_workers(pc.pids())
            try:
                result = await self._wait_or_stop(pc)
            except BaseException as e:
                # announce a signal before the workers are stopped with it
                sigval = getattr(e, "sigval", None) or pending_signal()
                if sigval is not None:
                    self._signalled = True
                    self._publish(ev.SIGNAL_RECEIVED, signal=signal.Signals(sigval).name)
                raise
        return result

    async def _wait_or_stop(self, pc: PContext) -> RunProcsResult:
        """The group's result; if ``stop()`` asks first, stop the group as asked.

        The stopper is a task of this attempt's task group, so exactly one
        close (``stop()``'s signal and grace period) runs, in this attempt.
        """
        errors: list[Exception] = []

        async def stop_when_asked() -> None:
            assert self._stop_requested is not None
            await self._stop_requested.wait()
            assert self._stop_request is not None
            try:
                await pc.close(*self._stop_request)
            except Exception as e:  # surfaced by run(), outside the task group
                errors.append(e)

        async def stop_when_the_world_changes(handler: RendezvousHandler) -> None:
            from ..rendezvous import RendezvousError, RendezvousLeaseLostError

            change: WorldChange | RendezvousError
            try:
                change = await handler.wait_for_change()
            except RendezvousError as e:
                change = e
            self._world_change = change
            # fenced: the workers must be gone before the lease expires in etcd
            grace = self._grace_period
            if isinstance(change, RendezvousLeaseLostError):
                grace = min(grace, handler.fence_grace)
            try:
                await pc.close(signal.SIGTERM, grace)
            except Exception as e:  # surfaced by run(), outside the task group
                errors.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_when_asked)
            if self._spec.rdzv_handler is not None:
                tg.start_soon(stop_when_the_world_changes, self._spec.rdzv_handler)
            result = await pc.wait()
            tg.cancel_scope.cancel()  # a close in progress is shielded: it finishes
        if errors:
            raise errors[0]
        assert result is not None
        return result

    def _worker_env(
        self,
        local_rank: int,
        attempt: int,
        master_addr: str,
        master_port: int,
        info: RendezvousInfo | None = None,
    ) -> dict[str, str]:
        spec = self._spec
        n = spec.local_world_size
        rank = local_rank + (info.base_global_rank if info is not None else 0)
        world = info.world_size if info is not None else n
        env = dict(spec.env or {})
        env.update(
            LOCAL_RANK=str(local_rank),
            RANK=str(rank),
            GROUP_RANK=str(info.group_rank if info is not None else 0),
            ROLE_RANK=str(rank),
            ROLE_NAME=spec.role,
            LOCAL_WORLD_SIZE=str(n),
            WORLD_SIZE=str(world),
            GROUP_WORLD_SIZE=str(info.group_world_size if info is not None else 1),
            ROLE_WORLD_SIZE=str(world),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            TORCHELASTIC_RESTART_COUNT=str(attempt),
            TORCHELASTIC_MAX_RESTARTS=str(spec.max_restarts),
            TORCHELASTIC_RUN_ID=self._run_id,
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
        return env

    def _finish(
        self,
        state: WorkerState,
        values: dict[int, Any],
        failures: dict[int, Any],
        message: str = "",
    ) -> RunResult:
        self._state = state
        kind = {
            WorkerState.SUCCEEDED: ev.GROUP_SUCCEEDED,
            WorkerState.STOPPED: ev.GROUP_STOPPED,
        }.get(state, ev.GROUP_FAILED)
        if state == WorkerState.STOPPED and self._stop_request is not None and not message:
            sig, grace = self._stop_request
            message = f"stopped by stop() with {signal.Signals(sig).name}, grace {grace:g} s"
        self._publish(kind, message=message)
        result = RunResult(state, values, failures, self._logs_specs.run_log_dir, message)
        handler = self._spec.rdzv_handler
        if handler is not None and failures:
            result.host = self._failed_host or getattr(handler, "addr", "")
        return result

    # ------------------------------------------------------------- callbacks

    def _publish(self, kind: str, **fields: Any) -> None:
        self._events.publish(
            AgentEvent(kind=kind, role=self._spec.role, attempt=self._restart_count, **fields)
        )

    def _on_worker_event(self, event: WorkerEvent) -> None:
        if event.kind == "stopping":
            # a signal stops the group (e.g. one arriving while it starts):
            # announce it before any worker is signalled, once
            if not self._signalled and event.exitcode is not None:
                self._signalled = True
                self._publish(ev.SIGNAL_RECEIVED, signal=signal.Signals(-event.exitcode).name)
            return
        if event.kind == "started":
            self._pids[event.local_rank] = event.pid
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
            )

    def _on_watchdog_expired(self, local_rank: int, pid: int, scope: str, after: float) -> None:
        message = f"watchdog timer '{scope}' expired after {after:g} s"
        self._watchdog_expired[local_rank] = message
        self._publish(
            ev.WATCHDOG_FIRED, local_rank=local_rank, rank=local_rank, pid=pid, message=message
        )

    # ---------------------------------------------------------------- close

    # ``timeout`` is the grace period before SIGKILL (PContext.close's name), not a deadline
    async def stop(
        self,
        death_sig: int = signal.SIGTERM,
        timeout: float | None = None,
    ) -> None:
        """End the run: stop the workers and return once ``run()`` has ended.

        ``run()`` then returns a ``RunResult`` with state STOPPED (SUCCEEDED
        if every worker had already succeeded): a stop is the end of the
        run, never a failure to restart from, as in torchelastic.  Asked
        while the group starts, the group is stopped once started; asked
        during a restart's backoff, no new attempt starts.  A call while
        the workers are already being stopped (by an earlier ``stop()``, or
        by a signal under ``translate_signals``) keeps that stop's signal
        but can cut its grace period short: the workers still running are
        killed ``timeout`` seconds from now if that is sooner (at once with
        ``death_sig=SIGKILL``), as a second Ctrl-C does in ``aioproc run``.
        Calls when no run is going on return at once.

        Args:
            death_sig: the graceful signal sent to every worker's group.
            timeout: seconds before SIGKILL (default: the agent's
                ``grace_period``).

        Raises:
            ValueError: ``death_sig`` is not a signal, or ``timeout`` is
                negative or not a number.

        Cancellation: the stop goes on in ``run()``'s task (shielded and
        bounded, like ``PContext.close``); only the wait for it is
        cancelled.
        """
        try:
            sig = signal.Signals(death_sig)
        except (ValueError, TypeError):
            raise ValueError(f"death_sig must be a signal number, got {death_sig!r}") from None
        grace = self._grace_period if timeout is None else timeout
        if (
            isinstance(grace, bool)
            or not isinstance(grace, (int, float))
            or math.isnan(grace)
            or grace < 0
        ):
            raise ValueError(f"timeout must be a number >= 0, got {timeout!r}")
        if not self._running or self._run_ended is None:
            return
        stopping = self._stop_request is not None or self._signalled
        if self._run_task is not None and pending_signal(self._run_task) is not None:
            stopping = True  # a signal's stop is on its way to the group
        if self._stop_request is None:
            self._stop_request = (int(sig), float(grace))
            assert self._stop_requested is not None
            self._stop_requested.set()
            if self._rdzv_scope is not None:
                self._rdzv_scope.cancel()
        pc = self._pc
        if stopping and pc is not None:
            # a second close of the group: it only brings the SIGKILL forward
            await pc.close(sig, grace)
        await self._run_ended.wait()

    async def __aenter__(self) -> LocalElasticAgent:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


def _substitute(args: Sequence[Any], local_rank: int) -> tuple[Any, ...]:
    """torchrun's ``${local_rank}`` macro in string arguments."""
    return tuple(
        a.replace(LOCAL_RANK_MACRO, str(local_rank)) if isinstance(a, str) else a for a in args
    )


def _free_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _is_signal(e: BaseException) -> bool:
    return type(e).__name__ == "SignalException"


def _text(message: Any) -> str:
    if isinstance(message, dict):
        return str(message.get("message", message))
    return str(message)


def _failure_record(rank: int, failure: Any) -> dict[str, Any]:
    """What other hosts are told of this host's root cause (JSON)."""
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    else:
        how = f"exited with code {failure.exitcode}"
    message = failure.message
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        message = (extra.get("py_callstack") if isinstance(extra, dict) else None) or message.get(
            "message", ""
        )
    return {
        "rank": rank,
        "local_rank": failure.local_rank,
        "pid": failure.pid,
        "exitcode": failure.exitcode,
        "how": how,
        "error_file": failure.error_file,
        "message": str(message),
        "timestamp": failure.timestamp,
    }


def _remote_failure(record: dict[str, Any]) -> tuple[int, ProcessFailure]:
    """Another host's root cause as a ``ProcessFailure`` for this host's summary."""
    failure = ProcessFailure(
        int(record.get("local_rank", -1)),
        int(record.get("pid", -1)),
        int(record.get("exitcode", 1)),
        "<N/A>",
    )
    failure.error_file = str(record.get("error_file", "<N/A>"))
    failure.message = str(record.get("message", ""))
    failure.timestamp = int(record.get("timestamp", failure.timestamp))
    return int(record.get("rank", -1)), failure
