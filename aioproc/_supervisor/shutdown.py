"""``Shutdown``: the one stop of a group, whether a failure or a close asked for it.

The first failure and ``close()`` start the same stop: the held workers
are let go, every group gets the graceful signal, the leaders and then
what they left in their groups get the grace period (a later close can
bring its end forward), what is left is SIGKILLed (``_proc.shutdown``).
The exits it causes are recorded together (``Exits.record_stopped``);
their error files are read while the stop still looks for descendants,
and the private log tree is pruned on the helper thread while the loop
records them.  Then the pipes are drained and closed, the sinks closed,
the leaders reaped and the guardian left to settle; a ``ForcedKillWarning``
comes last, once nothing is left to clean up.

A failure and the close after it are one stop, not two: ``wait()``'s
close finds the stop under way (or over) and waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._base.offloop import helper, run_blocking
from .._errors.failure import ErrorFileContent
from .._group.outcomes import Outcomes
from .._group.rank_launcher import RankLauncher
from .._output.console import release_consoles
from .._proc import lifeline as _lifeline
from .._proc.shutdown import Deadline, Release, release, stop_groups, warn_forced
from .._proc.spawn import Child
from ..logs import LogsSpecs
from .exits import DRAIN_TIMEOUT, Exits
from .hold import Hold
from .spec import GroupSpec

logger = logging.getLogger("aioproc")


async def _prune_after(reads: Sequence[asyncio.Future[Any]], specs: LogsSpecs) -> None:
    if reads:
        await asyncio.wait(reads)
    await run_blocking(specs.prune)


class Shutdown:
    """The stop of one group (see the module docstring).

    Args:
        spec: the group's checked spec.
        children: the started workers by rank.
        outcomes: checked for completeness once the exits are recorded.
        hold: let go before any signal.
        exits: records what the stop causes.
        ranks: the group's sinks, closed at the end.
        recorded: called once every exit is recorded and the pipes are
            closed, with whether a worker had to be signalled and the
            seconds the stop took.
    """

    def __init__(
        self,
        spec: GroupSpec,
        children: Mapping[int, Child],
        outcomes: Outcomes,
        hold: Hold,
        exits: Exits,
        ranks: RankLauncher,
        recorded: Callable[[bool, float], None],
    ) -> None:
        self._spec = spec
        self._children = children
        self._outcomes = outcomes
        self._hold = hold
        self._exits = exits
        self._ranks = ranks
        self._recorded = recorded
        self.deadline = Deadline()
        """The end of the grace period, which a later close can bring forward."""
        self._began = 0.0
        self._reading: list[asyncio.Future[dict[int, ErrorFileContent]]] = []

    def __repr__(self) -> str:
        return f"<Shutdown {self._spec.name} {self.deadline!r}>"

    def bring_forward(self, sig: int, timeout: float) -> None:
        """A later request: its grace period ends the stop's sooner if it is shorter."""
        grace = 0.0 if sig == signal.SIGKILL else timeout
        self.deadline.bring_forward(time.monotonic() + grace)

    async def run(self, sig: int, timeout: float, temp_root: str | None) -> None:
        """Stop every worker with ``sig``, SIGKILL after ``timeout``; record; release.

        ``temp_root``: the private log dir the guardian tidies after a
        crash, forgotten once pruned.

        Cancellation: the caller shields it; bounded by ``timeout`` plus the
        kill, drain and sink deadlines.
        """
        with helper():  # one helper thread for the whole shutdown (see _base.offloop)
            self._hold.release_all()  # the held workers exit now, not after the grace period
            children = list(self._children.values())
            self._began = time.monotonic()
            signalled = any(c.returncode is None for c in children)
            stopping = self._exits.stopping()
            forced = await self._stop(children, sig, timeout, stopping)
            granted = max(0.0, min(timeout, self.deadline.at - self._began))
            pruned: asyncio.Future[None] | None = None
            if not forced and not self._exits.watching and not any(c.tees for c in children):
                # Nothing writes in the log tree any more: the groups are empty
                # and no pipe of ours feeds a file.  Once the stopped workers'
                # error files are read (and no other read is due: none was
                # forced, no watcher is reading), the helper thread prunes it
                # while the loop records the exits.
                pruned = asyncio.ensure_future(_prune_after(self._reading, self._spec.logs_specs))
            try:
                await self._record(children, stopping, signalled, pruned)
            finally:
                if pruned is not None:
                    await pruned
        if temp_root is not None:
            _lifeline.untidy(temp_root)
        warn_forced(forced, sig, granted)

    async def _stop(
        self, children: list[Child], sig: int, timeout: float, stopping: frozenset[int]
    ) -> list[Child]:
        """Signal, wait, kill; the workers that needed SIGKILL."""
        if not children:
            return []

        def leaders_done() -> None:
            # their error files are read while the stop looks for descendants
            self._reading.append(asyncio.ensure_future(self._exits.read_stop_errors(stopping)))

        return await stop_groups(
            children, sig, timeout, deadline=self.deadline, leaders_done=leaders_done
        )

    async def _record(
        self,
        children: list[Child],
        stopping: frozenset[int],
        signalled: bool,
        pruned: asyncio.Future[None] | None,
    ) -> None:
        """Record every exit, then close the pipes and sinks; the guardian settles last."""
        await self._exits.watched(DRAIN_TIMEOUT + 1)
        early = await self._reading[0] if self._reading else {}
        # The groups get no more signals: forget them (one write to the
        # guardian, which exits if it guards nothing else) and reap their
        # leaders now, so that the guardian's exit overlaps what follows.
        done = Release(children)
        if stopping:
            await done.reaped()  # their "exited" events carry the usage of the reap
        await self._exits.record_stopped(stopping, early)
        self._exits.give_up(stopping)
        ranks = self._ranks
        own_sinks = ranks.sinks if self._spec.close_sinks else []
        await done.close(drain=DRAIN_TIMEOUT, sinks=[*own_sinks, *ranks.filter_sinks.values()])
        release_consoles()  # the host's sinks stay open, not our fds on its console
        self._outcomes.check_finished()
        self._exits.closed = True
        self._recorded(signalled, time.monotonic() - self._began)
        if pruned is None:
            # the sinks wrote into the tree until now: prune it only now,
            # while the loop waits for the guardian
            pruned = asyncio.ensure_future(run_blocking(self._spec.logs_specs.prune))
            try:
                await done.settle()
            finally:
                await pruned
        else:
            await done.settle()

    async def emergency(self) -> None:
        """A bug escaped the supervisor: kill every worker at once and release it.

        Cancellation: the caller shields it; bounded by the kill and release waits.
        """
        self._exits.cancel()
        children = list(self._children.values())
        await stop_groups(children, signal.SIGKILL, 0.0)
        await release(children, drain=0.0)
