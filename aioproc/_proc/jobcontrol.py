"""Job control for a supervisor on a terminal: Ctrl-Z stops its workers too.

Workers lead sessions of their own, so the terminal's SIGTSTP (Ctrl-Z) and
the shell's SIGCONT (``fg``, ``bg``) reach only the supervisor: without
help, the job shows "Stopped" while every worker computes on.  While
``follow_job_control()`` is active, SIGTSTP, SIGTTIN and SIGTTOU stop every
worker group of this process with SIGSTOP, then this process itself (as
their default action would), and SIGCONT continues the groups again.

The work is done in the signal handler itself, not on the event loop: a
stop must take effect even while the loop is busy, and the handler runs at
the main thread's next bytecode wherever it is.  So the groups are read
without the guardian's lock (the interrupted code may hold it).  A group
whose lease fence expired while everything was stopped is not continued:
the guardian is about to kill it, and its world is stale.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from . import lifeline as _lifeline

STOPS = (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
"""The terminal's stop signals: Ctrl-Z, and reads or writes from the background."""


def _signal_groups(groups: frozenset[int], sig: signal.Signals) -> None:
    for pgid in sorted(groups):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone; its leader is not reaped yet


def _on_stop(signum: int, frame: FrameType | None) -> None:
    _signal_groups(_lifeline.groups_now(), signal.SIGSTOP)
    # SIGSTOP, not the signal received: it cannot be caught, and stops this
    # process even in an orphaned process group, as the shell expects
    os.kill(os.getpid(), signal.SIGSTOP)


def _on_continue(signum: int, frame: FrameType | None) -> None:
    _signal_groups(_lifeline.groups_now() - _lifeline.fenced_out(), signal.SIGCONT)


@contextlib.contextmanager
def follow_job_control() -> Iterator[None]:
    """Stop and continue this process's worker groups with it (see the module).

    Does nothing outside the main thread (Python runs signal handlers only
    there); the previous handlers are restored on exit.
    """
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        for sig in STOPS:
            previous[sig] = signal.signal(sig, _on_stop)
        previous[signal.SIGCONT] = signal.signal(signal.SIGCONT, _on_continue)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
