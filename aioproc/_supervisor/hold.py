"""``Hold``: function workers that returned wait for their peers before they exit.

As torch's ``start_processes`` holds each worker until the parent has read
every local result, a worker whose function returned stays alive until
every rank of the group has an outcome (or the group is stopped): a gloo
process group never destroyed is then torn down by no rank while another
still uses it (see "Holding" in ``_child.boot``).  A lone rank is let go
at once.  Letting a worker go is one TERMINATE frame on its channel; a stop
sends it before its signal, so a held worker exits by itself, however its
code handles the signal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from .._child.channel import TERMINATE
from .._proc.spawn import Child


class Hold:
    """Which ranks hold after their result, and when they are let go.

    Args:
        nprocs: the group's ranks.
        children: the group's started workers by rank (filled by the launch).
        left: called with a rank that returned while it is still held: it
            will never reach the barrier again (it exits with 0 once let go),
            so the ranks waiting there must not wait for it.
    """

    def __init__(
        self, nprocs: int, children: Mapping[int, Child], left: Callable[[int], None] | None
    ) -> None:
        self._nprocs = nprocs
        self._children = children
        self._left = left
        self._holding: set[int] = set()  # returned, waiting for TERMINATE
        self._unannounced: set[int] = set()  # returned before its launch was over
        self._done: set[int] = set()  # outcome in or on its way (result, exit, never started)
        self.released = False  # every outcome is in, or a stop began: nobody holds

    def __repr__(self) -> str:
        state = "released" if self.released else f"holding {sorted(self._holding)}"
        return f"<Hold {len(self._done)}/{self._nprocs} done, {state}>"

    def returned(self, rank: int) -> None:
        """``rank`` sent its result: it now waits for TERMINATE to exit."""
        self._holding.add(rank)
        self.done(rank)
        if rank not in self._children:
            # its launch is not over, so the barrier does not know it yet:
            # ``started`` tells it, once it does
            self._unannounced.add(rank)
        elif rank in self._holding and self._left is not None:
            self._left(rank)

    def done(self, rank: int) -> None:
        """``rank``'s outcome is in or on its way; once every rank's is, let them all go."""
        self._done.add(rank)
        if self.released or len(self._done) >= self._nprocs:
            self.release_all()

    def exited(self, rank: int) -> None:
        """``rank``'s process is gone: nothing to let go any more."""
        self._holding.discard(rank)
        self.done(rank)

    def started(self, rank: int) -> None:
        """``rank``'s launch is over: if it returned while being launched, the
        barrier learns it left, and it is let go now if the group is done."""
        if rank in self._unannounced:
            self._unannounced.discard(rank)
            if rank in self._holding and self._left is not None:
                self._left(rank)
        if self.released and rank in self._holding:
            self._release(rank)

    def release_all(self) -> None:
        """Let every held worker exit: the group has every outcome, or it is being stopped."""
        self.released = True
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
            child.channel.send(TERMINATE)
