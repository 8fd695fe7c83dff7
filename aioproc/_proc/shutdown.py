"""Graceful-then-forced stop of worker process groups, bounded in time.

``stop_groups`` signals every group the supervisor still owns, and continues
it (SIGCONT, as systemd does: a stopped worker must run to handle the signal;
never a group whose lease fence expired), waits (on exit
watchers and pidfds, never by polling) up to ``timeout`` for the leaders and
then for the descendants still in their groups, SIGKILLs what is left and
waits a bounded time for the kill to land.  A worker that needed SIGKILL is
named in a ``ForcedKillWarning``; one that survives even SIGKILL
(uninterruptible sleep) is reported and reaped later, whenever it exits,
never waited on forever.

Only groups whose leader is still unreaped are signalled (``Child.owns_group``):
such a group id cannot have been recycled for somebody else.

The grace period ends at a ``Deadline`` that a later request can bring
forward (a second Ctrl-C: SIGKILL now); the waits wake up when it moves.

After the last signal, every stop ends the same way, written once here
(``Release``, or ``release`` for the whole of it): the groups are forgotten
by the guardian and their leaders reaped, the pipes are read to EOF and
closed, the sinks closed, and the guardian left to settle.  Only then is a
``ForcedKillWarning`` issued (``warn_forced``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._base.offloop import run_blocking
from .._errors.failure import ForcedKillWarning
from .._output.sink import Sink
from .._output.sinkops import close_sinks
from . import lifeline
from .spawn import Child

logger = logging.getLogger("aioproc")

KILL_WAIT = 5.0
"""Seconds to wait for SIGKILLed workers to exit before reporting them."""


_NO_CONTINUE = frozenset(
    {signal.SIGKILL, signal.SIGCONT, signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}
)
"""Signals after which no SIGCONT is sent: one a stopped process needs not
handle, SIGCONT itself, and those that stop."""

_SIGNAL_BATCH = 32
"""Groups signalled per loop iteration.

