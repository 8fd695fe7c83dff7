"""``Exits``: a worker's exit becomes its recorded outcome.

A worker's exit (a pidfd, not polling) runs a done callback.  An exit
noticed while the group runs starts a watcher task, which waits for the
bytes the worker wrote before exiting (``_output.drain``), reads its error
file off the loop and records the outcome; a failure asks the group to
stop (``on_failure``) before any of that, so the others are stopped while
its output drains.  The exits a stop causes are recorded together once the
stop is over (``record_stopped``): per exit, a watcher would wait for the
output and read the error file on its own, competing with the exiting
workers for the CPUs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping

import anyio

from .._base.offloop import Batched, run_blocking
from .._errors.failure import ErrorFileContent, ProcessFailure, read_error_file, read_error_files
from .._func.barrier import ControlHub
from .._group.outcomes import Outcomes
from .._group.resources import GroupResources
from .._metrics import hooks as _hooks
from .._proc.spawn import Child
from ..logs import LogsDest
from ..results import WorkerEvent
from .hold import Hold
from .spec import GroupSpec

logger = logging.getLogger("aioproc")

DRAIN_TIMEOUT = 2.0
"""Bound on waiting for EOF of a killed group's pipes (a setsid'd descendant may hold them)."""

RECORD_BATCH = 16
"""Exits recorded per loop iteration when a stop records them together."""

_read_error_file = Batched(read_error_file)
"""Error files of exited workers, read a burst per helper-thread job."""


def notify(spec: GroupSpec, event: WorkerEvent) -> None:
    """Give ``event`` to the group's ``on_event``, logging what it raises."""
    if spec.on_event is None:
        return
    try:
        spec.on_event(event)
    except Exception:
        logger.exception("on_event callback failed for %s", event)


