"""Notice a child's exit without polling, and reap it only when told to.

A pidfd registered with the event loop becomes readable exactly when the
process exits, independent of its pipes.  The exit status is then read with
``waitid(..., WNOWAIT)``, which leaves the child an unreaped zombie: its pid,
and so its process group id, cannot be handed to another process until
``reap()``.  The supervisor reaps a worker's leader only after its last
signal to the group, so a group id it signals always names its own worker's
group, never a stranger that was given a recycled pid.

Where pidfds are unavailable (non-Linux, old kernels) one blocking
``waitid`` thread per child is the fallback.

Every reap is an ``os.wait4``, which returns the child's ``struct rusage``
with its status: that is where a worker's ``Usage`` comes from, at no cost
beyond the reap itself.  ``waitid(WNOWAIT)`` reports no rusage, so a
worker's usage is known once it is reaped, not when its exit is noticed.
"""

from __future__ import annotations

import asyncio
import os
import platform
import select
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import IO, Any, Protocol

from .._limits.usage import Usage, usage_from_rusage

LOST = 255
"""Exit code recorded when the status was taken by somebody else's waitpid()."""

_WNOWAIT = getattr(os, "WNOWAIT", 0)


class Proc(Protocol):
    """What is watched: a ``subprocess.Popen``, or a ``PidProc``."""

    pid: int
    returncode: int | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def wait(self) -> int: ...