A signal to a group costs ~10 us of the loop's CPU, up to ~80 us while the
workers it stops are exiting on the same CPUs.  Fewer per iteration spread a
stop over more iterations, each of which also runs the exits noticed so far:
closing 64 function workers took 38 ms with 8 per iteration, 31 ms with 32
(asyncio; no clear difference on uvloop).
"""


class Deadline:
    """The end of a grace period (``time.monotonic()``), which can only come sooner.

    ``bring_forward`` wakes whoever is in ``wait()``, so a request to kill
    now is acted on at once, not at the old deadline.
    """

    def __init__(self) -> None:
        self.at = math.inf
        self._moved: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        left = self.at - time.monotonic()
        return f"<Deadline in {left:.3g} s>" if math.isfinite(left) else "<Deadline unset>"

    def bring_forward(self, at: float) -> None:
        """End the grace period at ``at`` if that is sooner."""
        if at < self.at:
            self.at = at
            if self._moved is not None and not self._moved.done():
                self._moved.set_result(None)

    async def wait(self, futures: Iterable[asyncio.Future[Any]]) -> None:
        """Until every one of ``futures`` is done or the deadline has passed."""
        pending = {f for f in futures if not f.done()}
        if not pending:
            return
        loop = asyncio.get_running_loop()
        # woken when all are done or the deadline moves, never per exit (a
        # group of hundreds would make that quadratic) nor on a timer
        everything = asyncio.ensure_future(asyncio.wait(pending))
        try:
            while not everything.done() and (left := self.at - time.monotonic()) > 0:
                moved = self._moved = loop.create_future()
                try:
                    await asyncio.wait(
                        {everything, moved}, timeout=left, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    self._moved = None
                    moved.cancel()
        finally:
            everything.cancel()


async def stop_groups(
    children: Sequence[Child],
    death_sig: int,
    timeout: float,
    *,
    deadline: Deadline | None = None,
    leaders_done: Callable[[], None] | None = None,
    fenced: Callable[[], frozenset[int]] = lifeline.fenced_out,
) -> list[Child]:
    """Stop ``children``: ``death_sig`` to each group, grace ``timeout``, then SIGKILL.

    Each group gets SIGCONT right after ``death_sig``, as systemd sends it: a
    stopped worker (SIGSTOP, a debugger, a suspended job) would otherwise
    keep the signal pending, unhandled, for the whole grace period, and be
    SIGKILLed at its end.  Not the groups ``fenced()`` names (their lease
    fence expired: their world is stale, and the guardian kills them), which
    are never continued.  The grace period covers the whole group: once a
    leader has exited, the processes it left in its group get the rest of
    ``timeout`` before they are killed.  ``deadline``, if given, is where the grace period ends (at
    most ``timeout`` from now): whoever brings it forward cuts the grace
    period short.  ``leaders_done``, if given, is called once the leaders
    have exited or the grace period is over, before the wait for what they
    left in their groups, so that work on their exits can overlap it.
    Returns the workers whose leader had to be killed (see ``warn_forced``).
    The caller shields this from cancellation; it always returns within
    ``timeout + KILL_WAIT`` seconds.
    """
    if deadline is None:
        deadline = Deadline()
    deadline.bring_forward(time.monotonic() + timeout)
    running = [c for c in children if c.returncode is None]
    for c in running:
        c.stop_requested = True
    # a swept group (SIGKILLed after its leader exited) can never hold a
    # process again: nothing to signal, nothing to wait for
    owned = [c for c in children if c.owns_group and not c.swept]
    stale = fenced() if owned and death_sig not in _NO_CONTINUE else None
    for i, c in enumerate(owned):
        if i and not i % _SIGNAL_BATCH:
            await asyncio.sleep(0)  # a few hundred signals: let the loop breathe
        # exited leaders too: their descendants may still be in the group
        if c.signal_group(death_sig) and stale is not None and c.pgid not in stale:
            c.signal_group(signal.SIGCONT)
    await deadline.wait(c.watcher.future for c in running)
    if leaders_done is not None:
        leaders_done()
    forced = [c for c in running if not c.watcher.future.done()]
    if not forced:
        await _wait_descendants({c.pgid for c in owned}, deadline)
    for i, c in enumerate(owned):
        if i and not i % _SIGNAL_BATCH:
            await asyncio.sleep(0)  # as above: yield between batches of signals
        c.signal_group(signal.SIGKILL)
        if c.watcher.future.done():
            c.swept = True  # leader gone before the SIGKILL: the group is empty for good
    if forced:
        for c in forced:
            c.forced = True
        await asyncio.wait({c.watcher.future for c in forced}, timeout=KILL_WAIT)
        for c in forced:
            if not c.watcher.future.done():
                c.unkillable = True
                logger.error(
                    "worker %s (pid %d) survived SIGKILL for %g s (uninterruptible sleep?); "
                    "it will be reaped when it finally exits",
                    c.label,
                    c.pid,
                    KILL_WAIT,
                )
    return forced


_SCAN_BATCH = 256
"""``/proc`` entries looked at per loop iteration by ``group_members``."""


async def group_members(pgids: Iterable[int]) -> list[int]:
    """Live (non-zombie) processes in the given process groups, leaders apart.

    The leaders themselves (pid == pgid) are not listed: the caller knows
    them and waits on them itself.  Each ``/proc`` entry costs one
    ``getpgid`` (~1 us, no file is opened); only a member's ``stat`` is
    read, to leave out zombies.  The scan runs on the loop, a slice of
    entries per iteration: a hand-over to the helper thread and back took
    longer than the scan of a few hundred entries.  ``listdir`` rather than
    ``scandir``: one call, and no object per entry (a sixth of the scan).
    """
    wanted = set(pgids)
    if not wanted:
        return []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []  # no /proc: nothing to wait for
    members = []
    getpgid = os.getpgid
    for i in range(0, len(names), _SCAN_BATCH):
        if i:
            await asyncio.sleep(0)  # a machine may run thousands of processes
        for name in names[i : i + _SCAN_BATCH]:
            if not name.isdigit():
                continue
            pid = int(name)
            if pid in wanted:
                continue
            try:
                if getpgid(pid) not in wanted:
                    continue
            except OSError:
                continue  # exited meanwhile
            if not _is_zombie(pid):
                members.append(pid)
    return members


def _is_zombie(pid: int) -> bool:
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return True  # reaped meanwhile: nothing to wait for
    try:
        stat = os.read(fd, 1024)
    except OSError:
        return True
    finally:
        os.close(fd)
    state = stat.rfind(b")") + 2  # "pid (comm) state ...": comm may hold spaces and parens
    return stat[state : state + 1] == b"Z"


async def _wait_descendants(pgids: set[int], deadline: Deadline) -> None:
    """Wait until the groups hold no live process, or until ``deadline``.

    Members are found by one scan of ``/proc`` and waited on with pidfds;
    the scan is repeated only after they have exited (a member may have
    forked meanwhile), so nothing is polled on a timer.
    """
    loop = asyncio.get_running_loop()
    while deadline.at > time.monotonic():
        members = await group_members(pgids)
        if not members:
            return
        fds: list[int] = []
        futs: list[asyncio.Future[None]] = []
        try:
            for pid in members:
                try:
                    fd = os.pidfd_open(pid)
                except OSError:
                    continue  # already gone
                fds.append(fd)
                fut: asyncio.Future[None] = loop.create_future()
                loop.add_reader(fd, _resolve, fut)
                futs.append(fut)
            if not futs:
                return  # pidfds unsupported, or all gone: nothing to wait on
            await deadline.wait(futs)
        finally:
            for fd in fds:
                loop.remove_reader(fd)
                os.close(fd)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


_RELEASE_BATCH = 8
"""Workers whose pipes are closed per loop iteration: hundreds at once would hold the loop."""

_REAP_ON_LOOP = 8
"""Leaders reaped on the loop when fewer exited; more go to the helper thread."""


def _reap(children: Sequence[lifeline.ExitWatcherOwner]) -> None:
    for c in children:
        c.watcher.reap()


class Release:
    """The end of every stop, once the last signal went to ``children``.

    Made at once, it forgets the groups of the exited leaders in one write
    to the guardian and reaps those leaders (a batch on the loop, more on
    the helper thread, overlapping what the caller does next); a leader
    still running, one that survived SIGKILL, is released whenever it
    exits.  The caller may record the exits meanwhile, then calls
    :meth:`close` and :meth:`settle`, in that order.
    """

    def __init__(self, children: Sequence[Child]) -> None:
        self._children = list(children)
        exited = lifeline.forget_exited(self._children)
        self._reaping: asyncio.Future[None] | None = None
        if len(exited) < _REAP_ON_LOOP:
            _reap(exited)  # ~15 us each: a thread hop would cost more
        else:
            self._reaping = asyncio.ensure_future(run_blocking(_reap, exited))
        for c in self._children:
            if not c.watcher.future.done():
                c.release_when_exited()

    async def reaped(self) -> None:
        """Until the exited leaders are reaped, and their ``watcher.usage`` is known.

        Cancellation: callers run it shielded; bounded by a reap per leader.
        """
        if self._reaping is not None:
            await self._reaping

    async def close(self, *, drain: float, sinks: Sequence[Sink] = ()) -> None:
        """Close every pipe at its EOF, or ``drain`` seconds on, then the sinks.

        The EOFs are awaited together; then the pipes are cut a batch per
        loop iteration: those at EOF at once, the others (a descendant that
        left the group holds them) after one more ``drain``.

        Cancellation: callers run it shielded; it is bounded by twice
        ``drain`` plus the sinks' close deadline.
        """
        children = self._children
        eofs = [f for c in children for f in c.streams_eof()]
        if eofs:
            await asyncio.wait(eofs, timeout=drain)
        for i in range(0, len(children), _RELEASE_BATCH):
            batch = children[i : i + _RELEASE_BATCH]
            late = [c.close_streams(drain) for c in batch if c.streams_eof()]
            closing = [f for c in batch if not c.streams_eof() for f in c.cut_streams()]
            if late:
                await asyncio.gather(*late)
            if closing:
                await asyncio.wait(closing)
        # bounded, and never raises: the caller's cleanup always goes on
        await close_sinks(sinks)
        if self._reaping is not None:
            await self._reaping

    async def settle(self) -> None:
        """Wait for the guardians this stop dismissed to exit.

        Cancellation: bounded (see ``lifeline.settle``); run shielded.
        """
        await lifeline.settle()


async def release(children: Sequence[Child], *, drain: float, sinks: Sequence[Sink] = ()) -> None:
    """All of :class:`Release`, for a stop with nothing to record between its steps.

    Cancellation: callers run it shielded; bounded as ``Release.close``.
    """
    done = Release(children)
    await done.close(drain=drain, sinks=sinks)
    await done.settle()


def warn_forced(
    forced: Sequence[Child], death_sig: int, timeout: float, *, request: str | None = None
) -> None:
    """Issue the ``ForcedKillWarning`` for ``forced`` (after cleanup is complete).

    Warned only after everything is reaped and closed, so a warnings filter
    that turns it into an error can never abort a cleanup half-way.  Not
    issued when SIGKILL was the requested signal in the first place.
    ``request`` names what was asked instead of a signal (e.g. a terminate
    request over the control channel).
    """
    if not forced or (request is None and death_sig == signal.SIGKILL):
        return
    names = ", ".join(f"{c.label} (pid {c.pid})" for c in forced)
    asked = request or signal.Signals(death_sig).name
    warnings.warn(
        f"{len(forced)} worker(s) did not exit within {round(timeout, 2):g} s of "
        f"{asked} and were killed with SIGKILL: {names}",
        ForcedKillWarning,
        stacklevel=2,  # the aioproc call that stopped the workers
    )
