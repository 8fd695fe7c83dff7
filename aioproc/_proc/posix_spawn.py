"""Start one binary worker with ``posix_spawn`` where that keeps Popen's promises.

``subprocess.Popen`` costs the helper thread about 150 us of CPU per worker
before the child even runs: the environment is encoded entry by entry in
Python, an error pipe is made, read and closed, and the GIL is dropped and
taken again a dozen times (each time the loop thread may hold it).
``os.posix_spawn`` does the same work in C (glibc: ``clone(CLONE_VFORK)``
and ``execve``; an exec error comes back as its return value), about 60 us.

What the worker gets must not change, so ``posix_spawn`` is used only when
it can give exactly what ``Popen(..., start_new_session=True,
close_fds=True)`` gives, and ``Popen`` is used otherwise:

- its own session (``setsid``), so its pid names its process group;
- SIGPIPE and SIGXFSZ back at their defaults (Popen's ``restore_signals``);
- no fd beyond 0, 1, 2 survives the exec.  Python opens its fds
  close-on-exec, so only fds made inheritable on purpose (or inherited by
  this process) need closing: with Python >= 3.13 one ``closefrom(3)``
  action; before that, a scan of ``/proc/self/fd`` per batch of workers
  (``Batch``) names them and each gets a close action.  An fd made
  inheritable by another thread while a batch starts can be missed; a
  table of more than ``SCAN_LIMIT`` fds makes the scan too slow, and then
  ``Popen`` is used (its child closes everything itself);
- glibc refuses a file action on an fd at or above the soft
  ``RLIMIT_NOFILE`` (``EBADF``, although nothing is wrong with the fd): an
  fd inherited from a parent that allowed more, or opened before the limit
  was lowered, would make every start fail with a misleading error.  A
  worker whose actions would name such an fd goes through ``Popen``, whose
  child closes and moves fds itself, so a real shortage of fds surfaces as
  ``EMFILE``;
- stdout/stderr: the supervisor's, a redirect file, or a new pipe (tee);
  a worker with ``pass_fds`` goes through ``Popen``;
- an entrypoint without a ``/`` is searched on the PATH of the worker's
  environment, as ``Popen`` does (``posix_spawnp`` would use this
  process's PATH).
"""

from __future__ import annotations

import errno
import fcntl
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any, TypeVar

from .._base.pipes import close_given_ends
from .exits import PidProc

_CLOSEFROM: int | None = getattr(os, "POSIX_SPAWN_CLOSEFROM", None)
_USABLE = hasattr(os, "posix_spawn") and sys.platform.startswith("linux")
_DEFAULT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(signal, name)
)

E = TypeVar("E", bound=BaseException)

SCAN_LIMIT = 256
"""Most open fds scanned per batch; above it the batch (and the next
``SCAN_BACKOFF``) use ``Popen``, which costs the same whatever the table."""

SCAN_BACKOFF = 8

_skip_scans = 0  # batches left that use Popen without scanning (helper thread only)


class Batch:
    """What the workers of one batch share: the fds they must not inherit.

    Made on the helper thread just before the batch starts (see the module
    docstring); ``close`` is None when ``posix_spawn`` cannot be used.
    """

    def __init__(self) -> None:
        global _skip_scans
        self.close: tuple[int, ...] | None = None
        self._paths: dict[tuple[str, str], str | None] = {}
        self.fd_limit = _fd_limit()
        """Fds at or above this cannot be named in a file action (see the module docstring)."""
        if not _USABLE:
            return
        if _CLOSEFROM is not None:
            self.close = ()
            return
        if _skip_scans:
            _skip_scans -= 1
            return
        close = _inheritable_fds()
        if close is None:
            _skip_scans = SCAN_BACKOFF
        elif all(fd < self.fd_limit for fd in close):
            self.close = close

    def resolve(self, name: str, env: Mapping[str, str]) -> str | None:
        """The file ``exec`` would run for ``name`` with ``env``'s PATH (None: not found)."""
        if os.sep in name:
            return name
        path = env.get("PATH", os.defpath)
        key = (name, path)
        if key not in self._paths:
            self._paths[key] = shutil.which(name, path=path)
        return self._paths[key]