class PidProc:
    """A child known by its pid and output pipes, started without ``Popen``.

    Binary workers started by ``posix_spawn`` and workers the template forks
    (with this process as their parent) are watched through it.
    """

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = stdout
        self.stderr = stderr
        self.usage: Usage | None = None

    def wait(self) -> int:
        """Block until the worker exits and reap it (only after SIGKILL)."""
        if self.returncode is None:
            _, status, rusage = os.wait4(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
            self.usage = usage_from_rusage(rusage)
        return self.returncode


# The raw waitid system call takes a fifth argument, a struct rusage, which
# the kernel fills for a zombie left unreaped (WNOWAIT) too; the C library's
# waitid and os.waitid have no such argument.  Numbers of the system call on
# the machines that have one; elsewhere a worker's usage comes from its reap.
_WAITID = {"x86_64": 247, "aarch64": 95, "ppc64le": 272, "s390x": 281}
_P_PID = 1


def _zombie_usage(pid: int) -> Usage | None:
    """What the exited, unreaped child ``pid`` used, or None where that cannot be read.

    A worker is reaped only after the group's last signal (its pid names its
    process group until then), so this is how its exit event gets its usage.
    """
    call = _waitid_call()
    if call is None:
        return None
    syscall, rusage_type, number = call
    import ctypes

    siginfo = ctypes.create_string_buffer(128)
    rusage = rusage_type()
    flags = os.WEXITED | os.WNOHANG | _WNOWAIT
    if syscall(number, _P_PID, pid, siginfo, flags, ctypes.byref(rusage)) != 0:
        return None
    return usage_from_rusage(rusage)  # the same field names as resource.struct_rusage


_waitid: tuple[Any, Any, int] | bool | None = False


def _waitid_call() -> tuple[Any, Any, int] | None:
    global _waitid
    if _waitid is False:
        _waitid = None
        number = _WAITID.get(platform.machine()) if sys.platform == "linux" else None
        if number is not None:
            import ctypes

            class Timeval(ctypes.Structure):
                _fields_ = (("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long))

            class Rusage(ctypes.Structure):
                _fields_ = (
                    ("_utime", Timeval),
                    ("_stime", Timeval),
                    *((name, ctypes.c_long) for name in _RUSAGE_LONGS),
                )

                @property
                def ru_utime(self) -> float:
                    return self._utime.tv_sec + self._utime.tv_usec / 1e6  # type: ignore[no-any-return]

                @property
                def ru_stime(self) -> float:
                    return self._stime.tv_sec + self._stime.tv_usec / 1e6  # type: ignore[no-any-return]

            libc = ctypes.CDLL(None, use_errno=True)
            _waitid = (libc.syscall, Rusage, number)
    assert _waitid is not True
    return _waitid


_RUSAGE_LONGS = (
    "ru_maxrss", "ru_ixrss", "ru_idrss", "ru_isrss", "ru_minflt", "ru_majflt", "ru_nswap",
    "ru_inblock", "ru_oublock", "ru_msgsnd", "ru_msgrcv", "ru_nsignals", "ru_nvcsw", "ru_nivcsw",
)  # fmt: skip


class ExitWatcher:
    """Resolves ``future`` with the exit code once the process has exited.

    Args:
        popen: the child.
        reap: reap at once when the exit is noticed (helper processes whose
            pid is never signalled afterwards); otherwise the child stays a
            zombie until ``reap()``.
    """

    def __init__(self, popen: Proc, *, reap: bool = False) -> None:
        self._popen = popen
        self._reap_now = reap
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[int] = self.loop.create_future()
        self.exit_time = 0.0
        self.reaped = False
        self.usage: Usage | None = None
        """What the process used, from its reap (``None`` until then, or if lost)."""
        self.lost = False  # the status was reaped behind our back
        self._pidfd = -1
        self._mux: _ExitMux | None = None
        try:
            self._pidfd = os.pidfd_open(popen.pid)
        except (AttributeError, OSError):
            threading.Thread(
                target=self._wait_blocking, name=f"aioproc-waitpid-{popen.pid}", daemon=True
            ).start()
        else:
            self._mux = _ExitMux.of(self.loop)
            self._mux.add(self._pidfd, self._on_pidfd)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def _status(self, block: bool) -> int | None:
        """The exit code if the child has exited (without reaping unless asked)."""
        if self._reap_now or not _WNOWAIT:
            return self._reap_status(block)
        flags = os.WEXITED | (0 if block else os.WNOHANG) | _WNOWAIT
        try:
            info = os.waitid(os.P_PID, self._popen.pid, flags)
        except ChildProcessError:
            # reaped by someone else (a foreign SIGCHLD handler calling
            # waitpid(-1)): the status is lost and the pid may be reused
            self.lost = self.reaped = True
            return LOST
        if info is None:
            return None
        self.usage = _zombie_usage(self._popen.pid)
        if info.si_code == os.CLD_EXITED:
            return info.si_status
        return -info.si_status

    def _reap_status(self, block: bool) -> int | None:
        """Reap at once (``wait4``, for its rusage); the exit code, or None if running."""
        try:
            pid, status, rusage = os.wait4(self._popen.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            self.lost = self.reaped = True  # as in _status
            return LOST
        if not pid:
            return None
        self.reaped = True
        self.usage = usage_from_rusage(rusage)
        return os.waitstatus_to_exitcode(status)

    def _on_pidfd(self) -> None:
        code = self._status(block=False)
        if code is not None:
            self._set(code)

    def _wait_blocking(self) -> None:
        code = self._status(block=True)
        try:
            self.loop.call_soon_threadsafe(self._set, LOST if code is None else code)
        except RuntimeError:
            pass  # loop closed; nobody is waiting any more

    def _set(self, code: int) -> None:
        self.exit_time = time.time()
        self._popen.returncode = code  # Popen must never waitpid() it itself
        self.detach()
        if not self.future.done():
            self.future.set_result(code)

    def detach(self) -> None:
        """Stop watching (after exit, or when giving up on an unkillable process)."""
        if self._pidfd >= 0:
            assert self._mux is not None
            self._mux.remove(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    def reap(self) -> bool:
        """Collect the zombie; True once the child is reaped (never blocks)."""
        if self.reaped:
            return True
        if not self.future.done():
            return False
        try:
            pid, _, rusage = os.wait4(self._popen.pid, os.WNOHANG)
        except ChildProcessError:
            pid, rusage = self._popen.pid, None
        if pid:
            self.reaped = True
            if rusage is not None:
                self.usage = usage_from_rusage(rusage)
        return self.reaped


class _ExitMux:
    """All of a loop's pidfds in one epoll set, registered with the loop once.

    When hundreds of workers exit together (a group being closed), one
    reader per pidfd would make the loop run every exit's callback in a
    single iteration: tens of milliseconds during which nothing else runs.
    Behind one epoll fd, each iteration handles at most ``BATCH`` exits;
    the set stays readable (level-triggered) and the rest follow in the
    next iterations, with other callbacks in between.  The epoll fd is
    closed as soon as no pidfd is left in it.
    """

    BATCH = 4

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._epoll = select.epoll()
        self._callbacks: dict[int, Callable[[], None]] = {}
        loop.add_reader(self._epoll.fileno(), self._ready)

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _ExitMux:
        mux = _muxes.get(loop)
        if mux is None or mux._epoll.closed:
            mux = _muxes[loop] = cls(loop)
        return mux

    def add(self, fd: int, callback: Callable[[], None]) -> None:
        self._epoll.register(fd, select.EPOLLIN)
        self._callbacks[fd] = callback

    def remove(self, fd: int) -> None:
        if self._callbacks.pop(fd, None) is None:
            return
        try:
            self._epoll.unregister(fd)
        except OSError:
            pass  # closed already
        if not self._callbacks:
            if not self.loop.is_closed():
                self.loop.remove_reader(self._epoll.fileno())
            self._epoll.close()
            if _muxes.get(self.loop) is self:
                del _muxes[self.loop]

    def _ready(self) -> None:
        for fd, _ in self._epoll.poll(0, self.BATCH):
            callback = self._callbacks.get(fd)
            if callback is not None:
                callback()


_muxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _ExitMux] = weakref.WeakKeyDictionary()
