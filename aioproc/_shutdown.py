"""Graceful-then-forced stop of worker process groups, bounded in time.

``stop_groups`` signals every group, waits (on the exit watchers, not by
polling) up to the grace period for the workers to exit, then SIGKILLs every
group that still has members and waits a bounded time for the kill to land.
A worker that needed SIGKILL is named in a ``ForcedKillWarning``; a process
that survives even SIGKILL (uninterruptible sleep) is reported and left,
never waited on forever.  Groups are signalled even when their leader has
already exited, so descendants a worker left behind are stopped too.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import warnings
from collections.abc import Sequence

from ._spawn import Child
from .errors import ForcedKillWarning

logger = logging.getLogger("aioproc")

KILL_WAIT = 5.0
"""Seconds to wait for SIGKILLed workers to be reaped before reporting them."""


async def stop_groups(children: Sequence[Child], death_sig: int, timeout: float) -> list[Child]:
    """Stop ``children``: ``death_sig`` to each group, grace ``timeout``, then SIGKILL.

    Returns the workers that had to be killed (see ``warn_forced``).  The
    caller shields this from cancellation; it always returns within
    ``timeout + KILL_WAIT`` seconds.
    """
    running = [c for c in children if c.returncode is None]
    for c in running:
        c.stop_requested = True
    for c in children:
        # exited leaders too: their descendants may still be in the group
        c.signal_group(death_sig)
    pending = {c.watcher.future for c in running if not c.watcher.future.done()}
    if pending and timeout > 0:
        await asyncio.wait(pending, timeout=timeout)
    forced = [c for c in running if not c.watcher.future.done()]
    for c in children:
        if c.group_alive():
            c.signal_group(signal.SIGKILL)
    if forced:
        for c in forced:
            c.forced = True
        await asyncio.wait({c.watcher.future for c in forced}, timeout=KILL_WAIT)
        for c in forced:
            if not c.watcher.future.done():
                logger.error(
                    "worker %s (pid %d) survived SIGKILL for %g s (uninterruptible?); "
                    "leaving it unreaped",
                    c.label,
                    c.pid,
                    KILL_WAIT,
                )
                c.watcher.detach()
    return forced


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
        f"{len(forced)} worker(s) did not exit within {timeout:g} s of "
        f"{asked} and were killed with SIGKILL: {names}",
        ForcedKillWarning,
        stacklevel=2,  # the aioproc call that stopped the workers
    )
