"""Launch ONE worker process and notice its exit without polling or threads.

A worker is started with ``subprocess.Popen`` in its own session (so stop and
kill reach its whole process group) and its exit is noticed through a pidfd
registered with the event loop: readable exactly when the process exits,
independent of its pipes, so a grandchild holding stdout open cannot hide
the exit.  It needs no thread per child, unlike asyncio's default child
watcher on Python < 3.12, which is why workers are not started through
``loop.subprocess_exec``.  Where pidfds are unavailable (non-Linux, old
kernels) one blocking ``waitpid`` thread per worker is the fallback.

Exit statuses are reaped here and only here (``os.waitpid`` on our own pid).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from ._channel import Channel
from ._output import TeeProtocol


class ExitWatcher:
    """Resolves ``future`` with the exit code once the process has exited."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self._loop = asyncio.get_running_loop()
        self.future: asyncio.Future[int] = self._loop.create_future()
        self.exit_time = 0.0
        self._pidfd = -1
        try:
            self._pidfd = os.pidfd_open(popen.pid)
        except (AttributeError, OSError):
            threading.Thread(
                target=self._wait_blocking, name=f"aioproc-waitpid-{popen.pid}", daemon=True
            ).start()
        else:
            self._loop.add_reader(self._pidfd, self._on_pidfd)

    def _on_pidfd(self) -> None:
        try:
            pid, status = os.waitpid(self._popen.pid, os.WNOHANG)
        except ChildProcessError:
            # reaped behind our back (a foreign SIGCHLD handler): exit status lost
            self._set(255)
            return
        if pid != 0:
            self._set(os.waitstatus_to_exitcode(status))

    def _wait_blocking(self) -> None:
        try:
            _, status = os.waitpid(self._popen.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            code = 255
        try:
            self._loop.call_soon_threadsafe(self._set, code)
        except RuntimeError:
            pass  # loop closed; nobody is waiting any more

    def _set(self, code: int) -> None:
        self.exit_time = time.time()
        self._popen.returncode = code
        self.detach()
        if not self.future.done():
            self.future.set_result(code)

    def detach(self) -> None:
        """Stop watching (after exit, or when giving up on an unkillable process)."""
        if self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1


class Child:
    """One running worker: its process, exit watcher, channel and output readers."""

    def __init__(
        self,
        label: str,
        popen: subprocess.Popen[bytes],
        channel: Channel | None,
        tees: list[TeeProtocol],
        tee_transports: list[asyncio.BaseTransport],
    ) -> None:
        self.label = label
        self.popen = popen
        self.pid = popen.pid
        self.pgid = popen.pid  # session leader: its pid names its process group
        self.channel = channel
        self.tees = tees
        self._tee_transports = tee_transports
        self.watcher = ExitWatcher(popen)
        self.forced = False  # needed SIGKILL during shutdown
        self.stop_requested = False  # the supervisor signalled it while it ran

    def __repr__(self) -> str:
        if self.returncode is None:
            state = "running"
        elif self.returncode < 0:
            state = f"killed by {_signame(-self.returncode)}"
        else:
            state = f"exited {self.returncode}"
        return f"<Worker {self.label} pid={self.pid} {state}>"

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the worker's process group; False if the group is gone."""
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            # the group id now belongs to somebody else's processes: never touch them
            return False
        return True

    def group_alive(self) -> bool:
        return self.signal_group(0)

    def output_settled(self) -> list[asyncio.Future[None]]:
        """Futures that resolve when all the worker wrote before exiting was read."""
        futs = [t.settled() for t in self.tees]
        if self.channel is not None:
            futs.append(self.channel.settled())
        return futs

    async def close_streams(self, timeout: float) -> None:
        """Wait up to ``timeout`` for EOF on the output pipes, then cut them."""
        pending = [t.closed for t in self.tees if not t.closed.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        for tr in self._tee_transports:
            tr.close()
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        if self.channel is not None:
            await self.channel.aclose()


_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031 if sys.platform.startswith("linux") else 0)
PIPE_SIZE = 1 << 20
"""Tee pipes are grown to 1 MiB (Linux's default limit for unprivileged users):
a chatty worker then blocks and wakes the supervisor 16x less often."""


def _grow_pipe(fd: int) -> None:
    if not _F_SETPIPE_SZ:
        return
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:
        pass  # over the system's pipe-max-size, or not a pipe: keep the default


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


async def spawn(
    label: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    stdout: int | IO[Any] | None,
    stderr: int | IO[Any] | None,
    stdin: int | None,
    pass_fds: Sequence[int] = (),
    channel: Channel | None = None,
    tee_out: TeeProtocol | None = None,
    tee_err: TeeProtocol | None = None,
) -> Child:
    """Start one worker in a new session and wire up its exit watcher and tees.

    ``stdout``/``stderr`` are ``None`` (inherit), an open file (redirect) or
    ``subprocess.PIPE`` (tee: the matching ``tee_out``/``tee_err`` protocol
    reads it).  Raises what ``Popen`` raises (e.g. FileNotFoundError) with
    nothing left running.
    """
    loop = asyncio.get_running_loop()
    # Popen is what loop.subprocess_exec runs too: fork+exec, about a millisecond
    popen = subprocess.Popen(  # noqa: ASYNC220
        list(argv),
        env=dict(env),
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        pass_fds=tuple(pass_fds),
        start_new_session=True,
        close_fds=True,
    )
    tees: list[TeeProtocol] = []
    transports: list[asyncio.BaseTransport] = []
    try:
        for pipe, proto in ((popen.stdout, tee_out), (popen.stderr, tee_err)):
            if pipe is None or proto is None:
                continue
            _grow_pipe(pipe.fileno())
            transport, _ = await loop.connect_read_pipe(lambda p=proto: p, pipe)  # type: ignore[misc]
            tees.append(proto)
            transports.append(transport)
    except BaseException:
        popen.kill()
        popen.wait()
        for tr in transports:
            tr.close()  # closes its pipe
        for pipe in (popen.stdout, popen.stderr):
            if pipe is None or any(tr.get_extra_info("pipe") is pipe for tr in transports):
                continue
            try:
                pipe.close()
            except OSError:
                # uvloop closes the fd itself when connect_read_pipe is cancelled
                # but leaves the file object open: closed here, not at GC time,
                # when the number may belong to another file
                pass
        raise
    return Child(label, popen, channel, tees, transports)
