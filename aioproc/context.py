"""The supervisor of one worker group: ``PContext`` (built by ``start_processes``).

A ``PContext`` owns its work in ONE supervisor task and the anyio task group
inside it: the launch of every rank, the stop after a first failure, and the
final shutdown.  ``start()`` creates the supervisor
and waits until every rank is launched; ``close()`` (from any task, any
number of times) asks it to stop and waits until it has finished; the
``await`` and ``async with`` forms of ``start_processes`` are thin wrappers.

A worker's exit (a pidfd, not polling) starts a watcher task, which waits
for the bytes the worker wrote before exiting (``_output.drain``) and records the
outcome; the shutdown waits for the watchers, bounded.  A function worker
that returned waits, as torch's do, until every rank has its outcome (or
the group is stopped) before it exits (``_returned``).  The first
failure makes the supervisor stop every other worker (all-or-nothing); the
group's result is final when every rank is done.  ``close()`` stops whatever
still runs, gracefully then by force (``_proc.shutdown``), during a launch too
(ranks not launched yet are reported as never started), drains and closes the
pipes, reaps the leaders (kept as zombies until then, so a recycled pid is
never signalled) and lets the guardian forget their groups.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import signal
import time
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
import anyio.abc

from ._base.checks import START_METHODS as START_METHODS
from ._base.checks import check_duration, check_preload
from ._base.checks import check_filters as _check_filters
from ._base.checks import check_signal as _validate_signal
from ._base.loops import check_loop
from ._base.offloop import Batched, helper, run_blocking
from ._base.owner import Owner
from ._base.shield import shielded
from ._child import channel as _wire
from ._errors.failure import ErrorFileContent, ProcessFailure, read_error_file, read_error_files
from ._func import template as _template
from ._func.barrier import ControlHub
from ._func.script import script_dirs
from ._group.checks import check_executable as _check_executable
from ._group.checks import check_interval, check_start
from ._group.checks import check_kwargs as _check_kwargs
from ._group.checks import validate_group as _validate
from ._group.outcomes import NEVER_STARTED as NEVER_STARTED
from ._group.outcomes import Outcomes
from ._group.preimport import preimport as preimport
from ._group.rank_launcher import ROLE, RankLauncher, SinkLike
from ._group.rank_launcher import make_sinks as _make_sinks
from ._group.rankdirs import RankDirs
from ._group.resources import CpusArg, GroupResources, LimitsArg
from ._limits.capacity import Capacity
from ._limits.usage import sample_all
from ._metrics import hooks as _hooks
from ._output.console import release_consoles
from ._proc import lifeline as _lifeline
from ._proc.posix_spawn import name_fd_limit
from ._proc.shutdown import Deadline, Release, release, stop_groups, warn_forced
from ._proc.spawn import Child
from .logs import DefaultLogsSpecs, LogsDest, LogsSpecs
from .results import DEFAULT_GRACE_PERIOD, RunProcsResult, WorkerEvent
from .signals import SignalException, pending_signal

__all__ = ["PContext", "RunProcsResult", "WorkerEvent", "close_on_exit", "preimport"]

logger = logging.getLogger("aioproc")

preimport.__module__ = __name__  # defined in the wing, imported from here

_LAUNCH_WINDOW = 8
"""Workers being launched at once: forks queue on the helper thread, in rank order."""

_FORK_WINDOW = 32
"""The same for workers forked from a template: their requests go out together,
and the template forks them all before it waits for the first (see ``_func.template``)."""

_BINARY_BATCH = 16
"""Binary workers started by one helper job (one hand-over between thread and loop)."""

_BATCHES_IN_FLIGHT = 2
"""Batches of binary workers queued at once: the helper thread starts one while
the loop wires up the other."""

_RECORD_BATCH = 16
"""Exits recorded per loop iteration when a close records them together."""

_read_error_file = Batched(read_error_file)
"""Error files of exited workers, read a burst per helper-thread job."""


async def _prune_after(reads: Sequence[asyncio.Future[Any]], specs: LogsSpecs) -> None:
    if reads:
        await asyncio.wait(reads)
    await run_blocking(specs.prune)


_DRAIN_TIMEOUT = 2.0
"""Bound on waiting for EOF of a killed group's pipes (a setsid'd descendant may hold them)."""


class _State(enum.Enum):
    NEW = "new"
    STARTING = "starting"  # the log tree is being made; no worker yet
    RUNNING = "running"
    CLOSED = "closed"


class _AlreadyStartedError(RuntimeError, ValueError):
    """Raised by a second ``start()`` (a ValueError too, as torch raises)."""


class PContext:
    """A group of worker processes supervised all-or-nothing.

    Built by ``start_processes``; a callable entrypoint gives function
    workers, a ``str`` gives binary workers.  Attributes mirror torch's
    ``PContext``: ``name, entrypoint, args, envs, nprocs, stdouts, stderrs,
    error_files``, and ``filtered_stdout`` / ``filtered_stderr``: once
    started, the path of the file that collects the lines matching
    ``duplicate_stdout_filters`` / ``duplicate_stderr_filters`` (None without
    such filters; torch holds the open file there).  A started ``PContext``
    also works as ``async with pc:`` (closed when the block exits).
    ``kwargs``: ``{local_rank: {name: value}}`` for function workers.
    ``hub``/``hub_keys``: the ``ControlHub`` behind ``barrier()`` (default:
    one for this group's ranks); the cluster runner shares one among its
    tasks' one-rank groups, keyed by task.  ``limits``/``capacity``/``cpus``:
    as ``start_processes`` takes them (``_group.resources``).  ``role``: the
    role the group's metrics carry (the agent gives its spec's role; torch's
    default role otherwise).  ``sample_interval``: as ``start_processes``.
    """

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: Mapping[int, tuple[Any, ...]],
        envs: Mapping[int, Mapping[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: Mapping[int, str] | str | None = None,
        start_method: str = "spawn",
        *,
        grace_period: float = DEFAULT_GRACE_PERIOD,
        sinks: Sequence[SinkLike] | None = None,
        duplicate_stdout_filters: Sequence[str] | None = None,
        duplicate_stderr_filters: Sequence[str] | None = None,
        pass_fds: Sequence[int] = (),
        on_event: Callable[[WorkerEvent], None] | None = None,
        close_sinks: bool = True,
        preload: Sequence[str] = (),
        kwargs: Mapping[int, Mapping[str, Any]] | None = None,
        hub: ControlHub | None = None,
        hub_keys: Mapping[int, Hashable] | None = None,
        limits: LimitsArg = None,
        capacity: Capacity | None = None,
        cpus: CpusArg = None,
        role: str = ROLE,
        sample_interval: float | None = None,
    ) -> None:
        grace_period = check_duration("grace_period", grace_period)
        self._sample_interval = check_interval(sample_interval)
        _validate(name, entrypoint, args, envs, logs_specs, log_line_prefixes, start_method)
        self._resources = GroupResources(name, len(args), limits, capacity, cpus)
        self.kwargs = _check_kwargs(entrypoint, args, kwargs)
        self.preload = check_preload(start_method, preload)
        own_sinks = _make_sinks(sinks)
        self._filters = {
            "stdout": _check_filters("duplicate_stdout_filters", duplicate_stdout_filters),
            "stderr": _check_filters("duplicate_stderr_filters", duplicate_stderr_filters),
        }
        if isinstance(pass_fds, (str, bytes)) or not all(
            isinstance(fd, int) and fd >= 0 for fd in pass_fds
        ):
            raise TypeError(f"pass_fds must be a sequence of fds, got {pass_fds!r}")
        self._on_event = on_event
        self._close_sinks = close_sinks or sinks is None
        self.name = name
        self.entrypoint = entrypoint
        self.nprocs = len(args)
        self.args: dict[int, tuple[Any, ...]] = {r: tuple(args[r]) for r in range(self.nprocs)}
        self.envs: dict[int, dict[str, str]] = {r: dict(envs[r]) for r in range(self.nprocs)}
        self.logs_specs = logs_specs
        self.start_method = start_method
        self.grace_period = float(grace_period)
        self.stdouts: dict[int, str] = {}
        self.stderrs: dict[int, str] = {}
        self.error_files: dict[int, str] = {}
        self.filtered_stdout: str | None = None
        self.filtered_stderr: str | None = None
        self._ranks = RankLauncher(
            name,
            entrypoint,
            self.args,
            self.envs,
            kwargs=self.kwargs,
            sinks=own_sinks,
            prefixes=log_line_prefixes,
            pass_fds=tuple(pass_fds),
        )
        self._ranks.role = self._role = role
        self._outcomes = Outcomes(self.nprocs)
        # read once: metrics enabled later count from the next group on
        self._rec = _hooks.current
        if self._rec.enabled:
            self._ranks.recorder = self._rec
        self._began = 0.0  # when start() was called, for group_started
        self._group_started = False
        self._capacity_wait: anyio.CancelScope | None = None
        # barrier() and stack dumps of function workers; a cluster run shares
        # one hub among its tasks' groups, keyed by task, and only it asks
        # for stacks: only its workers need a thread reading their channel
        self._lifeline_threads = hub is not None
        if hub is None and self.is_function:
            hub = ControlHub(self.nprocs)
        self._hub = hub
        self._hub_keys: Mapping[int, Hashable] = hub_keys or {}
        self._state = _State.NEW
        self._children: dict[int, Child] = {}
        self._stopping = False  # a failure stop or a close has begun
        # the supervisor: launches, watches, stops; started by start(), and
        # asked to close with the graceful signal and its grace period
        self._owner: Owner[tuple[int, float]] = Owner(f"aioproc-supervisor-{self.name}")
        self._launch_error: BaseException | None = None
        self._launched: asyncio.Future[None] | None = None
        # resolved when start() leaves STARTING (launch begun, or start failed)
        self._starting: asyncio.Future[None] | None = None
        self._early_close: tuple[int, float] | None = None  # a close() during STARTING
        self._launching = True
        self._launch_done: asyncio.Event | None = None
        self._holding_guardian = False  # from the temp root's creation to the launch's end
        self._launch_scope: anyio.CancelScope | None = None
        self._grace_end = Deadline()  # a later close() can bring it forward
        self._watching: dict[int, anyio.CancelScope] = {}
        self._watched: dict[int, asyncio.Event] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        # ranks whose exit close() records (_record_stopped), with no watcher
        self._left_to_close: frozenset[int] = frozenset()
        self._auto_stop: anyio.CancelScope | None = None
        self._auto_stopped: asyncio.Event | None = None
        # binary workers start in batches, one helper job each (see
        # _spawn.spawn_binaries); a forkserver template runs scripts itself
        self._batched = not self.is_function and not (
            start_method == "forkserver" and self._ranks.scripts
        )
        self._rank_dirs: dict[int, str] = {}  # rank dirs reify left to the launch
        # Function workers hold after their result until the group has every
        # rank's (see _returned): the ranks holding, the ranks whose outcome
        # is in or on its way (a result, an exit, never started), and whether
        # the group let its workers go (every outcome in, or a stop began).
        self._holding: set[int] = set()
        self._done_ranks: set[int] = set()
        self._released = False

    @property
    def _finished(self) -> asyncio.Future[None] | None:
        return self._outcomes.finished

    def __repr__(self) -> str:
        kind = "function" if callable(self.entrypoint) else "binary"
        if self._state is _State.RUNNING and self._finished is not None:
            state = "finished" if self._finished.done() else "running"
        else:
            state = self._state.value
        return f"<PContext {self.name} nprocs={self.nprocs} {kind} {state}>"

    @property
    def is_function(self) -> bool:
        return not isinstance(self.entrypoint, str)

    async def __aenter__(self) -> PContext:
        if self._state is _State.NEW:
            await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await close_on_exit(self, exc)

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        """Start every worker.

        Raises:
            ValueError/RuntimeError: if already started (``_AlreadyStartedError``
                is both, like torch's ValueError and trio's RuntimeError).
            OSError: if a worker cannot be launched; workers already started
                are stopped first.

        Cancellation: if cancelled part-way, the launch stops and every worker
        started so far is killed with its group (shielded, bounded) before the
        cancellation propagates; a cancellation by ``translate_signals`` stops
        them with that signal and the grace period instead.  A ``close()``
        from another task during the launch stops it too; ``start()`` then
        returns and the ranks that were never launched are reported as such.
        """
        if self._state is not _State.NEW:
            done = "was closed" if self._state is _State.CLOSED else "was already started"
            raise _AlreadyStartedError(f"{self!r} {done}; a PContext can be started once")
        self._state = _State.STARTING
        self._starting = asyncio.get_running_loop().create_future()
        try:
            # building the group (the constructor's checks), the checks below
            # and what follows each take a millisecond or two for hundreds of
            # ranks: not in one callback, which would stall the host's loop
            await asyncio.sleep(0)  # a turn for the loop, not a wait for a state
            # everything that can reject the input runs before anything is created
            check_start(self.entrypoint, self.args, self.envs, self.logs_specs)
            await asyncio.sleep(0)  # and one between the checks and the launch
            payloads = self._ranks.payloads(lifeline=self._lifeline_threads)
            try:
                if not self.is_function:
                    _check_executable(str(self.entrypoint), self.envs)
                await self._take_resources()
            except BaseException:
                self._ranks.discard_segments()  # large args in shared memory
                raise
            # the helper thread (see _base.offloop) is held until the launch is over
            with helper():
                await self._start(payloads)
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
            if self._rec.enabled:
                self._rec.group_queued(self.name, self._role, self._began - queued)
            self._ranks.joins = self._resources.open()
            self._ranks.entries = self._resources.entries()

    async def _start(self, payloads: dict[int, list[bytes]]) -> None:
        specs = self.logs_specs
        if isinstance(specs, DefaultLogsSpecs) and specs._root_log_dir is None:
            # A private temp root: the guardian knows it before anything is
            # made in it, so a supervisor killed at any moment from here on
            # leaves no empty tree behind (one mkdtemp: on the loop).
            _lifeline.hold()
            self._holding_guardian = True
            _lifeline.tidy_after_crash(specs.root_log_dir)
        try:
            # a directory per rank: off the loop (see _base.offloop); in the
            # default layout, made while the first workers start
            if type(specs).reify is DefaultLogsSpecs.reify:
                assert isinstance(specs, DefaultLogsSpecs)
                dest, self._rank_dirs = await run_blocking(specs._reify_deferred, self.envs)
            else:
                dest = await run_blocking(specs.reify, self.envs)
        except BaseException as e:
            self._unhold_guardian()
            self._ranks.discard_segments()  # large args in shared memory
            if isinstance(e, asyncio.CancelledError):
                self.logs_specs.prune()  # nothing was started: take the empty tree back
            await shielded(_lifeline.settle())  # a guardian the hold started, now idle
            raise
        self._state = _State.RUNNING
        loop = asyncio.get_running_loop()
        self._outcomes.start()
        self._launched = loop.create_future()
        self._launch_done = asyncio.Event()
        self._auto_stopped = asyncio.Event()
        self.stdouts = dict(dest.stdouts)
        self.stderrs = dict(dest.stderrs)
        self.error_files = dict(dest.error_files)
        self._ranks.add_filters(dest, self._filters)
        if "stdout" in self._ranks.filter_sinks:
            self.filtered_stdout = dest.filtered_stdout
        if "stderr" in self._ranks.filter_sinks:
            self.filtered_stderr = dest.filtered_stderr
        self._owner.start(
            functools.partial(self._supervise, dest, payloads),
            on_error=self._emergency_stop,  # a bug escaped: never leave a worker behind
            after=self._supervised,
        )
        if self._early_close is not None:
            self._owner.request_close(self._early_close)  # no worker is launched
        assert self._starting is not None
        self._starting.set_result(None)  # a close() waiting for the launch stops it now
        try:
            await asyncio.shield(self._launched)
        except asyncio.CancelledError:
            # A translated signal stops the workers with that signal, as when
            # leaving ``async with``; any other cancellation kills them at once.
            sig = pending_signal()
            if sig is not None:
                self._notify(WorkerEvent("stopping", -1, -1, -sig, time.time()))
                await shielded(self._close(sig, self.grace_period))
            else:
                await shielded(self._close(signal.SIGKILL, 0.0))
            raise

    def _unhold_guardian(self) -> None:
        if self._holding_guardian:
            self._holding_guardian = False
            _lifeline.unhold()

    async def _supervise(
        self, dest: LogsDest, payloads: dict[int, list[bytes]], tg: anyio.abc.TaskGroup
    ) -> None:
        """The group's one owner: launch, watch, stop after a failure, shut down."""
        assert self._launched is not None
        assert self._launch_done is not None
        with anyio.CancelScope() as scope:
            self._launch_scope = scope
            try:
                await self._launch_all(tg, dest, payloads)
            except Exception as e:
                self._launch_error = e
                self._request_close(signal.SIGKILL, 0.0)
        self._launch_scope = None
        self._launching = False
        self._unhold_guardian()  # every group is registered (or none will be)
        self._launch_done.set()
        self._ranks.discard_segments()  # of ranks never launched
        self._mark_never_started()
        complete = self._launch_error is None and len(self._children) == self.nprocs
        if self._rec.enabled and complete:
            self._group_started = True
            self._rec.group_started(self.name, self._role, time.monotonic() - self._began)
        if self._launch_error is None and not self._launched.done():
            self._launched.set_result(None)
        sampling = None
        if self._sample_interval is not None and complete:
            sampling = anyio.CancelScope()
            tg.start_soon(self._sample, sampling, self._sample_interval)
        # the loop shutting down with the group still open kills it at once
        sig, timeout = await self._owner.closing((signal.SIGKILL, 0.0))
        if sampling is not None:
            sampling.cancel()
        with anyio.CancelScope(shield=True):
            await self._shutdown(sig, timeout)

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
                    for rank, child in sorted(self._children.items())
                    if not child.watcher.future.done()
                }
                if not pids:
                    continue
                samples = await run_blocking(sample_all, pids)
                now = time.time()
                for rank, usage in samples.items():
                    self._notify(WorkerEvent("sampled", rank, pids[rank], None, now, usage))

    async def _supervised(self) -> None:
        """After the supervisor, however it ended."""
        assert self._launched is not None
        self._unhold_guardian()
        await self._resources.aclose()  # every worker is reaped: cgroups and slots go back
        self._state = _State.CLOSED
        if not self._launched.done():
            if self._launch_error is not None:
                self._launched.set_exception(self._launch_error)
            else:
                self._launched.set_result(None)

    async def _launch_all(
        self, tg: anyio.abc.TaskGroup, dest: LogsDest, payloads: dict[int, list[bytes]]
    ) -> None:
        template: _template.Template | None = None
        if self.start_method == "forkserver" and (self.is_function or self._ranks.scripts):
            # other binaries are spawned: exec would discard the template; a
            # Python script's own directory is searched for the preload first
            head = script_dirs(self.entrypoint, self.args)
            template = await _template.acquire(self.preload, head)
        errors: list[Exception] = []
        # binary workers start in batches, one helper job each (see
        # _spawn.spawn_binaries); others one by one, a few in flight
        batch = _BINARY_BATCH if self._batched else 1
        in_flight = _FORK_WINDOW if template is not None else _LAUNCH_WINDOW
        window = anyio.Semaphore(_BATCHES_IN_FLIGHT if batch > 1 else in_flight)
        # rank 0 alone first: its "started" event (the CLI names the log dir
        # then) comes before the other workers' output, as one by one
        units = [range(0, min(1, self.nprocs))] if batch > 1 else []
        units += [
            range(i, min(i + batch, self.nprocs)) for i in range(len(units), self.nprocs, batch)
        ]
        dirs = RankDirs(self._rank_dirs, units)

        def started(rank: int, child: Child) -> None:
            self._children[rank] = child
            if self._hub is not None and child.channel is not None:
                key = self._hub_keys.get(rank, rank)
                self._hub.attach(key, child.channel, key if isinstance(key, str) else child.label)
            if self._released and rank in self._holding:
                self._release(rank)  # it returned before its launch was over
            if self._rec.enabled:
                self._rec.worker_started(self.name, self._role)
            self._notify(WorkerEvent("started", rank, child.pid, None, time.time()))
            child.release_output()  # its output reaches the sinks after this event
            child.watcher.future.add_done_callback(functools.partial(self._exited, rank, child))

        async def launch(rank: int) -> None:
            try:
                await dirs.ready(rank)
                child = await self._ranks.launch(
                    rank, dest, payloads.get(rank), self._frame_handler(rank), template
                )
            except Exception as e:
                errors.append(e)  # the first one is raised once the others are in
                return
            finally:
                window.release()
            started(rank, child)

        async def launch_batch(ranks: range) -> None:
            try:
                await dirs.ready(ranks.start)
                children, error = await self._ranks.launch_binaries(ranks, dest)
            except Exception as e:  # nothing of the batch is left running
                errors.append(e)
                return
            finally:
                window.release()
            for rank, child in children.items():
                started(rank, child)
            if error is not None:
                errors.append(error)

        try:
            # a few launches in flight: the helper thread starts the next
            # workers while the loop wires up the last ones
            async with anyio.create_task_group() as launching:
                for ranks in units:
                    await window.acquire()
                    if self._owner.close_requested or errors:
                        window.release()
                        break
                    name = f"aioproc-launch-{self.name}/{ranks.start}"
                    if batch > 1:
                        launching.start_soon(launch_batch, ranks, name=name)
                    else:
                        launching.start_soon(launch, ranks.start, name=name)
            if errors:
                raise name_fd_limit(errors[0])  # an EMFILE says which limit to raise
        finally:
            await shielded(dirs.aclose())  # none is made after this (prune comes later)
            # forked workers do not need the template: it is closed now unless
            # somebody else (an agent, a pool, open_forkserver) holds it
            if template is not None:
                await shielded(_template.release(template))

    def _frame_handler(self, rank: int) -> Callable[[int, bytearray], None]:
        outcome = self._outcomes.frame_handler(rank)
        hub, key = self._hub, self._hub_keys.get(rank, rank)
        if hub is None:
            return outcome
        # weak: the worker's channel holds this handler, and this group its
        # workers; a cycle would keep every result (its shared memory, its
        # mapped fd) alive until the next garbage collection
        returned = weakref.WeakMethod(self._returned)

        def on_frame(kind: int, body: bytearray) -> None:
            if kind == _wire.ARRIVE or kind == _wire.STACKS:
                hub.on_frame(key, kind, body)
            else:
                outcome(kind, body)
                if kind == _wire.RESULT:
                    group_returned = returned()
                    if group_returned is not None:
                        group_returned(rank)

        return on_frame

    def _mark_never_started(self) -> None:
        for rank in range(self.nprocs):
            if rank not in self._children:
                self._outcomes.never_started(rank)
                self._rank_done(rank)

    # ------------------------------------------------------------ holding

    def _returned(self, rank: int) -> None:
        """``rank`` sent its result: it now waits for TERMINATE to exit.

        As torch's ``start_processes`` holds each worker until the parent
        has read every local result, a worker whose function returned stays
        alive until every rank of the group has an outcome (or the group is
        stopped): a gloo process group never destroyed is then torn down by
        no rank while another still uses it (see "Holding" in
        ``_child.boot``).  A lone rank is let go at once.
        """
        self._holding.add(rank)
        self._rank_done(rank)
        if rank in self._holding and self._hub is not None:
            # still held, but it will never reach the barrier again (it exits
            # with 0 once let go): the ranks waiting there must not wait for it
            self._hub.left(self._hub_keys.get(rank, rank), 0)

    def _rank_done(self, rank: int) -> None:
        """``rank``'s outcome is in or on its way; once every rank's is, let them all go."""
        self._done_ranks.add(rank)
        if self._released or len(self._done_ranks) >= self.nprocs:
            self._release_all()

    def _release_all(self) -> None:
        """Let every held worker exit: the group has every outcome, or it is being stopped.

        A stop sends TERMINATE before its signal, so a held worker exits
        by itself, however its code handles the signal.
        """
        self._released = True
        for rank in sorted(self._holding):
            self._release(rank)

    def _release(self, rank: int) -> None:
        child = self._children.get(rank)
        if child is None or child.channel is None:
            return  # returned before its launch was over: ``started`` lets it go
        self._holding.discard(rank)
        if child.returncode is None:
            # the result is read already: nothing the worker writes is lost
            # if it is gone before this arrives
            child.channel.send(_wire.TERMINATE)

    def _notify(self, event: WorkerEvent) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:
            logger.exception("on_event callback failed for %s", event)

    # ------------------------------------------------------------ supervision

    def _exited(self, rank: int, child: Child, exit: asyncio.Future[int]) -> None:
        """A worker's exit was noticed: record it, unless a close is under way.

        A done callback, not a task per worker: a close records the exits it
        causes in one pass (``_record_stopped``), so the exits of a group
        being closed cost no task switch each.  Only an exit noticed before
        any close starts a task, to wait for its output and error file.  A
        plain task (anyio's ``start_soon`` needs to be called from a task):
        the shutdown waits for it, bounded, and cancels it if it is late.
        """
        self._holding.discard(rank)
        self._rank_done(rank)
        if rank in self._left_to_close:
            # close() records it with the others once the stop is over; its
            # channel is closed now, while the other workers are still exiting
            if child.channel is not None:
                child.channel.close_when_settled()
            return
        if self._owner.group is None or self._state is _State.CLOSED:
            return  # recorded already (a close noticed it first)
        self._watched[rank] = asyncio.Event()
        name = f"aioproc-watch-{child.label}"
        task = child.watcher.loop.create_task(self._watch(rank, child, exit.result()), name=name)
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _watch(self, rank: int, child: Child, code: int) -> None:
        if code != 0 and not child.stop_requested:
            # A failure whatever its error file says: the others are stopped
            # now, while its output drains and its error file is read.
            self._stop_others()
        try:
            with anyio.CancelScope() as scope:
                self._watching[rank] = scope
                failure: ProcessFailure | None = None
                try:
                    settled = child.output_settled()
                    if settled:
                        await asyncio.wait(settled, timeout=_DRAIN_TIMEOUT)
                    if code != 0:
                        # read off the loop, capped (see errors.py), by a helper job
                        # that reads a burst of exits' files; results come back in
                        # bounded batches (_base.offloop)
                        error_file = self.error_files.get(rank, "")
                        # orders the failure, as load() would: when its exit was
                        # noticed, before the exits of the ranks its stop causes
                        observed = child.watcher.exit_time or time.time()
                        content = await _read_error_file(error_file)
                        failure = ProcessFailure._from_content(
                            observed,
                            content,
                            rank,
                            child.pid,
                            code,
                            error_file,
                            child.stop_requested,
                        )
                except Exception:  # recorded below without the error file's content
                    logger.exception("reading the outcome of %s failed", child.label)
            if not scope.cancelled_caught:
                # the outcome is recorded whatever the drain did, or wait() would hang
                try:
                    self._record(rank, child, code, failure)
                except Exception:  # a bug here must not take the supervisor down
                    logger.exception("recording the exit of %s failed", child.label)
                    self._outcomes.fallback(rank, child, code)
        finally:
            self._watched[rank].set()

    async def _read_stop_errors(self, ranks: frozenset[int]) -> dict[int, ErrorFileContent]:
        """The error files of those of ``ranks`` that have exited with an error.

        One helper job for all; ``rank -> read_error_file``'s result.
        """
        failed = [r for r in sorted(ranks) if self._children[r].returncode not in (0, None)]
        if not failed:
            return {}
        paths = [self.error_files.get(rank, "") for rank in failed]
        return dict(zip(failed, await run_blocking(read_error_files, paths), strict=True))

    async def _record_stopped(
        self, ranks: frozenset[int], early: dict[int, ErrorFileContent]
    ) -> None:
        """Record the exits of ``ranks``, which a close stopped, in one pass.

        One wait for all their output, the error files of those that failed
        (``early`` has those read while the stop went on), then the records
        a batch per loop iteration: what ``_watch`` does per exit, done once
        for all.  Each failure is ordered by the time its exit was noticed.
        Ranks still running (unkillable) are left out.
        """
        stopped = [
            (rank, self._children[rank])
            for rank in sorted(ranks)
            if self._children[rank].watcher.future.done()
        ]
        # by now most outputs have settled: wait only on the others
        settled = [f for _, c in stopped for f in c.output_settled() if not f.done()]
        if settled:
            await asyncio.wait(settled, timeout=_DRAIN_TIMEOUT)
        # a worker SIGKILLed after the grace period exited after the early read
        failures = early | await self._read_stop_errors(
            frozenset(rank for rank, _ in stopped if rank not in early)
        )
        for i, (rank, child) in enumerate(stopped):
            if i and not i % _RECORD_BATCH:
                await asyncio.sleep(0)  # a record is ~30 us: let the loop breathe
            code = child.watcher.future.result()
            failure: ProcessFailure | None = None
            try:
                if rank in failures:
                    failure = ProcessFailure._from_content(
                        child.watcher.exit_time or time.time(),
                        failures[rank],
                        rank,
                        child.pid,
                        code,
                        self.error_files.get(rank, ""),
                        child.stop_requested,
                    )
                self._record(rank, child, code, failure)
            except Exception:  # a bug here must not take the supervisor down
                logger.exception("recording the exit of %s failed", child.label)
                self._outcomes.fallback(rank, child, code)

    def _record(
        self, rank: int, child: Child, code: int, failure: ProcessFailure | None = None
    ) -> None:
        error_file = self.error_files.get(rank, "")
        logs = (self.stdouts.get(rank, ""), self.stderrs.get(rank, ""))
        failed = self._outcomes.record(rank, child, code, error_file, failure, logs)
        oom = self._resources.oom(rank, child, code) if failed else None
        if oom is not None:
            self._outcomes.failures[rank].oom = oom
        if self._rec.enabled:
            outcome = _hooks.outcome_of(code, stopped=child.stop_requested)
            self._rec.worker_exited(self.name, self._role, outcome)
        if self._hub is not None:
            self._hub.left(self._hub_keys.get(rank, rank), code)
        if failed:
            self._stop_others()
        if self._on_event is not None:
            exited = child.watcher.exit_time or time.time()
            usage = self._resources.usage({rank: child}).get(rank)
            self._notify(WorkerEvent("exited", rank, child.pid, code, exited, usage, oom))

    def _stop_others(self) -> None:
        """After a failure: stop the group, once (from a task, not a callback)."""
        if not self._stopping and self._owner.group is not None:
            self._stopping = True
            self._owner.group.start_soon(self._stop_after_failure, name=f"aioproc-stop-{self.name}")

    async def _stop_after_failure(self) -> None:
        assert self._launch_done is not None
        assert self._auto_stopped is not None
        self._release_all()  # the held workers exit now, not after the grace period
        try:
            with anyio.CancelScope() as scope:
                self._auto_stop = scope
                # a failure can be noticed while ranks are still being launched
                await self._launch_done.wait()
                running = [c for c in self._children.values() if c.returncode is None]
                if running:
                    began = time.monotonic()
                    forced = await stop_groups(
                        list(self._children.values()), signal.SIGTERM, self.grace_period
                    )
                    if self._rec.enabled:  # a stop a failure caused is timed as a close's
                        self._rec.group_stopped(self.name, self._role, time.monotonic() - began)
                    try:
                        warn_forced(forced, signal.SIGTERM, self.grace_period)
                    except Exception:  # a filter made the warning an error: log it
                        logger.exception("warning about forced kills failed")
        finally:
            self._auto_stopped.set()

    def _result(self) -> RunProcsResult:
        result = self._outcomes.result(self.stdouts, self.stderrs, self.logs_specs.run_log_dir)
        result.usage = self._resources.usage(self._children)
        return result

    def remote_exception(self, local_rank: int) -> BaseException | None:
        """The exception a function worker raised, rebuilt in the supervisor.

        Its ``__cause__`` is a ``RemoteTraceback`` holding the worker's own
        formatted traceback.  ``None`` for binaries and ranks that did not raise.
        """
        return self._outcomes.remote.get(local_rank)

    # ------------------------------------------------------------------ query

    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of the started workers."""
        return {rank: child.pid for rank, child in self._children.items()}

    def poll(self) -> RunProcsResult | None:
        """The group's result if every worker is done, else ``None``; never blocks."""
        if self._finished is None:
            raise RuntimeError(f"{self!r} has not been started")
        return self._result() if self._finished.done() else None

    async def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Wait for the group's result, all-or-nothing.

        Returns as soon as every worker succeeded, or once one failed and the
        others were stopped.  As torch's ``wait()`` does, a final result also
        closes the group: what the workers left in their process groups is
        stopped (``death_sig`` SIGTERM, then SIGKILL after ``grace_period``),
        the pipes, sinks and the guardian are released.  Nothing polls:
        ``period`` is accepted for compatibility with torch and ignored.

        Args:
            timeout: seconds to wait; negative waits forever; 0 is a poll.
            period: ignored.

        Returns:
            The ``RunProcsResult``, or ``None`` if still running at ``timeout``.

        Cancellation: cancelling ``wait()`` leaves the workers running; the
        ``async with`` block (or ``close()``) stops them.  Once the result is
        final, the release runs shielded.
        """
        check_loop(self._owner.loop, self)
        timeout = check_duration("wait(timeout=...)", timeout, allow_negative=True)
        if self._finished is None:
            raise RuntimeError(f"{self!r} has not been started")
        if not self._finished.done():
            if timeout == 0:
                return None
            try:
                await asyncio.wait_for(
                    asyncio.shield(self._finished), None if timeout < 0 else timeout
                )
            except asyncio.TimeoutError:
                return None
        await self.close(signal.SIGTERM, self.grace_period)
        return self._result()

    # ------------------------------------------------------------------ close

    async def close(self, death_sig: int | None = None, timeout: float = 30) -> None:
        """Stop every worker: ``death_sig`` to each process group, then SIGKILL.

        Waits up to ``timeout`` seconds in total for the workers and what
        they left in their process groups to exit, then SIGKILLs the groups
        still alive (warning with ``ForcedKillWarning``) and reaps them with a
        bounded wait.  Output up to EOF reaches its sinks.  During ``start()``
        it stops the launch first.  Idempotent: a second ``close()`` (also
        from another task) waits for the first to finish; its ``timeout``
        can only cut the grace period short (``death_sig=SIGKILL``: kill
        now), as a second Ctrl-C does in ``aioproc run``.

        Args:
            death_sig: the graceful signal (default SIGTERM).
            timeout: grace period in seconds before SIGKILL.

        Cancellation: the stop runs shielded and bounded in time; a
        cancellation arriving meanwhile is re-raised once it is done.
        """
        check_loop(self._owner.loop, self)
        sig = _validate_signal(signal.SIGTERM if death_sig is None else death_sig)
        timeout = check_duration("close(timeout=...)", timeout)
        if self._state is _State.STARTING and self._early_close is None:
            # start() waits for process slots or makes the log tree: the
            # launch it begins next stops before its first worker
            self._early_close = (sig, float(timeout))
            if self._capacity_wait is not None:
                self._capacity_wait.cancel()
        elif self._state is _State.NEW:
            self._state = _State.CLOSED
            return
        await shielded(self._close(sig, float(timeout)))

    def _request_close(self, sig: int, timeout: float) -> None:
        if not self._owner.request_close((sig, timeout)):
            # the stop under way keeps its signal; its grace period may end sooner
            grace = 0.0 if sig == signal.SIGKILL else timeout
            self._grace_end.bring_forward(time.monotonic() + grace)
        if self._launch_scope is not None:
            self._launch_scope.cancel()

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
        self._request_close(sig, timeout)
        await self._owner.wait()

    def _count_exit(self, signalled: bool, seconds: float) -> None:
        """The group's metrics at the end of its close (metrics on)."""
        if signalled:
            self._rec.group_stopped(self.name, self._role, seconds)
        if self._group_started:
            self._group_started = False
            self._rec.group_exited(self.name, self._role, _outcome(self._outcomes.failures))

    async def _emergency_stop(self) -> None:
        for task in self._watchers:
            task.cancel()
        children = list(self._children.values())
        await stop_groups(children, signal.SIGKILL, 0.0)
        await release(children, drain=0.0)

    async def _shutdown(self, sig: int, timeout: float) -> None:
        with helper():  # one helper thread for the whole shutdown (see _base.offloop)
            await self._shutdown_held(sig, timeout)

    async def _shutdown_held(self, sig: int, timeout: float) -> None:
        self._stopping = True
        self._release_all()  # the held workers exit now, not after the grace period
        assert self._auto_stopped is not None
        if self._auto_stop is not None:
            # a later close() decides the signal and the grace period
            self._auto_stop.cancel()
            await self._auto_stopped.wait()
        children = list(self._children.values())
        forced: list[Child] = []
        began = time.monotonic()
        signalled = any(c.returncode is None for c in children)
        # The exits this stop causes are recorded together once it is over:
        # per exit, a watcher would wait for the output and read the error
        # file on its own, competing with the exiting workers for the CPUs.
        # They are those whose exit was not noticed yet (see _exited).
        self._left_to_close = stopping = frozenset(
            rank for rank in self._children if rank not in self._watched
        )
        reading: list[asyncio.Future[dict[int, ErrorFileContent]]] = []

        def leaders_done() -> None:
            # their error files are read while the stop looks for descendants
            reading.append(asyncio.ensure_future(self._read_stop_errors(stopping)))

        if children:
            forced = await stop_groups(
                children, sig, timeout, deadline=self._grace_end, leaders_done=leaders_done
            )
        granted = max(0.0, min(timeout, self._grace_end.at - began))
        specs = self.logs_specs
        temp_root = specs._ephemeral_root if isinstance(specs, DefaultLogsSpecs) else None
        pruned: asyncio.Future[None] | None = None
        watching = any(not e.is_set() for e in self._watched.values())
        if not forced and not watching and not any(c.tees for c in children):
            # Nothing writes in the log tree any more: the groups are empty
            # and no pipe of ours feeds a file.  Once the stopped workers'
            # error files are read (and no other read is due: none was
            # forced, no watcher is reading), the helper thread prunes it
            # while the loop records the exits.
            pruned = asyncio.ensure_future(_prune_after(reading, specs))
        watched = [e for e in self._watched.values() if not e.is_set()]
        if watched:
            with anyio.move_on_after(_DRAIN_TIMEOUT + 1):
                # one after the other, not gathered: hundreds of tasks made
                # in one step would hold the loop for milliseconds
                for event in watched:
                    await event.wait()
        early = await reading[0] if reading else {}
        # The groups get no more signals: forget them (one write to the
        # guardian, which exits if it guards nothing else) and reap their
        # leaders now, so that the guardian's exit overlaps what follows.
        done = Release(children)
        if stopping:
            await done.reaped()  # their "exited" events carry the usage of the reap
        await self._record_stopped(stopping, early)
        for rank, scope in self._watching.items():
            if not self._watched[rank].is_set():
                # it exited, but its output or error file took too long
                scope.cancel()
                child = self._children[rank]
                self._outcomes.fallback(rank, child, child.watcher.future.result())
        for rank in stopping:
            child = self._children[rank]
            if not child.watcher.future.done():
                # survived SIGKILL: recorded as such now, its exit whenever it comes
                self._outcomes.unkillable(rank, child, self.error_files.get(rank, ""))
        try:
            own_sinks = self._ranks.sinks if self._close_sinks else []
            await done.close(
                drain=_DRAIN_TIMEOUT, sinks=[*own_sinks, *self._ranks.filter_sinks.values()]
            )
            release_consoles()  # the host's sinks stay open, not our fds on its console
            self._outcomes.check_finished()
            if self._rec.enabled:
                self._count_exit(signalled, time.monotonic() - began)
            self._state = _State.CLOSED
            if pruned is None:
                # the sinks wrote into the tree until now: prune it only now,
                # while the loop waits for the guardian
                pruned = asyncio.ensure_future(run_blocking(specs.prune))
            await done.settle()
        finally:
            if pruned is not None:
                await pruned
        if temp_root is not None:
            _lifeline.untidy(temp_root)
        warn_forced(forced, sig, granted)


def _outcome(failures: Mapping[int, ProcessFailure]) -> str:
    """A group's metrics outcome: succeeded, else the outcome of its root cause."""
    if not failures:
        return "succeeded"
    root = min(failures.values(), key=lambda f: f._order_key())
    return _hooks.outcome_of(root.exitcode, stopped=root.stopped)


async def close_on_exit(pc: PContext, exc: BaseException | None) -> None:
    """Leaving ``async with``: a signal stops the workers with it."""
    sig: int | None = None
    if isinstance(exc, SignalException):
        sig = exc.sigval
    elif isinstance(exc, asyncio.CancelledError):
        sig = pending_signal()
    if sig is not None and pc._state is _State.RUNNING:
        pc._notify(WorkerEvent("stopping", -1, -1, -sig, time.time()))
    await pc.close(signal.SIGTERM if sig is None else sig, pc.grace_period)
