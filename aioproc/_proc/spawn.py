"""Launch worker processes in sessions of their own, known to the guardian first.

A worker is started with ``subprocess.Popen`` in its own session (so stop and
kill reach its whole process group); binary workers are started in batches
(``spawn_binaries``), with ``posix_spawn`` where it gives the same
(``_proc.posix_spawn``).  Its exit is noticed through a pidfd on
the loop (``_proc.exits``), which needs no thread per child, unlike asyncio's
default child watcher on Python < 3.12; that is why workers are not started
through ``loop.subprocess_exec``.

The start runs on the helper thread (``_base.offloop``): it returns only once the
child has exec'd, which on a busy machine held the loop for tens of
milliseconds per worker.

No orphan window: the guardian (``_proc.lifeline``) is told of the new group by
that thread as the start returns, before anything else runs there, and the
loop registers it again (a no-op) when it resumes.  A function worker runs
nothing of the user's until the supervisor sends its boot code over the
channel.  A binary worker runs from its ``exec``, so for
the few microseconds between ``exec`` and registration every worker also
carries the supervisor's lifeline token in its environment, and a guardian
whose supervisor died sweeps the processes carrying it (see ``_proc.lifeline``).

Resource limits: a worker given a ``join`` (a placement's, see ``_limits``)
is put in it on the helper thread right after its start, before the loop
hears of it.  A function worker runs no user code until its boot code is
sent, later; a binary worker has run for the microseconds since its exec
(one with cgroups entered them itself first: ``_group.rank_launcher``; one
pinned to CPUs inherited them from the thread that started it:
``inherited_affinity``).
A worker that cannot be joined is killed and reaped: it must not run
without the limits it was given.

The leader is reaped late (``Child.release``): only after the supervisor's
last signal to its group, never before, so a recycled pid is never signalled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import IO, Any, TypeVar

from .._base.offloop import helper
from .._base.pipes import connect_read_pipe
from .._base.shield import shielded
from .._output.tee import TeeProtocol
from . import lifeline as _lifeline
from . import posix_spawn
from .channel import Channel
from .exits import ExitWatcher, Proc


class Child:
    """One running worker: its process, exit watcher, channel and output readers."""

    def __init__(
        self,
        label: str,
        popen: Proc,
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
        self.watcher.future.add_done_callback(self._exited)
        self.forced = False  # needed SIGKILL during shutdown
        self.stop_requested = False  # the supervisor signalled it while it ran
        self.unkillable = False  # survived SIGKILL; released when it finally exits
        self.swept = False  # its group was SIGKILLed after the leader exited: empty for good
        # started by an exec from this process (not forked by a template): its
        # ru_maxrss then carries this process's peak (see _limits.usage.own_peak)
        self.execed = True

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

    def _exited(self, _: asyncio.Future[int]) -> None:
        if self.watcher.lost:
            # reaped behind our back: the id may be recycled at any moment, so
            # the guardian must forget it now, not at close
            _lifeline.forget(self.pgid)

    @property
    def owns_group(self) -> bool:
        """Whether ``pgid`` provably still names this worker's group (leader unreaped)."""
        return not self.watcher.reaped

    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the worker's process group; False if not ours any more.

        The leader is kept an unreaped zombie until ``release()``, so while
        ``owns_group`` holds, the group id cannot name anybody else.
        """
        if not self.owns_group:
            return False
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def release_output(self) -> None:
        """Let the output readers read: the worker's start has been announced."""
        for tee in self.tees:
            tee.release()

    def abandon(self) -> None:
        """Kill and reap a worker whose start was abandoned, and close its pipes."""
        self.watcher.detach()
        discard(self.popen, self._tee_transports)

    def release(self) -> None:
        """After the last signal to the group: forget it and reap the leader.

        Only once the leader has exited; an unkillable leader is released by
        its exit watcher whenever it finally exits (``release_when_exited``).
        """
        _lifeline.release([self])

    def release_when_exited(self) -> None:
        """Release as soon as the exit is noticed (used for unkillable leftovers)."""
        if self.watcher.future.done():
            self.release()
            return
        _late.add(self)

        def done(_: asyncio.Future[int]) -> None:
            _late.discard(self)
            self.release()

        self.watcher.future.add_done_callback(done)

    def output_settled(self) -> list[asyncio.Future[None]]:
        """Futures that resolve when all the worker wrote before exiting was read."""
        futs = [t.settled() for t in self.tees]
        if self.channel is not None:
            futs.append(self.channel.settled())
        return futs

    def streams_eof(self) -> list[asyncio.Future[None]]:
        """Futures resolved at EOF of each output pipe not yet at its end."""
        return [t.closed for t in self.tees if not t.closed.done()]

    async def close_streams(self, timeout: float) -> None:
        """Wait up to ``timeout`` for EOF on the output pipes, then cut them."""
        pending = self.streams_eof()
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        closing = self.cut_streams()
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        if closing:
            await closing[0]

    def cut_streams(self) -> list[asyncio.Future[None]]:
        """Cut the output pipes and the channel now, without waiting.

        Returns the channel's closed future (none without a channel): it
        resolves in a later loop iteration, once the socket is closed.
        """
        for tr in self._tee_transports:
            tr.close()
        return [self.channel.abort()] if self.channel is not None else []