class Exits:
    """The exits of one group's workers, watched and recorded (see the module docstring).

    Args:
        spec: the group's checked spec.
        children: the started workers by rank (filled by the launch).
        outcomes: where each rank's outcome is recorded.
        resources: the group's limits (a rank's OOM kill, its usage).
        hold: told of every exit, so held peers are let go in time.
        hub: the ``ControlHub`` told of every exit (function workers).
        recorder: the metrics recorder of the group.
        on_failure: called when a rank fails while nothing stopped it.
    """

    def __init__(
        self,
        spec: GroupSpec,
        children: Mapping[int, Child],
        outcomes: Outcomes,
        resources: GroupResources,
        hold: Hold,
        hub: ControlHub | None,
        recorder: _hooks.NullRecorder,
        on_failure: Callable[[], None],
    ) -> None:
        self._spec = spec
        self._children = children
        self._outcomes = outcomes
        self._resources = resources
        self._hold = hold
        self._hub = hub
        self._rec = recorder
        self._on_failure = on_failure
        self.dest = LogsDest()
        """The ranks' log and error file paths, set when the group starts."""
        self._watched: dict[int, asyncio.Event] = {}  # set once the watcher is over
        self._scopes: dict[int, anyio.CancelScope] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped: frozenset[int] = frozenset()  # ranks a stop records, with no watcher
        self.closed = False  # every exit is recorded: later ones are nobody's

    def __repr__(self) -> str:
        watching = sum(not e.is_set() for e in self._watched.values())
        return f"<Exits {self._spec.name} watching={watching} stopped={len(self._stopped)}>"

    def watch(self, rank: int, child: Child) -> None:
        """Notice ``rank``'s exit when it comes (called once it is started)."""
        child.watcher.future.add_done_callback(functools.partial(self._exited, rank, child))

    def _exited(self, rank: int, child: Child, exit: asyncio.Future[int]) -> None:
        """A worker's exit was noticed: record it, unless a stop is under way.

        A done callback, not a task per worker: a stop records the exits it
        causes in one pass, so the exits of a group being stopped cost no
        task switch each.  Only an exit noticed before any stop starts a
        task, to wait for its output and error file.  A plain task (anyio's
        ``start_soon`` needs to be called from a task): the stop waits for
        it, bounded, and cancels it if it is late.
        """
        self._hold.exited(rank)
        if rank in self._stopped:
            # the stop records it with the others once it is over; its
            # channel is closed now, while the other workers are still exiting
            if child.channel is not None:
                child.channel.close_when_settled()
            return
        if self.closed:
            return  # recorded already (a close noticed it first)
        self._watched[rank] = asyncio.Event()
        name = f"aioproc-watch-{child.label}"
        task = child.watcher.loop.create_task(self._watch(rank, child, exit.result()), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, rank: int, child: Child, code: int) -> None:
        if code != 0 and not child.stop_requested:
            # A failure whatever its error file says: the others are stopped
            # now, while its output drains and its error file is read.
            self._on_failure()
        try:
            with anyio.CancelScope() as scope:
                self._scopes[rank] = scope
                failure: ProcessFailure | None = None
                try:
                    failure = await self._settle(rank, child, code)
                except Exception:  # recorded below without the error file's content
                    logger.exception("reading the outcome of %s failed", child.label)
            if not scope.cancelled_caught:
                # the outcome is recorded whatever the drain did, or wait() would hang
                self.record(rank, child, code, failure)
        finally:
            self._watched[rank].set()

    async def _settle(self, rank: int, child: Child, code: int) -> ProcessFailure | None:
        """Wait for ``rank``'s output; its failure, with its error file read, if it failed."""
        settled = child.output_settled()
        if settled:
            await asyncio.wait(settled, timeout=DRAIN_TIMEOUT)
        if code == 0:
            return None
        # read off the loop, capped (see errors.py), by a helper job that
        # reads a burst of exits' files; results come back in bounded
        # batches (_base.offloop)
        error_file = self.dest.error_files.get(rank, "")
        # orders the failure, as load() would: when its exit was noticed,
        # before the exits of the ranks its stop causes
        observed = child.watcher.exit_time or time.time()
        content = await _read_error_file(error_file)
        return ProcessFailure._from_content(
            observed, content, rank, child.pid, code, error_file, child.stop_requested
        )

    # --------------------------------------------------------------- a stop

    def stopping(self) -> frozenset[int]:
        """A stop begins: the ranks whose exit it records (those not noticed yet)."""
        self._stopped = frozenset(rank for rank in self._children if rank not in self._watched)
        return self._stopped

    @property
    def watching(self) -> bool:
        """True while a watcher still waits for an exited worker's output or error file."""
        return any(not e.is_set() for e in self._watched.values())

    async def watched(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the watchers to be over."""
        pending = [e for e in self._watched.values() if not e.is_set()]
        if pending:
            with anyio.move_on_after(timeout):
                # one after the other, not gathered: hundreds of tasks made
                # in one step would hold the loop for milliseconds
                for event in pending:
                    await event.wait()

    async def read_stop_errors(self, ranks: frozenset[int]) -> dict[int, ErrorFileContent]:
        """The error files of those of ``ranks`` that have exited with an error.

        One helper job for all; ``rank -> read_error_file``'s result.
        """
        failed = [r for r in sorted(ranks) if self._children[r].returncode not in (0, None)]
        if not failed:
            return {}
        paths = [self.dest.error_files.get(rank, "") for rank in failed]
        return dict(zip(failed, await run_blocking(read_error_files, paths), strict=True))

    async def record_stopped(
        self, ranks: frozenset[int], early: dict[int, ErrorFileContent]
    ) -> None:
        """Record the exits of ``ranks``, which a stop caused, in one pass.

        One wait for all their output, the error files of those that failed
        (``early`` has those read while the stop went on), then the records
        a batch per loop iteration: what a watcher does per exit, done once
        for all.  Each failure is ordered by the time its exit was noticed.
        Ranks still running (unkillable) are left out.
        """
        children = self._children
        stopped = [(r, children[r]) for r in sorted(ranks) if children[r].watcher.future.done()]
        # by now most outputs have settled: wait only on the others
        settled = [f for _, c in stopped for f in c.output_settled() if not f.done()]
        if settled:
            await asyncio.wait(settled, timeout=DRAIN_TIMEOUT)
        # a worker SIGKILLed after the grace period exited after the early read
        failures = early | await self.read_stop_errors(
            frozenset(rank for rank, _ in stopped if rank not in early)
        )
        for i, (rank, child) in enumerate(stopped):
            if i and not i % RECORD_BATCH:
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
                        self.dest.error_files.get(rank, ""),
                        child.stop_requested,
                    )
            except Exception:  # a bug here must not take the supervisor down
                logger.exception("recording the exit of %s failed", child.label)
                self._outcomes.fallback(rank, child, code)
                continue
            self.record(rank, child, code, failure)

    def give_up(self, stopped: frozenset[int]) -> None:
        """After a stop: an outcome for every rank whose recording did not finish.

        A watcher still waiting for output or an error file is cancelled and
        its rank recorded from its exit code; a rank of ``stopped`` that
        survived SIGKILL is recorded as such now, its exit whenever it comes.
        """
        for rank, scope in self._scopes.items():
            if not self._watched[rank].is_set():
                scope.cancel()
                child = self._children[rank]
                self._outcomes.fallback(rank, child, child.watcher.future.result())
        for rank in stopped:
            child = self._children[rank]
            if not child.watcher.future.done():
                error_file = self.dest.error_files.get(rank, "")
                self._outcomes.unkillable(rank, child, error_file)

    def cancel(self) -> None:
        """Cancel every watcher (a bug escaped the supervisor: its workers are killed)."""
        self.closed = True
        for task in self._tasks:
            task.cancel()

    # ------------------------------------------------------------- a record

    def record(
        self, rank: int, child: Child, code: int, failure: ProcessFailure | None = None
    ) -> None:
        """Record ``rank``'s exit with ``code`` (``failure``: built with its error file).

        A bug here must not take the supervisor down: the rank then gets an
        outcome from its exit code alone, or ``wait()`` would hang.
        """
        try:
            self._record(rank, child, code, failure)
        except Exception:
            logger.exception("recording the exit of %s failed", child.label)
            self._outcomes.fallback(rank, child, code)

    def _record(self, rank: int, child: Child, code: int, failure: ProcessFailure | None) -> None:
        spec, dest = self._spec, self.dest
        logs = (dest.stdouts.get(rank, ""), dest.stderrs.get(rank, ""))
        error_file = dest.error_files.get(rank, "")
        failed = self._outcomes.record(rank, child, code, error_file, failure, logs)
        oom = self._resources.oom(rank, child, code) if failed else None
        if oom is not None:
            self._outcomes.failures[rank].oom = oom
        if self._rec.enabled:
            outcome = _hooks.outcome_of(code, stopped=child.stop_requested)
            self._rec.worker_exited(spec.name, spec.role, outcome)
        if self._hub is not None:
            self._hub.left((spec.hub_keys or {}).get(rank, rank), code)
        if failed:
            self._on_failure()
        if spec.on_event is not None:
            exited = child.watcher.exit_time or time.time()
            usage = self._resources.usage({rank: child}).get(rank)
            notify(spec, WorkerEvent("exited", rank, child.pid, code, exited, usage, oom))