def name_fd_limit(error: E) -> E:
    """Make a ``EMFILE``/``ENFILE`` say which limit was reached and how to raise it.

    Changes ``error.strerror`` in place (the type, errno and traceback stay,
    so ``except OSError`` clauses and errno checks keep working) and returns
    ``error``; any other error is returned unchanged.  Idempotent.
    """
    if not isinstance(error, OSError) or "RLIMIT_NOFILE" in str(error.strerror):
        return error
    if error.errno == errno.EMFILE:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            infinite = hard == resource.RLIM_INFINITY
            target = "unlimited" if infinite else str(hard)
            value = "resource.RLIM_INFINITY" if infinite else target
            how = (
                f"raise it (up to the hard limit, {target}): `ulimit -n {target}` in the "
                "shell that starts the supervisor, or resource.setrlimit("
                f"resource.RLIMIT_NOFILE, ({value}, {value})) in it"
            )
        else:
            how = (
                "the hard limit is the same: raise both (LimitNOFILE= of a systemd "
                "unit, nofile in /etc/security/limits.conf, docker run --ulimit nofile=)"
            )
        error.strerror = (
            f"{error.strerror or 'Too many open files'}: this supervisor reached its "
            f"limit of {soft} open fds (RLIMIT_NOFILE); {how}; or start fewer workers "
            "at once (each holds a few fds: its output pipes, channel and exit watch)"
        )
    elif error.errno == errno.ENFILE:
        error.strerror = (
            f"{error.strerror or 'Too many open files in system'}: the kernel's limit "
            "for all processes (fs.file-max; RLIMIT_NOFILE of this process is not the "
            "cause) is reached; raise it with `sysctl fs.file-max=N` or close files elsewhere"
        )
    return error


def _fd_limit() -> int:
    """The soft ``RLIMIT_NOFILE``: glibc's bound on the fds a file action may name."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY and soft >= 0 else 1 << 62


def _inheritable_fds() -> tuple[int, ...] | None:
    """Open fds >= 3 without close-on-exec; None if unknown or over ``SCAN_LIMIT``."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    if len(names) > SCAN_LIMIT:
        return None
    found = []
    for name in names:
        fd = int(name)
        if fd < 3:
            continue
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFD)
        except OSError:
            continue  # the listing's own fd, closed since
        if not flags & fcntl.FD_CLOEXEC:
            found.append(fd)
    return tuple(found)


def exec_binary(
    argv: Sequence[str],
    env: Mapping[str, str],
    stdout: int | IO[Any] | None,
    stderr: int | IO[Any] | None,
    pass_fds: tuple[int, ...],
    batch: Batch,
) -> subprocess.Popen[bytes] | PidProc:
    """Start ``argv`` in a new session, as ``Popen(..., close_fds=True)`` would.

    ``stdout``/``stderr``: ``None`` (this process's), an open file, or
    ``subprocess.PIPE``.  Raises what ``Popen`` raises for a missing or
    non-executable file, with nothing left running.
    """
    actions: list[tuple[int, ...]] = []
    sources = []
    for std, spec in ((1, stdout), (2, stderr)):
        if spec is None or spec == subprocess.PIPE:
            continue
        fd = spec if isinstance(spec, int) else spec.fileno()
        sources.append(fd)
        actions.append((os.POSIX_SPAWN_DUP2, fd, std))
    path = batch.resolve(argv[0], env)
    if (
        batch.close is None
        or pass_fds
        or path is None  # Popen raises the error exec gives
        or any(fd < 3 for fd in sources)  # an fd 1/2 moved about: Popen sorts that out
        or any(fd >= batch.fd_limit for fd in sources)
    ):
        return subprocess.Popen(
            list(argv),
            env=env,
            stdout=stdout,
            stderr=stderr,
            pass_fds=pass_fds,
            start_new_session=True,
            close_fds=True,
        )
    readers: dict[int, IO[bytes]] = {}
    writers: list[int] = []
    try:
        for std, spec in ((1, stdout), (2, stderr)):
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                readers[std] = open(r, "rb")  # noqa: SIM115 - the Child owns it
                writers.append(w)
                actions.append((os.POSIX_SPAWN_DUP2, w, std))
        if _CLOSEFROM is not None:
            actions.append((_CLOSEFROM, 3))
        else:
            actions.extend((os.POSIX_SPAWN_CLOSE, fd) for fd in batch.close)
        pid = os.posix_spawn(
            path, list(argv), env, file_actions=actions, setsid=True, setsigdef=_DEFAULT_SIGNALS
        )
    except BaseException:
        for reader in readers.values():
            reader.close()
        raise
    finally:
        close_given_ends(writers)
    return PidProc(pid, readers.get(1), readers.get(2))