_late: set[Child] = set()
"""Workers that survived SIGKILL: kept referenced until their exit is noticed."""


_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031 if sys.platform.startswith("linux") else 0)
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032 if sys.platform.startswith("linux") else 0)
PIPE_SIZE = 1 << 20
"""A tee pipe is grown to 1 MiB when the budget allows (see ``_grow_pipe``):
a chatty worker then blocks and wakes the supervisor 16x less often."""

PIPE_BUDGET = 16 << 20
"""Most bytes this process adds to its tee pipes' buffers, summed over live pipes."""

# fd -> ((st_dev, st_ino) of the pipe, bytes added): pipes grown and not yet seen closed
_grown: dict[int, tuple[tuple[int, int], int]] = {}


def _pipe_budget() -> int:
    """This process's share of the user's pipe allowance, in bytes.

    Linux charges pipe buffers to the user: past ``pipe-user-pages-soft``
    pages (default 16384, i.e. 64 MiB) every new pipe of that user, in any
    program, gets a single page.  What other programs of the user hold is not
    visible, so a supervisor takes at most a quarter of the allowance, and
    never more than ``PIPE_BUDGET``.  (Read per launch: a sysctl may change.)
    """
    try:
        with open("/proc/sys/fs/pipe-user-pages-soft") as f:
            soft = int(f.read()) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return PIPE_BUDGET
    return PIPE_BUDGET if soft == 0 else min(PIPE_BUDGET, soft // 4)  # 0: no limit


def _grow_pipe(fd: int) -> None:
    """Grow a tee pipe to ``PIPE_SIZE`` if this process's pipe budget allows.

    Policy: the bytes granted to live pipes are summed; a pipe is grown only
    while the sum stays within ``_pipe_budget()`` (16 of 1 MiB pipes at the
    default limits), later ones keep the kernel's default (64 KiB), which
    is only a little slower.  Closed pipes give their share back: an entry
    whose fd no longer refers to the same pipe (by inode) is forgotten, so
    nothing has to report the close.
    """
    if not _F_SETPIPE_SZ:
        return
    for old_fd, (ident, _) in list(_grown.items()):
        try:
            st = os.fstat(old_fd)
            alive = (st.st_dev, st.st_ino) == ident
        except OSError:
            alive = False
        if not alive:
            del _grown[old_fd]
    try:
        st = os.fstat(fd)
        default = fcntl.fcntl(fd, _F_GETPIPE_SZ)
    except OSError:
        return
    used = sum(size for _, size in _grown.values())
    if used + PIPE_SIZE - default > _pipe_budget():
        return
    try:
        size = fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:
        return  # over the system's pipe-max-size, or not a pipe: keep the default
    _grown[fd] = ((st.st_dev, st.st_ino), size - default)


async def _connect_tees(
    loop: asyncio.AbstractEventLoop,
    popen: Proc,
    tee_out: TeeProtocol | None,
    tee_err: TeeProtocol | None,
    tees: list[TeeProtocol],
    transports: list[asyncio.BaseTransport],
) -> None:
    for pipe, proto in ((popen.stdout, tee_out), (popen.stderr, tee_err)):
        if pipe is None or proto is None:
            continue
        _grow_pipe(pipe.fileno())
        transport = await connect_read_pipe(loop, proto, pipe)
        tees.append(proto)
        transports.append(transport)


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
    join: Callable[[int], None] | None = None,
) -> Child:
    """Start one worker in a new session and wire up its exit watcher and tees.

    ``stdout``/``stderr`` are ``None`` (inherit), an open file (redirect) or
    ``subprocess.PIPE`` (tee: the matching ``tee_out``/``tee_err`` protocol
    reads it).  ``join(pid)``, if given, puts the worker in its placement
    (see the module docstring).  Raises what ``Popen`` raises (e.g.
    FileNotFoundError), or what ``join`` raises, with nothing left running.

    Cancellation: a start cancelled while the pipes are being connected
    kills the worker's whole group and reaps it.
    """

    def start() -> subprocess.Popen[bytes]:
        # Popen is what loop.subprocess_exec runs too: (v)fork+exec, about a
        # millisecond, but it returns only once the child has exec'd, which
        # on a busy machine can take a scheduler slice or more
        try:
            with inherited_affinity(join):
                popen = subprocess.Popen(
                    list(argv),
                    env={**env, _lifeline.TOKEN_VAR: _lifeline.lineage()},
                    stdin=stdin,
                    stdout=stdout,
                    stderr=stderr,
                    pass_fds=tuple(pass_fds),
                    start_new_session=True,
                    close_fds=True,
                )
        except OSError as e:
            posix_spawn.name_fd_limit(e)
            raise
        _lifeline.register_from_thread(popen.pid)  # at once: see the module docstring
        if join is not None:
            joined(join, popen)
        return popen

    popen = await start_off_loop(lambda pool: pool.submit(start), lambda p: p.pid, discard)
    return await adopt(label, popen, channel, tee_out, tee_err)


