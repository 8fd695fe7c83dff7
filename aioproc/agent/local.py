"""``LocalElasticAgent``: run a role's workers on this host, restart on failure.

One attempt is one ``start_processes`` group.  The agent gives every worker
torchrun's environment, waits for the group (all-or-nothing, event driven:
an exit is noticed when it happens), and on failure stops the whole group,
waits the restart policy's backoff and starts the next attempt, logging
into ``attempt_<n>`` beside the earlier attempts' logs, while restarts
remain.  Everything that happens is published as an ``AgentEvent``.

``aclose()`` (or ``stop()`` with a signal and a grace period of its own)
ends the run, as torchelastic's agent treats a stop: it never restarts.
The run's own task does the stopping (one close per attempt, with the
signal and grace period asked for); ``aclose()`` asks and waits for the run
to end.  A stop while the workers are already being stopped (by an earlier
one or a signal) can only cut that stop's grace period short: it closes the
attempt's group again, which brings the SIGKILL forward.

Two faces open an agent: ``open_agent(spec, ...)``, an ``OpenResource``
whose run goes on in a task of the agent's own (``await agent.wait()`` for
its result), as every handle of aioproc opens; and torch's, the constructor
then ``await agent.run()``.

Over several hosts (``spec.rdzv_handler``), each attempt starts with a
rendezvous round that gives the host its group rank and the world; while
the workers run, the handler's ``wait_for_change()`` races the group: a
host lost, arriving or re-joining stops the workers and starts a new round
(a lost host costs a restart, as a failure does), a lost lease (fencing)
stops them within the lease's TTL, another host's final failure ends the
run with that root cause.  A stop closes the rendezvous for every host.

``run()`` is the restart loop; the rest lives beside it: one attempt's
workers (their environment, their group, its events) in
``_workers.Workers``, the multi-host side in ``_hosts.Hosts`` (one per
run; with one host, each of its steps is a no-op), and the arguments'
checks in ``_checks``.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from .._base.owner import Owner
from .._base.resource import OpenResource, handle_closed, handle_opened
from .._base.shield import shielded
from .._errors.summary import ChildFailedError
from .._func import template as _template
from .._func.script import script_dirs
from .._group.rank_launcher import SinkLike
from .._group.rank_launcher import make_sinks as _make_sinks
from .._limits.capacity import Capacity
from .._metrics import hooks as _hooks
from ..logs import DefaultLogsSpecs, LogsSpecs
from ..results import DEFAULT_GRACE_PERIOD, Usage
from ..signals import SignalException, pending_signal
from ..sinks import close_sinks
from . import events as ev
from ._checks import check_agent_args, check_stop_args
from ._hosts import Hosts, RunEnd
from ._workers import Workers, free_port, substitute
from .events import HISTORY_SIZE, STREAM_BUFFER, AgentEvent, EventHub, EventStream
from .spec import RunResult, WorkerGroup, WorkerSpec, WorkerState

if TYPE_CHECKING:
    from ..rendezvous import RendezvousError, WorldChange
    from .watchdog import WatchdogServer

__all__ = ["LocalElasticAgent", "open_agent"]


class LocalElasticAgent:
    """Runs ``spec`` on this host with restarts (torchelastic's local agent).

    The positional order is torch's (>= 2.2): ``LocalElasticAgent(spec,
    logs_specs, start_method, exit_barrier_timeout,
    log_line_prefix_template)``; aioproc's own options are keyword-only.
    This constructor with ``await agent.run()`` is torch's face;
    ``open_agent(spec, ...)`` opens an agent as aioproc opens every handle.

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
        grace_period: seconds between the stop signal and SIGKILL, for every
            stop: a failure's, ``aclose()``'s, a signal's (default
            ``DEFAULT_GRACE_PERIOD``, 30 s, as every group's).
        run_id: ``TORCHELASTIC_RUN_ID`` (default: a random id).
        sinks: where tee'd lines go (see ``start_processes``).
        on_event: called with every ``AgentEvent`` (synchronously: keep it
            quick).
        event_history_size: how many of the last events ``event_history``
            keeps (default ``events.HISTORY_SIZE``, 1000).
        capacity: an ``aioproc.Capacity`` each attempt reserves its
            ``local_world_size`` slots from before it starts (and gives back
            once its workers are reaped); None: no budget.

    Raises:
        TypeError: ``spec`` is not a ``WorkerSpec``, ``logs_specs`` not a
            ``LogsSpecs`` (as when ``start_method`` is passed second, in
            the order of torch < 2.2), or ``log_line_prefix_template`` not a
            str.
        ValueError: a bad start method, duration, run id or history size;
            ``log_dir`` given together with ``logs_specs``; a ``capacity``
            with fewer slots than the spec's workers.

    Usage::

        result = await LocalElasticAgent(spec).run()
        async with LocalElasticAgent(spec, DefaultLogsSpecs(log_dir="logs")) as agent:
            result = await agent.run()  # leaving the block stops the run: aclose()
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
        grace_period: float = DEFAULT_GRACE_PERIOD,
        run_id: str | None = None,
        sinks: Sequence[SinkLike] | None = None,
        on_event: Callable[[AgentEvent], Any] | None = None,
        event_history_size: int = HISTORY_SIZE,
        capacity: Capacity | None = None,
    ) -> None:
        self._preload, grace_period, exit_barrier_timeout = check_agent_args(
            spec,
            logs_specs,
            start_method,
            exit_barrier_timeout,
            log_line_prefix_template,
            log_dir=log_dir,
            grace_period=grace_period,
            run_id=run_id,
            event_history_size=event_history_size,
            capacity=capacity,
        )
        if logs_specs is None:
            logs_specs = DefaultLogsSpecs(
                log_dir=log_dir,
                redirects=spec.redirects,
                tee=spec.tee,
                local_ranks_filter=spec.local_ranks_filter,
            )
        self._spec = spec
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
        # set by a stop while a run is going on: (signal, grace period), and who asked
        self._stop_request: tuple[int, float] | None = None
        self._stop_verb = ""
        self._stop_requested: asyncio.Event | None = None
        self._run_ended: asyncio.Event | None = None
        self._run_task: asyncio.Task[Any] | None = None
        # the workers, one attempt's group at a time (their pids, the signal announced)
        self._workers = Workers(
            spec,
            run_id=self._run_id,
            logs_specs=logs_specs,
            log_line_prefix_template=log_line_prefix_template,
            start_method=start_method,
            grace_period=self._grace_period,
            sinks=self._sinks,
            preload=self._preload,
            publish=self._publish,
            starting=self._attempt_starting,
            stop_asked=self._stop_asked,
            capacity=capacity,
        )
        self._consecutive = 0  # failed attempts in a row, for the policy's backoff delay
        self._held_template: _template.Template | None = None  # the run's forkserver template
        # the run's multi-host coordination (rendezvous, lease, fence), made by run()
        self._hosts: Hosts | None = None
        self._usage: dict[int, Usage] = {}  # the last attempt's, by global rank
        # the metrics recorder, read once per run: one enabled later counts from the next run
        self._rec = _hooks.current
        # opened by open_agent: the task that runs run(), and how the run ended
        self._background: Owner[None] | None = None
        self._outcome: RunResult | BaseException | None = None

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
        group = self._workers.group
        group.state = self._state
        for worker in group.workers:
            worker.id = self._workers.pids.get(worker.local_rank)
        return group

    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of the current attempt's workers."""
        return dict(self._workers.pids)

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
            (with how each worker ended) when a stop (``aclose()``,
            ``stop()``) ended the run; a stop never consumes a restart or
            starts an attempt.

        Raises:
            SignalException: when run inside ``translate_signals`` and a
                signal arrives; the workers are stopped with that signal first.
            RuntimeError: a run of this agent is going on already (one
                ``open_agent`` started, or another task's ``run()``).

        Cancellation: the current attempt's workers are stopped (SIGTERM,
        then SIGKILL after the grace period; shielded and bounded) before the
        cancellation propagates.
        """
        self._begin_run()
        spec = self._spec
        master_addr = spec.master_addr or "127.0.0.1"
        # over several hosts each round names group rank 0's port (the spec's wins):
        # none is taken here, on an address that may not even be this host's
        master_port = spec.master_port or (
            free_port(master_addr) if spec.rdzv_handler is None else 0
        )
        watchdog = self._new_watchdog()
        hosts = self._hosts = self._new_hosts()
        try:
            ended = await self._prepare(hosts, watchdog)
            if ended is not None:
                return ended
            while True:
                if self._stop_request is not None:  # during the watchdog's start
                    return self._finish(WorkerState.STOPPED, {}, {})
                attempt = self._restart_count
                info = await hosts.join()  # over several hosts: this attempt's world
                if isinstance(info, RunEnd):
                    return self._end(info)
                started = time.monotonic()
                with hosts.fenced():
                    result = await self._workers.run(
                        attempt, master_addr, master_port, watchdog, hosts, info
                    )
                self._usage = result.usage
                if hosts.world_change is not None and self._stop_request is None:
                    ended = self._on_world_change(hosts.world_change)
                    if ended is not None:
                        return ended
                    continue  # a new round, the same attempt number unless a host was lost
                if not result.is_failed():
                    # the other hosts' workers may still run: wait for them (bounded)
                    change = await hosts.exit_barrier()
                    if change is not None:
                        ended = self._on_world_change(change)
                        if ended is not None:
                            return ended
                        continue  # the world re-forms: these workers run again in it
                    return self._finish(WorkerState.SUCCEEDED, result.return_values, {})
                if self._stop_request is not None:
                    # the end, as torchelastic treats a stop: never a restart
                    return self._finish(WorkerState.STOPPED, result.return_values, result.failures)
                change = await hosts.change_in_flight()
                if change is not None:
                    ended = self._on_world_change(change)
                    if ended is not None:
                        return ended
                    continue  # a new round: this failure was the change's doing
                ended = await self._after_failure(result, started)
                if ended is not None:
                    return ended
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError) or pending_signal() is not None:
                handle_closed(self)  # the run is over; one cancelled is closed by a stop
            if not isinstance(e, Exception) or _is_signal(e):
                self._state = WorkerState.STOPPED
                sigval = getattr(e, "sigval", None) or pending_signal()
                if sigval is not None and not self._workers.signalled:
                    self._publish(ev.SIGNAL_RECEIVED, signal=signal.Signals(sigval).name)
            else:
                self._state = WorkerState.FAILED
            raise
        finally:
            self._record_run()
            await self._close_run(hosts, watchdog)

    def _begin_run(self) -> None:
        """Mark a run as going on, with nothing of an earlier run's stop left."""
        if self._running:
            raise RuntimeError(f"{self!r} is already running")
        self._running = True
        handle_opened(self)  # until the run ends, or a stop: a leak check names it
        self._run_task = asyncio.current_task()
        self._workers.signalled = False
        self._stop_request = None
        self._stop_verb = ""
        self._stop_requested = asyncio.Event()
        self._run_ended = asyncio.Event()
        self._consecutive = 0
        self._usage = {}
        self._rec = _hooks.current

    def _new_watchdog(self) -> WatchdogServer | None:
        """The run's watchdog server if ``spec.watchdog`` (started by ``_prepare``)."""
        if not self._spec.watchdog:
            return None
        from .watchdog import WatchdogServer

        return WatchdogServer(self._workers.on_watchdog_expired)

    def _new_hosts(self) -> Hosts:
        """The run's multi-host coordination (every step a no-op with one host)."""
        return Hosts(
            self._spec.rdzv_handler,
            self._publish,
            lambda: self._stop_request is not None,
            grace_period=self._grace_period,
            exit_barrier_timeout=self._exit_barrier_timeout,
            recorder=self._rec if self._rec.enabled else None,
            role=self._spec.role,
        )

    def _record_run(self) -> None:
        """Count the run's end in the metrics (torch's ``_record_metrics``), if they are on.

        A run that raised was stopped (a signal, a cancellation) or failed
        (an error of the agent's own); either way its state says which.
        """
        if not self._rec.enabled:
            return
        outcome = {
            WorkerState.SUCCEEDED: "succeeded",
            WorkerState.STOPPED: "stopped",
        }.get(self._state, "failed")
        role = self._spec.role
        self._rec.run_finished(role, role, outcome, self._restart_count)

    def _record_restart(self) -> None:
        """Count a restart the run just decided on (a failure's, or a lost host's)."""
        if self._rec.enabled:
            role = self._spec.role
            self._rec.restarted(role, role, self._remaining_restarts)

    async def _prepare(self, hosts: Hosts, watchdog: WatchdogServer | None) -> RunResult | None:
        """Open the rendezvous session, start the watchdog, take the template.

        Returns:
            The run's end if the session does not open (see ``Hosts.open``),
            else None.
        """
        opened = await hosts.open(self._spec.local_world_size, self._spec.role)
        if opened is not None:
            return self._end(opened)
        if watchdog is not None:
            await watchdog.start()
        if self._start_method == "forkserver":
            # one lease for the whole run: every attempt forks from this
            # template (binaries other than Python scripts are spawned)
            spec = self._spec
            ranks = range(spec.local_world_size)
            head = script_dirs(spec.entrypoint, {r: substitute(spec.args, r) for r in ranks})
            if not isinstance(spec.entrypoint, str) or head:
                self._held_template = await _template.acquire(self._preload, head)
        return None

    async def _close_run(self, hosts: Hosts, watchdog: WatchdogServer | None) -> None:
        """Release what the run held, close its events and let ``stop()`` return.

        Cancellation: every step runs to its end: the rendezvous' and the
        template's are shielded, the others bounded.
        """
        await hosts.aclose(stopped=self._state == WorkerState.STOPPED)
        template, self._held_template = self._held_template, None
        if template is not None:
            await shielded(_template.release(template))
        if watchdog is not None:
            await watchdog.aclose()
        # bounded, and never raises for a sink's sake
        await close_sinks(list(self._sinks or ()))
        self._running = False
        self._events.close()
        assert self._run_ended is not None
        self._run_ended.set()

    async def _after_failure(self, result: RunResult, started: float) -> RunResult | None:
        """After a failed attempt (``started`` then): the run's end, or None to restart.

        An expected exit code ends the run as a success.  Otherwise the
        attempt failed: a restart is spent, and the policy's backoff waited
        (cut short by ``stop()``, which ends the run), while restarts
        remain; else every host is told the root cause and the run fails.
        """
        assert self._hosts is not None
        assert self._stop_requested is not None
        spec = self._spec
        policy = spec.restart_policy
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
        if policy.reset_after is not None and (time.monotonic() - started >= policy.reset_after):
            self._remaining_restarts = spec.max_restarts
            self._consecutive = 0
        if self._remaining_restarts <= 0:
            # every host must stop and report this root cause
            await self._hosts.report_failure(root_rank, root)
            return self._finish(WorkerState.FAILED, result.return_values, result.failures)
        self._remaining_restarts -= 1
        self._restart_count += 1
        self._record_restart()
        delay = policy.delay(self._consecutive)
        self._consecutive += 1
        self._state = WorkerState.UNHEALTHY
        self._publish(
            ev.RESTART_SCHEDULED,
            delay=delay,
            message=f"restart {self._restart_count} of {spec.max_restarts} in {delay:.3g} s",
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
        return None

    def _on_world_change(self, change: WorldChange | RendezvousError) -> RunResult | None:
        """After the rendezvous ended an attempt: the run's end, or None to re-join."""
        assert self._hosts is not None
        outcome = self._hosts.outcome(change)
        if isinstance(outcome, RunEnd):
            return self._end(outcome)
        change = outcome  # a world change: re-join
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
            self._record_restart()
        return None

    def _finish(
        self,
        state: WorkerState,
        values: dict[int, Any],
        failures: dict[int, Any],
        message: str = "",
    ) -> RunResult:
        self._state = state
        handle_closed(self)  # the run is over
        kind = {
            WorkerState.SUCCEEDED: ev.GROUP_SUCCEEDED,
            WorkerState.STOPPED: ev.GROUP_STOPPED,
        }.get(state, ev.GROUP_FAILED)
        if state == WorkerState.STOPPED and self._stop_request is not None and not message:
            sig, grace = self._stop_request
            name = signal.Signals(sig).name
            message = f"stopped by {self._stop_verb} with {name}, grace {grace:g} s"
        self._publish(kind, message=message)
        result = RunResult(
            state, values, failures, self._logs_specs.run_log_dir, message, usage=self._usage
        )
        if failures and self._hosts is not None:
            result.host = self._hosts.failure_host()  # "" (the default) with one host
        return result

    def _end(self, end: RunEnd) -> RunResult:
        """``_finish`` the run as the rendezvous ended it."""
        return self._finish(end.state, {}, end.failures, end.message)

    # ------------------------------------------------------------- callbacks

    def _publish(self, kind: str, **fields: Any) -> None:
        self._events.publish(
            AgentEvent(kind=kind, role=self._spec.role, attempt=self._restart_count, **fields)
        )

    def _attempt_starting(self, attempt: int) -> None:
        """An attempt's environment is ready: its workers are about to start."""
        self._state = WorkerState.HEALTHY
        self._publish(ev.ATTEMPT_STARTED, message=f"attempt {attempt}")

    async def _stop_asked(self) -> tuple[int, float]:
        """Wait for ``stop()`` to ask; its signal and grace period."""
        assert self._stop_requested is not None
        await self._stop_requested.wait()
        assert self._stop_request is not None
        return self._stop_request

    # ---------------------------------------------------------------- close

    async def aclose(self) -> None:
        """End the run: stop the workers and return once the run has ended.

        The workers get SIGTERM, then SIGKILL after the agent's
        ``grace_period`` (``ForcedKillWarning`` names each one killed); the
        run (``run()``, or the one ``open_agent`` started) then returns a
        ``RunResult`` with state STOPPED (SUCCEEDED if every worker had
        already succeeded): a stop is the end of the run, never a failure
        to restart from, as in torchelastic.  Asked while the group
        starts, the group is stopped once started; asked during a restart's
        backoff, no new attempt starts.  Idempotent and safe from any task:
        a call while a stop is under way waits for the same end; a call
        when no run is going on returns at once.

        Cancellation: shielded: the stop and the wait for the run's end
        (bounded by the grace period, the kill and the rendezvous' close)
        finish, then the cancellation is re-raised.
        """
        await shielded(self._close(signal.SIGTERM))

    async def stop(
        self,
        death_sig: int = signal.SIGTERM,
        grace_period: float | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """End the run with ``death_sig`` and a grace period of its own; see ``aclose()``.

        A call while the workers are already being stopped (by an earlier
        stop, or by a signal under ``translate_signals``) keeps that stop's
        signal but can cut its grace period short: the workers still
        running are killed ``grace_period`` seconds from now if that is
        sooner (at once with ``death_sig=SIGKILL``), as a second Ctrl-C does
        in ``aioproc run``.  Calls when no run is going on return at once.

        Args:
            death_sig: the graceful signal sent to every worker's group.
            grace_period: seconds before SIGKILL (default: the agent's
                ``grace_period``).
            timeout: the old name of ``grace_period``; deprecated.

        Raises:
            ValueError: ``death_sig`` is not a signal, or ``grace_period``
                is negative or not a number.
            TypeError: both ``grace_period`` and ``timeout`` are given.

        Cancellation: the stop goes on in the run's task (shielded and
        bounded, like ``PContext.close``); only the wait for it is
        cancelled.
        """
        name = "grace_period"
        if timeout is not None:
            if grace_period is not None:
                raise TypeError(
                    f"give grace_period={grace_period!r} or timeout={timeout!r} "
                    f"(its old name), not both"
                )
            warnings.warn(
                "LocalElasticAgent.stop(timeout=...) is deprecated: "
                "use stop(grace_period=...), the seconds before SIGKILL",
                DeprecationWarning,
                stacklevel=2,
            )
            grace_period, name = timeout, "timeout"
        sig, grace = check_stop_args(death_sig, grace_period, self._grace_period, name=name)
        await self._stop(sig, grace, "stop()")

    async def _stop(self, sig: signal.Signals, grace: float, verb: str) -> None:
        """Ask the run (if one is going on) to stop with ``sig``; wait for its end."""
        handle_closed(self)
        if not self._running or self._run_ended is None:
            return
        stopping = self._stop_request is not None or self._workers.signalled
        if self._run_task is not None and pending_signal(self._run_task) is not None:
            stopping = True  # a signal's stop is on its way to the group
        if self._stop_request is None:
            self._stop_request = (int(sig), float(grace))
            self._stop_verb = verb
            assert self._stop_requested is not None
            self._stop_requested.set()
            if self._hosts is not None:
                self._hosts.cancel_join()
        pc = self._workers.pc
        if stopping and pc is not None:
            # a second close of the group: it only brings the SIGKILL forward
            await pc.close(sig, grace)
        await self._run_ended.wait()

    async def _close(self, sig: int) -> None:
        """``aclose()`` with ``sig``; the run ``open_agent`` started ends too."""
        if self._background is not None and not self._running:
            # its run has not begun (or is over): there is nothing to ask, only a task to end
            self._background.cancel()
        await self._stop(signal.Signals(sig), self._grace_period, "aclose()")
        if self._background is not None:
            await self._background.wait()

    async def _open(self) -> LocalElasticAgent:
        """Start ``run()`` in a task of the agent's own (``open_agent``); return the agent."""
        if self._running or self._background is not None:
            raise RuntimeError(f"{self!r} was started before: an agent opens once")
        owner: Owner[None] = Owner(f"aioproc-agent-{self._spec.role}")
        self._background = owner

        async def body(group: anyio.abc.TaskGroup) -> None:
            try:
                self._outcome = await self.run()
            except Exception as e:  # the run's own error: wait() raises it
                self._outcome = e
            except BaseException as e:  # cancelled with the loop: stopped all the same
                self._outcome = e
                raise

        owner.start(body)
        try:
            # run() marks itself running before its first await: a close from now on stops it
            await owner.opened()
        except asyncio.CancelledError:
            await shielded(self._close(signal.SIGTERM))  # nobody else could close it
            raise
        return self

    async def wait(self) -> RunResult:
        """The result of the run ``open_agent`` started, once it has ended.

        Returns:
            The run's ``RunResult`` (see ``run()``).

        Raises:
            RuntimeError: the agent was not opened with ``open_agent``
                (torch's face: ``await agent.run()`` returns the result).
            Exception: what the run raised (an error of the agent's own).

        Cancellation: the run goes on; ``aclose()`` stops it.
        """
        if self._background is None:
            raise RuntimeError(
                f"{self!r} was not opened with open_agent(): await agent.run() for its result"
            )
        await self._background.wait()
        outcome = self._outcome
        if isinstance(outcome, RunResult):
            return outcome
        if isinstance(outcome, Exception):
            raise outcome
        raise RuntimeError(f"the run of {self!r} was cancelled before it ended")

    async def __aenter__(self) -> LocalElasticAgent:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def open_agent(
    spec: WorkerSpec,
    *,
    logs_specs: LogsSpecs | None = None,
    start_method: str = "spawn",
    exit_barrier_timeout: float = 300,
    log_line_prefix_template: str | None = None,
    log_dir: str | None = None,
    grace_period: float = DEFAULT_GRACE_PERIOD,
    run_id: str | None = None,
    sinks: Sequence[SinkLike] | None = None,
    on_event: Callable[[AgentEvent], Any] | None = None,
    event_history_size: int = HISTORY_SIZE,
    capacity: Capacity | None = None,
) -> OpenResource[LocalElasticAgent]:
    """Run ``spec``'s workers with restarts, in a task of the agent's own.

    Awaited, it starts the run and returns the ``LocalElasticAgent``:
    ``await agent.wait()`` is the run's ``RunResult``, ``await
    agent.aclose()`` stops it.  With ``async with``, leaving the block
    stops the run (with the signal that ended the block, under
    ``translate_signals``) and waits for its end.  The arguments are
    ``LocalElasticAgent``'s, keyword-only after ``spec``; they are checked
    at the call, before anything starts.

    Usage::

        async with open_agent(spec, log_dir="logs") as agent:
            result = await agent.wait()

    Returns:
        An ``OpenResource``: ``await`` it, or use it with ``async with``.

    Raises:
        TypeError, ValueError: as ``LocalElasticAgent`` (at the call).

    Cancellation: cancelled while it opens, the run is started and stopped
    again; leaving the ``async with`` block by a cancellation stops the run
    (shielded and bounded, as ``aclose()``) before it propagates.
    """
    agent = LocalElasticAgent(
        spec,
        logs_specs,
        start_method,
        exit_barrier_timeout,
        log_line_prefix_template,
        log_dir=log_dir,
        grace_period=grace_period,
        run_id=run_id,
        sinks=sinks,
        on_event=on_event,
        event_history_size=event_history_size,
        capacity=capacity,
    )

    async def close(agent: LocalElasticAgent, exc: BaseException | None) -> None:
        # a signal that ended the block stops the workers with that signal
        sig: int = signal.SIGTERM
        if isinstance(exc, SignalException):
            sig = exc.sigval
        elif isinstance(exc, asyncio.CancelledError):
            sig = pending_signal() or signal.SIGTERM
        await shielded(agent._close(sig))

    return OpenResource(agent._open, close, "open_agent(...)")


def _is_signal(e: BaseException) -> bool:
    return type(e).__name__ == "SignalException"


def _text(message: Any) -> str:
    if isinstance(message, dict):
        return str(message.get("message", message))
    return str(message)
