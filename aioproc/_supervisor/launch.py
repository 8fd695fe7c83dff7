"""``Launch``: every rank of a group started, a few at a time, in rank order.

Function workers start one by one, a window of them in flight (forks queue
on the helper thread; a forkserver template forks a larger window at once);
binary workers start in batches, one helper job each, two batches in
flight, so the helper thread starts one while the loop wires up the other.
Rank 0 goes alone first: its "started" event (the CLI names the log dir
then) comes before the other workers' output.  Each started rank is shown
to the hub, the hold, the metrics and ``on_event``, then its output is let
through and its exit watched.

A close stops the launch (``cancel``); a failure does not: the ranks still
to launch are launched and then stopped with the others, as torch does.
The first error ends the launch once the launches in flight are in; ranks
never launched are reported as such (``NEVER_STARTED``).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Hashable, MutableMapping

import anyio

from .._base.shield import shielded
from .._child.channel import ARRIVE, RESULT, STACKS
from .._func import template as _template
from .._func.barrier import ControlHub
from .._func.script import script_dirs
from .._group.outcomes import Outcomes
from .._group.rank_launcher import RankLauncher
from .._group.rankdirs import RankDirs
from .._metrics import hooks as _hooks
from .._proc import lifeline as _lifeline
from .._proc.posix_spawn import name_fd_limit
from .._proc.spawn import Child
from ..logs import LogsDest
from ..results import WorkerEvent
from .exits import Exits, notify
from .hold import Hold
from .spec import GroupSpec

LAUNCH_WINDOW = 8
"""Workers being launched at once: forks queue on the helper thread, in rank order."""

FORK_WINDOW = 32
"""The same for workers forked from a template: their requests go out together,
and the template forks them all before it waits for the first (see ``_func.template``)."""

BINARY_BATCH = 16
"""Binary workers started by one helper job (one hand-over between thread and loop)."""

BATCHES_IN_FLIGHT = 2
"""Batches of binary workers queued at once: the helper thread starts one while
the loop wires up the other."""


class Launch:
    """The launch of one group's ranks (see the module docstring).

    Args:
        spec: the group's checked spec.
        ranks: turns a rank into a running ``Child``.
        children: filled with each started worker, by rank.
        outcomes: gets the frames of function workers and never-started ranks.
        hold: told when a rank returned and when its launch is over.
        exits: watches each started worker's exit.
        hub: the ``ControlHub`` each function worker is attached to.
        recorder: the group's metrics recorder.
    """

    def __init__(
        self,
        spec: GroupSpec,
        ranks: RankLauncher,
        children: MutableMapping[int, Child],
        outcomes: Outcomes,
        hold: Hold,
        exits: Exits,
        hub: ControlHub | None,
        recorder: _hooks.NullRecorder,
    ) -> None:
        self._spec = spec
        self._ranks = ranks
        self._children = children
        self._outcomes = outcomes
        self._hold = hold
        self._exits = exits
        self._hub = hub
        self._rec = recorder
        self.rank_dirs: dict[int, str] = {}
        """Rank dirs the plan left to the launch: each made before its rank starts."""
        self.error: Exception | None = None
        """What ended the launch early (the first error), if anything did."""
        self.done = asyncio.Event()
        self._cancelled = False
        self._scope: anyio.CancelScope | None = None
        self._guardian = False  # held from the temp root's creation to the launch's end
        self._errors: list[Exception] = []

    def __repr__(self) -> str:
        state = "done" if self.done.is_set() else "cancelled" if self._cancelled else "running"
        return f"<Launch {self._spec.name} {len(self._children)}/{self._spec.nprocs} {state}>"

    def hold_guardian(self) -> None:
        """Keep the guardian until the launch is over (a private temp root is being made)."""
        _lifeline.hold()
        self._guardian = True

    def release_guardian(self) -> None:
        """Let the guardian go if this launch held it (idempotent)."""
        if self._guardian:
            self._guardian = False
            _lifeline.unhold()

    def cancel(self) -> None:
        """Launch no more ranks (a close): the launches in flight are cancelled."""
        self._cancelled = True
        if self._scope is not None:
            self._scope.cancel()

    async def run(self, dest: LogsDest, payloads: dict[int, list[bytes]]) -> None:
        """Launch every rank; the first error is kept in ``error``, not raised.

        Cancellation: only by ``cancel()``; whatever was started stays in
        ``children`` for the stop.
        """
        with anyio.CancelScope() as self._scope:
            try:
                await self._all(dest, payloads)
            except Exception as e:
                self.error = e
        self._scope = None
        self.release_guardian()  # every group is registered (or none will be)
        self.done.set()
        self._ranks.discard_segments()  # of ranks never launched
        for rank in range(self._spec.nprocs):
            if rank not in self._children:
                self._outcomes.never_started(rank)
                self._hold.done(rank)

    async def _all(self, dest: LogsDest, payloads: dict[int, list[bytes]]) -> None:
        spec = self._spec
        template: _template.Template | None = None
        if spec.start_method == "forkserver" and (spec.is_function or self._ranks.scripts):
            # other binaries are spawned: exec would discard the template; a
            # Python script's own directory is searched for the preload first
            head = script_dirs(spec.entrypoint, spec.args)
            template = await _template.acquire(tuple(spec.preload), head)
        # binary workers start in batches, one helper job each (see
        # _spawn.spawn_binaries); a forkserver template runs scripts itself
        batched = not spec.is_function and not (
            spec.start_method == "forkserver" and self._ranks.scripts
        )
        batch = BINARY_BATCH if batched else 1
        in_flight = FORK_WINDOW if template is not None else LAUNCH_WINDOW
        window = anyio.Semaphore(BATCHES_IN_FLIGHT if batch > 1 else in_flight)
        units = [range(0, min(1, spec.nprocs))] if batch > 1 else []
        units += [
            range(i, min(i + batch, spec.nprocs)) for i in range(len(units), spec.nprocs, batch)
        ]
        dirs = RankDirs(self.rank_dirs, units)
        try:
            # a few launches in flight: the helper thread starts the next
            # workers while the loop wires up the last ones
            async with anyio.create_task_group() as launching:
                for ranks in units:
                    await window.acquire()
                    if self._cancelled or self._errors:
                        window.release()
                        break
                    name = f"aioproc-launch-{spec.name}/{ranks.start}"
                    unit = (dest, dirs, window, ranks)
                    if batch > 1:
                        launching.start_soon(self._batch, *unit, name=name)
                    else:
                        launching.start_soon(self._one, *unit, payloads, template, name=name)
            if self._errors:
                raise name_fd_limit(self._errors[0])  # an EMFILE says which limit to raise
        finally:
            await shielded(dirs.aclose())  # none is made after this (prune comes later)
            # forked workers do not need the template: it is closed now unless
            # somebody else (an agent, a pool, open_forkserver) holds it
            if template is not None:
                await shielded(_template.release(template))

    async def _one(
        self,
        dest: LogsDest,
        dirs: RankDirs,
        window: anyio.Semaphore,
        ranks: range,
        payloads: dict[int, list[bytes]],
        template: _template.Template | None,
    ) -> None:
        rank = ranks.start
        try:
            await dirs.ready(rank)
            handler = self._frame_handler(rank)
            child = await self._ranks.launch(rank, dest, payloads.get(rank), handler, template)
        except Exception as e:
            self._errors.append(e)  # the first one is raised once the others are in
            return
        finally:
            window.release()
        self._started(rank, child, handler if isinstance(handler, _RankFrames) else None)

    async def _batch(
        self, dest: LogsDest, dirs: RankDirs, window: anyio.Semaphore, ranks: range
    ) -> None:
        try:
            await dirs.ready(ranks.start)
            children, error = await self._ranks.launch_binaries(ranks, dest)
        except Exception as e:  # nothing of the batch is left running
            self._errors.append(e)
            return
        finally:
            window.release()
        for rank, child in children.items():
            self._started(rank, child)
        if error is not None:
            self._errors.append(error)

    def _key(self, rank: int) -> Hashable:
        return (self._spec.hub_keys or {}).get(rank, rank)

    def _started(self, rank: int, child: Child, frames: _RankFrames | None = None) -> None:
        spec = self._spec
        self._children[rank] = child
        if self._hub is not None and child.channel is not None:
            key = self._key(rank)
            self._hub.attach(key, child.channel, key if isinstance(key, str) else child.label)
            if frames is not None:
                frames.attached()  # what it sent the barrier while its launch went on
        self._hold.started(rank)  # it returned before its launch was over
        if self._rec.enabled:
            self._rec.worker_started(spec.name, spec.role)
        notify(spec, WorkerEvent("started", rank, child.pid, None, time.time()))
        child.release_output()  # its output reaches the sinks after this event
        self._exits.watch(rank, child)

    def _frame_handler(self, rank: int) -> Callable[[int, bytearray], None]:
        outcome = self._outcomes.frame_handler(rank)
        if self._hub is None:
            return outcome
        # weak: the worker's channel holds this handler, and this group its
        # workers; a cycle would keep every result (its shared memory, its
        # mapped fd) alive until the next garbage collection
        returned = weakref.WeakMethod(self._hold.returned)
        return _RankFrames(rank, self._key(rank), self._hub, outcome, returned)


class _RankFrames:
    """One launch's frames from its worker: its outcome, and its barrier's frames.

    The worker runs (and may reach the barrier) before its launch is over
    and the hub knows it: its barrier and stack frames are kept until then
    (``attached``), not dropped, or a rank that arrived early would never
    be counted.  One per launch, so a replacement never inherits them.
    """

    __slots__ = ("held", "hub", "key", "outcome", "rank", "returned")

    def __init__(
        self,
        rank: int,
        key: Hashable,
        hub: ControlHub,
        outcome: Callable[[int, bytearray], None],
        returned: Callable[[], Callable[[int], None] | None],
    ) -> None:
        self.rank = rank
        self.key = key
        self.hub = hub
        self.outcome = outcome
        self.returned = returned
        self.held: list[tuple[int, bytearray]] | None = []  # None: the hub knows the worker

    def __call__(self, kind: int, body: bytearray) -> None:
        if kind in (ARRIVE, STACKS):
            if self.held is not None:
                self.held.append((kind, body))
            else:
                self.hub.on_frame(self.key, kind, body)
            return
        self.outcome(kind, body)
        if kind == RESULT:
            group_returned = self.returned()
            if group_returned is not None:
                group_returned(self.rank)

    def attached(self) -> None:
        """The hub knows the worker now: it gets what the worker sent it meanwhile."""
        held, self.held = self.held, None
        for kind, body in held or ():
            self.hub.on_frame(self.key, kind, body)
