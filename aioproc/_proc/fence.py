"""A lease deadline kept by the guardian: a ``Fence`` and the groups it guards.

A ``Fence`` keeps a multi-host agent's lease fence without its loop: the
agent's keep-alive moves the fence's deadline after every renewal, and the
guardian (``f<id> <seconds left> <groups>``) runs a timer (a background
``sleep``) that SIGKILLs the fence's groups when it expires unrenewed, so
the workers of an agent that is stopped, starved or wedged die before etcd
can expire its lease.

The guardian itself (its script, its lock, the groups it knows) is
``lifeline``'s, which imports this module: it adds a group registered inside
``Fence.scope()`` to that fence, takes forgotten groups out of every fence
before their ids may be reused, and sends every fence's line to a guardian
that replaces a dead one.  A fence writes to the guardian through the hook
``lifeline`` sets with ``link``.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol


class GuardianPipe(Protocol):
    """What a fence needs of the guardian (``lifeline._Guardian``): a line written to it."""

    def write(self, text: str) -> bool: ...


def _unlinked() -> AbstractContextManager[GuardianPipe | None]:
    """Before ``link``: no guardian to write to, no lock to hold."""
    return contextlib.nullcontext()


_guardian: Callable[[], AbstractContextManager[GuardianPipe | None]] = _unlinked
"""Holds the guardian's lock and yields this process's guardian, if one runs (see ``link``)."""


def link(guardian: Callable[[], AbstractContextManager[GuardianPipe | None]]) -> None:
    """How a fence reaches the guardian: set once by ``lifeline`` as it is imported.

    ``guardian()`` holds the guardian's lock while in use and yields this
    process's guardian, or None when none runs (or it is a forked parent's).
    """
    global _guardian
    _guardian = guardian


class Fence:
    """Worker groups the guardian SIGKILLs by itself once a deadline passes.

    The lease fence of a multi-host agent: its etcd keep-alive renews
    the deadline after every renewal, and the groups started inside
    ``scope()`` join the fence as they are registered.  The guardian arms a
    timer with what is left of the deadline at every change; when the
    deadline passes without a renewal (the agent stopped, starved,
    swapped out or wedged, its loop running or not), the timer SIGKILLs
    the fence's groups, so a world the other hosts have given up on never
    trains beside the new one.  A group leaves the fence when it is
    forgotten, before its leader is reaped.
    """

    def __init__(self) -> None:
        self.id = next(_fence_ids)
        self.groups: set[int] = set()
        self.deadline: float | None = None
        self._told: float | None = None  # the deadline the guardian last heard

    def __repr__(self) -> str:
        return f"<Fence {self.id} groups={sorted(self.groups)} deadline={self.deadline}>"

    def line(self) -> str:
        """The guardian's line for this fence: its groups and the time left, or disarm."""
        if self.deadline is None or not self.groups:
            self._told = None
            return f"f{self.id}\n"
        self._told = self.deadline
        left = max(0.0, self.deadline - time.monotonic())
        return f"f{self.id} {left:.3f} {' '.join(str(g) for g in sorted(self.groups))}\n"

    def leave(self, pgids: Iterable[int]) -> str:
        """Drop ``pgids``; the guardian's line if that changed anything, else ''."""
        gone = self.groups.intersection(pgids)
        if not gone:
            return ""
        self.groups -= gone
        return self.line()

    def renew(self, deadline: float, lag: float = 0.0) -> None:
        """Move the deadline to ``deadline`` (``time.monotonic()``'s clock).

        The guardian hears of it only once it is ``lag`` seconds past the
        deadline the guardian has, so that frequent renewals cost it a
        wake-up (and a timer) only every ``lag`` seconds; its deadline is
        then at most ``lag`` early.
        """
        with _guardian() as guardian:
            self.deadline = deadline
            _fences[self.id] = self
            if (
                self.groups
                and guardian is not None
                and (self._told is None or deadline - self._told >= lag)
            ):
                guardian.write(self.line())

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Groups registered in this context (tasks started in it too) join the fence."""
        with _guardian():
            _fences[self.id] = self
        reset = _scope.set(self)
        try:
            yield
        finally:
            _scope.reset(reset)

    def close(self) -> None:
        """Disarm the fence: its groups are the guardian's plain groups again."""
        with _guardian() as guardian:
            if _fences.pop(self.id, None) is None:
                return
            self.deadline = None
            if self.groups and guardian is not None:
                guardian.write(self.line())
            self.groups.clear()


_fence_ids = itertools.count(1)
_fences: dict[int, Fence] = {}  # open fences by id (see Fence)
_scope: contextvars.ContextVar[Fence | None] = contextvars.ContextVar("aioproc_fence", default=None)


def fenced_out() -> frozenset[int]:
    """Groups of fences whose deadline has passed (read without the lock)."""
    now = time.monotonic()
    out: set[int] = set()
    for fence in list(_fences.values()):
        deadline = fence.deadline
        if deadline is not None and deadline <= now:
            out.update(fence.groups)
    return frozenset(out)