@dataclass(frozen=True)
class BinaryStart:
    """How to start one binary worker (see ``spawn_binaries``).

    ``stdout``/``stderr`` as for ``spawn``; ``env`` is the worker's whole
    environment (the lifeline token is added at the start).
    """

    argv: list[str]
    env: Mapping[str, str]
    stdout: int | IO[Any] | None
    stderr: int | IO[Any] | None
    join: Callable[[int], None] | None = None
    """Puts the started worker in its placement (see the module docstring)."""


async def spawn_binaries(
    starts: Sequence[BinaryStart], pass_fds: Sequence[int] = ()
) -> tuple[list[Proc], Exception | None]:
    """Start binary workers in their own sessions, in order, in one helper job.

    One job for the batch: the helper thread and the loop hand over once per
    batch, not once per worker.  Each worker is registered with the guardian
    as it starts (see ``start_off_loop``).  Stops at the first start that
    fails: returns the workers started before it, still to be adopted (see
    ``adopt``), and that error, whose worker left nothing behind.

    Cancellation: the batch runs to completion; its workers are then killed
    and reaped before the cancellation propagates.
    """
    token = _lifeline.lineage()
    keep = tuple(pass_fds)

    def start_all() -> tuple[list[Proc], Exception | None]:
        procs: list[Proc] = []
        batch = posix_spawn.Batch()
        for start in starts:
            env = {**start.env, _lifeline.TOKEN_VAR: token}
            try:
                with inherited_affinity(start.join):
                    proc = posix_spawn.exec_binary(
                        start.argv, env, start.stdout, start.stderr, keep, batch
                    )
            except Exception as e:
                return procs, posix_spawn.name_fd_limit(e)
            _lifeline.register_from_thread(proc.pid)  # at once: see the module docstring
            if start.join is not None:
                try:
                    joined(start.join, proc)
                except Exception as e:
                    return procs, e
            procs.append(proc)
        return procs, None

    def discard_all(started: tuple[list[Proc], Exception | None]) -> None:
        for proc in started[0]:
            discard(proc)

    return await start_off_loop(
        lambda pool: pool.submit(start_all), lambda s: [p.pid for p in s[0]], discard_all
    )


