"""``Supervisor``: one worker group's crew, owned by one task.

A group owns its work in ONE supervisor task and the anyio task group
inside it (an ``Owner``): the launch of every rank (``Launch``), the
exits' watchers and records (``Exits``), the hold of workers that returned
(``Hold``) and the one stop (``Shutdown``).  ``start()`` takes the group's
process slots, plans its log tree, starts the owner and waits until every
rank is launched; ``close()`` (from any task, any number of times) asks the
owner to stop and waits until it has finished.  The first failure asks the
same stop with the graceful signal and the group's grace period, so a
failure and the close after it are one stop.

``PContext`` (``aioproc.context``) is the face: torch's names and
signatures over this object.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import signal
import time
import weakref
from collections.abc import Callable
from typing import Any, cast

import anyio
import anyio.abc

from .._base.offloop import helper, run_blocking
from .._base.owner import Owner
from .._base.shield import shielded
from .._func.barrier import ControlHub
from .._group.checks import check_executable, check_start
from .._group.outcomes import Outcomes
from .._group.rank_launcher import RankLauncher
from .._group.resources import GroupResources
from .._limits.usage import sample_all
from .._metrics import hooks as _hooks
from .._proc import lifeline as _lifeline
from .._proc.spawn import Child
from ..logs import LogsDest, LogsPlan
from ..results import RunProcsResult, WorkerEvent
from ..signals import pending_signal
from ..sinks import Sink
from .exits import Exits, notify
from .hold import Hold
from .launch import Launch
from .shutdown import Shutdown
from .spec import GroupSpec

Request = tuple[int, float]
"""What a stop is asked with: the graceful signal and the grace period."""


class _State(enum.Enum):
    NEW = "new"
    STARTING = "starting"  # slots are awaited or the log tree is made; no worker yet
    RUNNING = "running"
    CLOSED = "closed"


class Supervisor:
    """The crew of one group (see the module docstring); built from a checked spec.

    Attributes:
        spec: the group's checked spec, only read.
        envs: each rank's environment, as the workers get it (the logs spec
            adds ``TORCHELASTIC_ERROR_FILE`` when the group starts).
        dest: the ranks' log and error file paths, once started.
        children: the started workers by rank (the crew shares this dict).
        filtered: ``{"stdout" | "stderr": path}`` of the duplicate filters' files.
    """

    def __init__(self, spec: GroupSpec) -> None:
        n = spec.nprocs
        self.spec = spec
        self.envs: dict[int, dict[str, str]] = {r: dict(spec.envs[r]) for r in range(n)}
        self.dest = LogsDest()
        self.filtered: dict[str, str] = {}
        self._resources = GroupResources(spec.name, n, spec.limits, spec.capacity, spec.cpus)
        self._ranks = RankLauncher(
            spec.name,
            spec.entrypoint,
            spec.args,
            self.envs,
            kwargs=spec.kwargs,
            sinks=cast("list[Sink]", list(spec.sinks or ())),  # made by check()
            prefixes=spec.log_line_prefixes,
            pass_fds=tuple(spec.pass_fds),
            loop=spec.worker_loop,
        )
        self._ranks.role = spec.role
        # read once: metrics enabled later count from the next group on
        self._rec = _hooks.current
        if self._rec.enabled:
            self._ranks.recorder = self._rec
        # barrier() and stack dumps of function workers; a cluster run shares
        # one hub among its tasks' groups, keyed by task
        hub = spec.hub
        if hub is None and spec.is_function:
            hub = ControlHub(n)
        self._hub = hub
        self.children: dict[int, Child] = {}
        self._outcomes = Outcomes(n)
        # the crew calls back weakly: a cycle would keep every result (its
        # shared memory, its mapped fd) alive until the next garbage collection
        self._hold = Hold(n, self.children, _weak(self._left) if hub is not None else None)
        self._exits = Exits(
            spec, self.children, self._outcomes, self._resources, self._hold, hub, self._rec,
            _weak(self._failed),
        )  # fmt: skip
        self._launch = Launch(
            spec, self._ranks, self.children, self._outcomes, self._hold, self._exits, hub,
            self._rec,
        )  # fmt: skip
        self._shutdown = Shutdown(
            spec, self.children, self._outcomes, self._hold, self._exits, self._ranks,
            _weak(self._recorded),
        )  # fmt: skip
        self._owner: Owner[Request] = Owner(f"aioproc-supervisor-{spec.name}")
        self._state = _State.NEW
        self._starting: asyncio.Future[None] | None = None  # resolved when STARTING is left
        self._launched: asyncio.Future[None] | None = None  # resolved when the launch is over
        self._early_close: Request | None = None  # a close() during STARTING
        self._capacity_wait: anyio.CancelScope | None = None
        self._began = 0.0  # when the slots were granted, for group_started
        self._group_started = False

    def __repr__(self) -> str:
        return f"<Supervisor {self.spec.name} {self.state}>"

    # ------------------------------------------------------------- queries

    @property
    def state(self) -> str:
        """``new``, ``starting``, ``running``, ``finished`` (every outcome in) or ``closed``."""
        finished = self._outcomes.finished
        if self._state is _State.RUNNING and finished is not None and finished.done():
            return "finished"
        return self._state.value

    @property
    def started(self) -> bool:
        """True once the launch began (a result will come)."""
        return self._outcomes.finished is not None

    @property
    def finished(self) -> asyncio.Future[None]:
        """Resolved once every rank has its outcome (``started`` first)."""
        assert self._outcomes.finished is not None
        return self._outcomes.finished

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the group runs on, once started."""
        return self._owner.loop

    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of the started workers."""
        return {rank: child.pid for rank, child in self.children.items()}

    def result(self) -> RunProcsResult:
        """The outcomes so far, with each reaped worker's usage."""
        dest = self.dest
        result = self._outcomes.result(dest.stdouts, dest.stderrs, self.spec.logs_specs.run_log_dir)
        result.usage = self._resources.usage(self.children)
        return result

    def remote_exception(self, local_rank: int) -> BaseException | None:
        """The exception function worker ``local_rank`` raised, rebuilt here."""
        return self._outcomes.remote.get(local_rank)

    def stopping(self, sig: int) -> None:
        """Announce that ``sig`` is about to stop the group (a "stopping" event)."""
        if self._state is _State.RUNNING:
            notify(self.spec, WorkerEvent("stopping", -1, -1, -sig, time.time()))

    # --------------------------------------------------------------- start

    async def start(self) -> None:
        """Check against the present, take the slots, plan the logs, launch.

        Cancellation: before the launch, nothing was started and no slot is
        held; during it, every worker started so far is stopped (shielded,
        bounded: killed at once, or with a translated signal and the grace
        period) before the cancellation propagates.
        """
        self._state = _State.STARTING
        self._starting = asyncio.get_running_loop().create_future()
        spec = self.spec
        try:
            # building the group (the spec's checks), the checks below and
            # what follows each take a millisecond or two for hundreds of
            # ranks: not in one callback, which would stall the host's loop
            await asyncio.sleep(0)  # a turn for the loop, not a wait for a state
            # everything that can reject the input runs before anything is created
            check_start(spec.entrypoint, spec.args, self.envs, spec.logs_specs)
            await asyncio.sleep(0)  # and one between the checks and the launch
            payloads = self._ranks.payloads(lifeline=spec.hub is not None)
            try:
                if not spec.is_function:
                    check_executable(str(spec.entrypoint), self.envs)
                await self._take_resources()
            except BaseException:
                self._ranks.discard_segments()  # large args in shared memory
                raise
            # the helper thread (see _base.offloop) is held until the launch is over
            with helper():
                plan = await self._plan()
                await self._begin(plan, payloads)
        finally:
            if self._state is _State.STARTING:
                self._state = _State.NEW  # failed before the launch: nothing was started
            unstarted = self._state is _State.NEW
            if unstarted:
                self._resources.close()  # no worker exists: slots and cgroups go back
            if not self._starting.done():
                self._starting.set_result(None)
            if unstarted:
                await shielded(_lifeline.settle())  # the guardian its cgroups held, let go

    async def _take_resources(self) -> None:
        """Wait for the group's process slots, then open its placements.

        A ``close()`` meanwhile ends the wait: the launch that follows
        stops before its first worker.

        Cancellation: a cancelled wait holds no slot (``Capacity.acquire``).
        """
        queued = time.monotonic()
        if self._early_close is None:
            with anyio.CancelScope() as self._capacity_wait:
                await self._resources.acquire()
            self._capacity_wait = None
        self._began = time.monotonic()  # the start's time excludes the wait for slots
        if self._early_close is None:
            self._count_queued(self._began - queued)
            self._ranks.joins = self._resources.open()
            self._ranks.entries = self._resources.entries()

    async def _plan(self) -> LogsPlan:
        """The logs spec's plan for this start: the paths, and the rank dirs left to us.

        Cancellation: nothing of the group was started; a private tree
        made so far is pruned and the guardian it needed let go.
        """
        specs = self.spec.logs_specs
        if specs.makes_temp_root:
            # A private temp root: the guardian knows it before anything is
            # made in it, so a supervisor killed at any moment from here on
            # leaves no empty tree behind (one mkdtemp: on the loop).
            self._launch.hold_guardian()
            _lifeline.tidy_after_crash(specs.root_log_dir)
        try:
            # a directory per rank: off the loop (see _base.offloop); in the
            # default layout, made while the first workers start
            return await run_blocking(specs.plan, self.envs)
        except BaseException as e:
            self._launch.release_guardian()
            self._ranks.discard_segments()  # large args in shared memory
            if isinstance(e, asyncio.CancelledError):
                specs.prune()  # nothing was started: take the empty tree back
            await shielded(_lifeline.settle())  # a guardian the hold started, now idle
            raise

    async def _begin(self, plan: LogsPlan, payloads: dict[int, list[bytes]]) -> None:
        """Start the owner task and wait for the launch it begins with.

        Cancellation: a translated signal stops the workers with that signal
        and the grace period; any other cancellation kills them at once;
        both shielded, before the cancellation propagates.
        """
        dest = self.dest = self._exits.dest = plan.dest
        self._launch.rank_dirs = plan.rank_dirs
        self._state = _State.RUNNING
        self._outcomes.start()
        self._launched = asyncio.get_running_loop().create_future()
        self._ranks.add_filters(
            dest,
            {
                "stdout": tuple(self.spec.duplicate_stdout_filters or ()),
                "stderr": tuple(self.spec.duplicate_stderr_filters or ()),
            },
        )
        if "stdout" in self._ranks.filter_sinks:
            self.filtered["stdout"] = dest.filtered_stdout
        if "stderr" in self._ranks.filter_sinks:
            self.filtered["stderr"] = dest.filtered_stderr
        self._owner.start(
            functools.partial(self._supervise, plan, payloads),
            on_error=self._shutdown.emergency,  # a bug escaped: never leave a worker behind
            after=self._supervised,
        )
        if self._early_close is not None:
            self.request_close(*self._early_close)  # no worker is launched
        assert self._starting is not None
        self._starting.set_result(None)  # a close() waiting for the launch stops it now
        try:
            await asyncio.shield(self._launched)
        except asyncio.CancelledError:
            # A translated signal stops the workers with that signal, as when
            # leaving ``async with``; any other cancellation kills them at once.
            sig = pending_signal()
            if sig is not None:
                self.stopping(sig)
                await shielded(self._close(sig, self.spec.grace_period))
            else:
                await shielded(self._close(signal.SIGKILL, 0.0))
            raise

    # ----------------------------------------------------------- the owner

    async def _supervise(
        self, plan: LogsPlan, payloads: dict[int, list[bytes]], tg: anyio.abc.TaskGroup
    ) -> None:
        """The group's one owner: launch, watch, stop (after a failure or a close).

        Cancellation: the owner task is cancelled only when the loop shuts
        down with the group open: every worker is then killed at once
        (SIGKILL), the stop shielded and bounded.
        """
        assert self._launched is not None
        await self._launch.run(plan.dest, payloads)
        if self._launch.error is not None:
            self.request_close(signal.SIGKILL, 0.0)
        complete = self._launch.error is None and len(self.children) == self.spec.nprocs
        if complete:
            self._count_started()
        if self._launch.error is None and not self._launched.done():
            self._launched.set_result(None)
        sampling = None
        if self.spec.sample_interval is not None and complete:
            sampling = anyio.CancelScope()
            tg.start_soon(self._sample, sampling, self.spec.sample_interval)
        # the loop shutting down with the group still open kills it at once
        sig, timeout = await self._owner.closing((signal.SIGKILL, 0.0))
        if sampling is not None:
            sampling.cancel()
        with anyio.CancelScope(shield=True):
            await self._shutdown.run(sig, timeout, plan.temp_root)

    async def _sample(self, scope: anyio.CancelScope, interval: float) -> None:
        """A "sampled" event per running worker every ``interval`` seconds, until the close.

        A documented periodic read (``sample_interval``), not a wait on a
        state: the figures change continuously and nothing signals them.
        The ``/proc`` reads run on the helper thread, a group's at once.
        """
        with scope:
            while True:
                await anyio.sleep(interval)
                pids = {
                    rank: child.pid
                    for rank, child in sorted(self.children.items())
                    if not child.watcher.future.done()
                }
                if not pids:
                    continue
                samples = await run_blocking(sample_all, pids)
                now = time.time()
                for rank, usage in samples.items():
                    event = WorkerEvent("sampled", rank, pids[rank], None, now, usage)
                    notify(self.spec, event)

    async def _supervised(self) -> None:
        """After the owner, however it ended."""
        assert self._launched is not None
        self._launch.release_guardian()
        await self._resources.aclose()  # every worker is reaped: cgroups and slots go back
        self._state = _State.CLOSED
        if not self._launched.done():
            if self._launch.error is not None:
                self._launched.set_exception(self._launch.error)
            else:
                self._launched.set_result(None)

    def _left(self, rank: int) -> None:
        """``rank`` holds after its result: it never reaches the barrier again."""
        assert self._hub is not None
        self._hub.left((self.spec.hub_keys or {}).get(rank, rank), 0)

    def _failed(self) -> None:
        """A rank failed: stop the group (once) with the graceful signal and grace period.

        The stop a close would make, asked by the group itself: a close
        after it joins it (and can only bring its end forward).  The launch
        goes on: ranks still to launch are launched, then stopped with the
        others.
        """
        if self._owner.group is not None and not self._owner.close_requested:
            self._hold.release_all()  # the held workers exit now, not after the grace period
            self._owner.request_close((signal.SIGTERM, self.spec.grace_period))

    # ------------------------------------------------------------- metrics

    def _count_queued(self, seconds: float) -> None:
        """The slots are granted: the wait for them, in the metrics (when on)."""
        if self._rec.enabled:
            self._rec.group_queued(self.spec.name, self.spec.role, seconds)

    def _count_started(self) -> None:
        """Every rank is launched: the group's start, in the metrics (when on)."""
        if self._rec.enabled:
            self._group_started = True
            spec = self.spec
            self._rec.group_started(spec.name, spec.role, time.monotonic() - self._began)

    def _recorded(self, signalled: bool, seconds: float) -> None:
        """Every exit is recorded: the stop and the group's end, in the metrics (when on)."""
        self._state = _State.CLOSED
        if not self._rec.enabled:
            return
        spec = self.spec
        if signalled:
            self._rec.group_stopped(spec.name, spec.role, seconds)
        if self._group_started:
            self._group_started = False
            self._rec.group_exited(spec.name, spec.role, _outcome(self._outcomes))

    # --------------------------------------------------------------- close

    async def close(self, sig: int, timeout: float) -> None:
        """Stop every worker (see ``PContext.close``); the arguments are checked.

        Cancellation: the stop runs shielded and bounded in time.
        """
        if self._state is _State.STARTING and self._early_close is None:
            # start() waits for process slots or makes the log tree: the
            # launch it begins next stops before its first worker
            self._early_close = (sig, timeout)
            if self._capacity_wait is not None:
                self._capacity_wait.cancel()
        elif self._state is _State.NEW:
            self._state = _State.CLOSED
            return
        await shielded(self._close(sig, timeout))

    def request_close(self, sig: int, timeout: float) -> None:
        """Ask the owner to stop; a stop under way keeps its signal, its grace may end sooner."""
        if not self._owner.request_close((sig, timeout)):
            self._shutdown.bring_forward(sig, timeout)
        self._launch.cancel()

    def _start_failed(self) -> bool:
        # (a method: mypy would keep the state narrowed across the await)
        return self._state is _State.NEW

    async def _close(self, sig: int, timeout: float) -> None:
        if self._state is _State.STARTING:
            assert self._starting is not None
            await asyncio.wait({self._starting})  # the launch began, or start() failed
            if self._start_failed():
                self._state = _State.CLOSED
                return
        if not self._owner.started:
            return
        self.request_close(sig, timeout)
        await self._owner.wait()


def _weak(method: Callable[..., None]) -> Callable[..., None]:
    """``method``, called while its object lives, without keeping it alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        target = ref()
        if target is not None:
            target(*args)

    return call


def _outcome(outcomes: Outcomes) -> str:
    """A group's metrics outcome: succeeded, else the outcome of its root cause."""
    if not outcomes.failures:
        return "succeeded"
    root = min(outcomes.failures.values(), key=lambda f: f._order_key())
    return _hooks.outcome_of(root.exitcode, stopped=root.stopped)
