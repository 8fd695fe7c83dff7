"""What a test left behind: open handles, child processes, fds, threads, temp dirs.

A :class:`Snapshot` is taken before the test and compared after it.  What
leaked is described for a person (each handle never closed by its repr,
each process with its command line, each fd with what it points at) and
then removed, so that one leak does not make every later test fail too:
unclosed handles are forgotten and the process groups of their workers
killed, leaked children are SIGKILLed and reaped, leaked temp entries
deleted.  Fds and threads are only reported: closing an fd a test still
refers to, or a thread's resources, could break what runs next in ways
harder to read than the report.

A handle (a group, pool, persistent worker or agent) counts as closed when
the test closed it (``aclose()``, torch's ``close()``/``stop()``, the end of
its ``async with``, a group's final ``wait()``, an agent's ``run()`` that
returned), not when the event loop's shutdown cancelled what it owned: that
stops its processes, but a test that relied on it left the handle open.

Linux only (``/proc``); elsewhere the check reports nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from .._base.children import child_pids as child_pids
from .._base.resource import open_handles

SUPPORTED = sys.platform.startswith("linux")

THREAD_GRACE = 1.0
"""Seconds new threads get, in all, to finish before they count as leaked."""

AIOPROC_TEMP_PREFIXES = ("aioproc_", "aioproc-")
"""Names of the temp dirs aioproc makes (``DefaultLogsSpecs``, the pytest plugin)."""


def open_fds() -> set[int]:
    """The fds this process has open right now.

    The listing itself holds an fd while it reads the directory; that one is
    closed again by the time it is checked, so it never counts.
    """
    return {fd for fd in map(int, os.listdir("/proc/self/fd")) if _is_open(fd)}


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def registered_groups() -> frozenset[int]:
    """Process groups of aioproc's workers not yet reaped (the guardian's list)."""
    lifeline = sys.modules.get("aioproc._proc.lifeline")
    if lifeline is None:  # aioproc never started a worker here
        return frozenset()
    groups: frozenset[int] = lifeline.registered_groups()
    return groups


def _named(handle: object) -> str:
    """A handle's repr, with its name when the repr leaves it out (a pool's)."""
    text = repr(handle)
    name = getattr(handle, "name", None)
    return f"{text} {name!r}" if isinstance(name, str) and name not in text else text


def _kill_groups(groups: frozenset[int]) -> int | None:
    """SIGKILL the process groups of leaked workers, and have the guardian forget them.

    Forgotten before anything reaps their leaders (the guardian must never
    signal an id that may be reused); the guardian, guarding nothing more,
    is dismissed, so the next test starts a new one instead of finding a
    dead one.

    Returns:
        The pid of the guardian that guarded them, which exits by itself on
        its dismissal (aioproc reaps it), or None.
    """
    lifeline = sys.modules.get("aioproc._proc.lifeline")
    if lifeline is None or not groups:
        return None
    guardian: int | None = lifeline.current_pid()
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    lifeline.forget(*groups)
    return guardian


def describe_process(pid: int) -> str:
    """``pid 42: python -c ...`` (``(zombie) name`` for one that exited unreaped)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return f"pid {pid} (gone)"
    state = stat[stat.rfind(")") + 2 :].split()[0]
    name = stat[stat.find("(") + 1 : stat.rfind(")")]
    if state == "Z":
        return f"pid {pid} (exited, not reaped): {name}"
    if not argv:  # between fork and exec, or a kernel-side name only
        return f"pid {pid}: [{name}]"
    return f"pid {pid}: {' '.join(argv)}"


def _fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def _temp_entries(tmpdir: str, everything: bool) -> set[str]:
    try:
        names = os.listdir(tmpdir)
    except OSError:
        return set()
    if everything:
        # pytest's own tmp_path tree lives there too and is pytest's to manage
        return {n for n in names if not n.startswith("pytest-of-")}
    return {n for n in names if n.startswith(AIOPROC_TEMP_PREFIXES)}


@dataclass(frozen=True)
class Snapshot:
    """What this process had before a test."""

    children: set[int]
    fds: set[int]
    threads: set[threading.Thread]
    tmpdir: str
    temps: set[str]
    all_temps: bool
    groups: frozenset[int]
    handles: int
    """The mark of the open handles: those opened after it are the test's."""

    @classmethod
    def take(cls, all_temps: bool = False) -> Snapshot:
        """Record the current state.

        Args:
            all_temps: count every new entry of ``$TMPDIR``, not only
                aioproc's in this process's temp dir (for a suite whose
                ``TMPDIR`` is its own).  Never any other dir: should
                ``$TMPDIR`` vanish, ``tempfile`` would fall back to the
                system's temp dir, full of other programs' files.

        Raises:
            ValueError: ``all_temps`` without a ``TMPDIR``.
        """
        if all_temps:
            tmpdir = os.environ.get("TMPDIR", "")
            if not tmpdir:
                raise ValueError("counting every new entry of the temp dir needs a TMPDIR")
        else:
            tmpdir = tempfile.gettempdir()
        return cls(
            children=child_pids(),
            fds=open_fds(),
            threads=set(threading.enumerate()),
            tmpdir=tmpdir,
            temps=_temp_entries(tmpdir, all_temps),
            all_temps=all_temps,
            groups=registered_groups(),
            handles=open_handles().mark(),
        )

    def leaks(self) -> list[str]:
        """Describe everything left behind since the snapshot, and remove what can be.

        Returns:
            One line per kind of leak; empty when nothing leaked.
        """
        problems: list[str] = []
        alive, collected = open_handles().since(self.handles)
        named = [_named(h) for h in alive] + [f"{d} (garbage-collected)" for d in collected]
        if named:
            problems.append(
                "aioproc handles never closed (close each with aclose(), or leave its "
                "`async with`): " + "; ".join(named)
            )
        groups = registered_groups() - self.groups
        if groups:
            problems.append(
                "worker processes still running, killed: "
                + "; ".join(
                    f"process group {g} led by {describe_process(g)}" for g in sorted(groups)
                )
            )
        if self.all_temps and not os.path.isdir(self.tmpdir):
            problems.append(
                f"the temp dir {self.tmpdir} ($TMPDIR) is gone: removed by another program? "
                "Nothing in it could be checked"
            )
        temps = _temp_entries(self.tmpdir, self.all_temps) - self.temps
        for name in temps:
            path = os.path.join(self.tmpdir, name)
            shutil.rmtree(path, ignore_errors=True)
            if os.path.lexists(path):
                os.unlink(path)
        guardian = _kill_groups(groups)
        # the workers were named with their groups, and the guardian is aioproc's to reap
        children = child_pids() - self.children - groups - {guardian or 0}
        if children:
            problems.append(
                "child processes left behind: "
                + "; ".join(describe_process(p) for p in sorted(children))
            )
        for pid in children | (child_pids() & groups):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        fds = open_fds() - self.fds
        if fds:
            detail = ", ".join(f"{fd} -> {_fd_target(fd)}" for fd in sorted(fds))
            problems.append(f"file descriptors left open: {detail}")
        threads = [t for t in threading.enumerate() if t not in self.threads]
        # A thread that has done its job may not have returned yet (asyncio's
        # waitpid threads resolve the exit first, then end): give those a
        # moment, bounded, rather than blame them.
        deadline = time.monotonic() + THREAD_GRACE
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        threads = [t for t in threads if t.is_alive()]
        if threads:
            problems.append("threads left running: " + ", ".join(repr(t) for t in threads))
        if temps:
            problems.append(f"left in the temp dir {self.tmpdir}: {sorted(temps)}")
        return problems