@contextlib.contextmanager
def inherited_affinity(join: Callable[[int], None] | None) -> Iterator[None]:
    """This thread on the CPUs ``join`` pins to (if it pins), while a child starts.

    A child inherits its parent thread's CPU set at the fork: a binary then
    runs on its CPUs from its first instruction, where the join after the
    start would pin it only once its program had run a while (the helper
    thread, not the loop, starts workers: the loop's thread keeps its set).
    A set the kernel refuses here is left to the join to report.
    """
    cpus = getattr(join, "cpus", None)
    if not cpus:
        yield
        return
    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def joined(join: Callable[[int], None], proc: Proc) -> None:
    """``join(proc.pid)``, or kill and reap ``proc`` and raise: no worker runs unlimited."""
    try:
        join(proc.pid)
    except BaseException:
        discard(proc)
        raise


T = TypeVar("T")


async def start_off_loop(
    submit: Callable[[Executor], concurrent.futures.Future[T]],
    pid_of: Callable[[T], int | Sequence[int]],
    discard: Callable[[T], None],
) -> T:
    """Start a worker on the helper thread: ``submit(pool)`` queues the start there.

    The start (a fork and exec, or a template's fork) registers the new
    group with the guardian itself, as it returns
    (``_lifeline.register_from_thread``); the guardian is held meanwhile,
    and the loop registers again on return (a no-op unless the guardian was
    being replaced).

    Cancellation: the start runs to completion; a worker it started after
    the caller was cancelled is passed to ``discard`` (killed and reaped)
    before the cancellation propagates.
    """
    _lifeline.hold()
    try:
        with helper() as pool:
            starting = asyncio.wrap_future(submit(pool))
            try:
                started = await shielded(starting)
            except asyncio.CancelledError:
                if starting.done() and not starting.cancelled() and not starting.exception():
                    discard(starting.result())  # started after all: not ours to keep
                raise
        pids = pid_of(started)
        for pid in [pids] if isinstance(pids, int) else pids:
            _lifeline.register(pid)
    finally:
        _lifeline.unhold()  # dismisses the guardian if the start failed and it is idle
    return started


async def adopt(
    label: str,
    popen: Proc,
    channel: Channel | None,
    tee_out: TeeProtocol | None,
    tee_err: TeeProtocol | None,
    *,
    hold: bool = False,
) -> Child:
    """Wire up a just-started, already registered worker (spawned or forked).

    The output readers start reading once the caller's current step is over,
    so that whatever the caller does with the returned worker before its
    next ``await`` (announcing its start) comes before the sinks see any of
    its output; with ``hold`` they wait for ``Child.release_output()``.

    Raises what connecting its pipes raises, after killing its group.

    Cancellation: a start cancelled while the pipes are being connected
    kills the worker's whole group and reaps it.
    """
    loop = asyncio.get_running_loop()
    tees: list[TeeProtocol] = []
    transports: list[asyncio.BaseTransport] = []
    child: Child | None = None
    try:
        # shielded: a cancellation inside connect_read_pipe could leave a
        # transport registered with the loop that nobody can close
        if tee_out is not None or tee_err is not None:
            for tee in (tee_out, tee_err):
                if tee is not None:
                    tee.hold()
            await shielded(_connect_tees(loop, popen, tee_out, tee_err, tees, transports))
        child = Child(label, popen, channel, tees, transports)
    except BaseException:
        if child is not None:
            child.watcher.detach()
        discard(popen, transports)
        raise
    if tees and not hold:
        loop.call_soon(child.release_output)
    return child


def discard(popen: Proc, transports: Sequence[asyncio.BaseTransport] = ()) -> None:
    """Kill and reap a worker whose start was abandoned, and close its pipes."""
    try:
        os.killpg(popen.pid, signal.SIGKILL)  # the leader is unreaped: still ours
    except ProcessLookupError:
        pass
    popen.wait()  # SIGKILLed: exits at once
    _lifeline.forget(popen.pid)
    for tr in transports:
        tr.close()  # stops reading (its pipe is closed with it)
    for pipe in (popen.stdout, popen.stderr):
        if pipe is not None:
            pipe.close()  # one never connected; a no-op for the others
