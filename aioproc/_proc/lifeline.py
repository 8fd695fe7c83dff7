"""Kill every worker group when the supervisor dies abruptly (even by SIGKILL).

A worker killed with its supervisor is not enough: its own children live on,
reparented.  So the supervisor process keeps ONE guardian: a tiny ``/bin/sh``
in a session of its own, holding the read end of a pipe whose write end only
the supervisor has.  It reads its script from its stdin, so its command line
is only its title: ``ps`` shows ``aioproc-guardian <supervisor's pid>``.
The supervisor writes ``+PGID`` for every group it
creates, before the worker can run user code, and ``-PGID`` before it reaps
the group's leader (after which the id may be reused by a stranger).  If the
supervisor dies, the kernel closes the pipe, the guardian reads EOF and
SIGKILLs every group it still knows.  When the last group is forgotten the
guardian is dismissed with ``done`` and reaped; the next group starts a new
one (a shell costs about a millisecond).

Registration happens as ``Popen`` returns, but a binary worker already runs
from its ``exec``; in case the supervisor dies in those microseconds, every
worker's environment carries ``AIOPROC_LIFELINE=<tokens>`` (see
``lineage``: the token of this supervisor process after those of the
supervisors it runs under, when it is itself a worker), and on EOF the
guardian also kills every process, and the group of every group leader,
whose environment names the token (a ``grep`` over ``/proc/*/environ``).
Descendants that keep their environment are caught the same way, and so are
the workers of a nested supervisor: an outer sweep reaches them even when
it is faster than the inner guardian.  The inner guardian itself does not
carry the outer token (it is not killed by that sweep), so it still does its
own sweep and tidying.  The sweep is repeated over about 1.5 s (twice at
once, then after 50, 100, 200, 400 and 800 ms): a worker forked but not yet
exec'd when the supervisor died still shows the supervisor's environment,
without the token, and gets it a moment later from ``exec``; so does a fork
racing a sweep.  (A backoff after a crash, never a poll while the
supervisor lives.)  The token reaches the guardian as the first line on its
pipe, never in its argv: other users can read every process's argv.

A ``Fence`` (``fence``) has the guardian SIGKILL groups by itself when a
lease deadline passes unrenewed (``f<id> <seconds left> <groups>``).

A guardian that dies while groups are registered (killed from outside) is
noticed through its pidfd on the loop: a warning is logged and a replacement
takes over every registered group.

The guardian also knows the private temp log dirs of the running groups
(``d/PATH``, sent with the next group's registration): after the sweeps it
removes every empty file and directory under them, what a close would have
pruned, so a SIGKILLed supervisor leaves behind only output and error
files with content.  It knows the groups' cgroups the same way (``c/PATH``)
and removes them once their processes are gone (retried twice, 1 and 3 s
later, for a process the kernel is slow to let go).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import subprocess
import threading
from collections.abc import Iterable, Iterator
from typing import Protocol

from . import fence as _fence
from .exits import ExitWatcher
from .fence import Fence as Fence
from .fence import _fences, _scope
from .fence import fenced_out as fenced_out

logger = logging.getLogger("aioproc")

_SCRIPT = """\
exec 3<&1 >/dev/null
trap '' HUP INT TERM QUIT PIPE
IFS= read -r token <&3 || exit 0
groups=" "
dirs=""
cgroups=""
fences=" "
unfence() {
  eval "t=\\${timer_$1-}"
  if [ -n "$t" ]; then kill -s USR1 "$t" 2>/dev/null; wait "$t" 2>/dev/null; fi
  eval "timer_$1="
}
fence() {
  f=$1; shift
  unfence "$f"
  [ $# -gt 1 ] || return 0
  (
    s= stop=
    trap 'stop=1; [ -z "$s" ] || kill -s KILL "$s" 2>/dev/null' USR1
    sleep "$1" & s=$!
    [ -z "$stop" ] || { kill -s KILL "$s" 2>/dev/null; exit 0; }
    wait "$s" && [ -z "$stop" ] || exit 0
    shift
    for g; do kill -s KILL -- "-$g" 2>/dev/null; done
  ) &
  eval "timer_$f=$!"
  case $fences in *" $f "*) ;; *) fences="$fences$f " ;; esac
}
while IFS= read -r line; do
  case $line in
    done) for f in $fences; do unfence "$f"; done; exit 0 ;;
    -*) g=${line#-}
        case $groups in *" $g "*) groups="${groups%% $g *} ${groups#* $g }" ;; esac ;;
    +*) groups="$groups${line#+} " ;;
    f*) fence ${line#f} ;;
    d/*) dirs="$dirs${line#d}
" ;;
    c/*) cgroups="$cgroups${line#c}
" ;;
  esac
done <&3
for g in $groups; do kill -s KILL -- "-$g" 2>/dev/null; done
for f in $fences; do unfence "$f"; done
for pause in 0 0 0.05 0.1 0.2 0.4 0.8; do
  [ "$pause" = 0 ] || sleep "$pause"
  for e in $(grep -lzE "^AIOPROC_LIFELINE=([^:]*:)*$token(:[^:]*)*\\$" /proc/[0-9]*/environ \\
               2>/dev/null); do
    p=${e#/proc/}; p=${p%/environ}
    kill -s KILL -- "-$p" 2>/dev/null; kill -s KILL "$p" 2>/dev/null
  done
done
printf '%s' "$dirs" | while IFS= read -r d; do
  find "$d" -depth \\( -type f -o -type d \\) -empty -delete 2>/dev/null
done
IFS='
'
for pause in 0 1 3; do
  [ -n "$cgroups" ] || break
  [ "$pause" = 0 ] || sleep "$pause"
  left=""
  for c in $cgroups; do
    rmdir "$c" 2>/dev/null || { [ ! -d "$c" ] || left="$left$c
"; }
  done
  cgroups=$left
done
"""

TOKEN_VAR = "AIOPROC_LIFELINE"
"""Environment variable naming the supervisor whose guardian sweeps a worker."""


class ExitWatcherOwner(Protocol):
    """What ``release`` needs of a worker (``_spawn.Child``)."""

    pgid: int
    watcher: ExitWatcher


SHELL = "/bin/sh"
DISMISS_WAIT = 5.0
"""Seconds a dismissed guardian gets to exit before it is killed."""


def _script_pipe() -> int:
    """The read end of a pipe holding the guardian's whole script (a few KB: the
    pipe's buffer takes it at once), its write end closed."""
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, _SCRIPT.encode())
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return read_fd


def _guardian_env() -> dict[str, str]:
    """What the guardian's shell needs of the environment, and no more.

    Its ``PATH`` (for ``sleep``, ``grep``, ``find``).  Not the lifeline of
    a supervisor that runs this one as a worker: that one's sweep must not
    kill this guardian before it has swept and tidied up after this
    process (every worker here carries that lifeline too, see
    ``lineage``, so the outer sweep finds them all the same).  Nothing
    else: a variable exec refuses (one over the per-string limit, say)
    must not keep the guardian from starting when every rank overrides it.
    """
    return {"PATH": os.environ.get("PATH", os.defpath)}


class _Guardian:
    """One guardian process and the groups it knows."""

    def __init__(self, groups: set[int]) -> None:
        read_fd, self.write_fd = os.pipe()
        script_fd = -1
        try:
            script_fd = _script_pipe()
            # the shell reads its script from stdin and our lines from its
            # stdout (moved to fd 3 first thing): its command line is only
            # its title, which ps shows
            self.popen = subprocess.Popen(
                [f"aioproc-guardian {os.getpid()}"],
                executable=SHELL,
                stdin=script_fd,
                stdout=read_fd,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
                env=_guardian_env(),
            )
        except BaseException:
            os.close(self.write_fd)
            raise
        finally:
            os.close(read_fd)
            if script_fd >= 0:
                os.close(script_fd)
        self.owner = os.getpid()
        self.groups = set(groups)
        self.dismissed = False
        self.watcher = ExitWatcher(self.popen, reap=True)
        self.watcher.future.add_done_callback(self._exited)
        # the token goes first, through the pipe: an argument would be
        # readable by every user of the machine in /proc/<pid>/cmdline
        lines = [f"{token()}\n"]
        lines += [f"+{g}\n" for g in sorted(groups)] + [f"{t}\n" for t in sorted(_tidy)]
        lines += [f.line() for f in _fences.values() if f.groups & self.groups]
        self.tidy = set(_tidy)
        self.write("".join(lines))  # blocking: a new guardian reads at once
        if self.write_fd >= 0:
            os.set_blocking(self.write_fd, False)

    def rewatch(self) -> None:
        self.watcher.detach()
        self.watcher = ExitWatcher(self.popen, reap=True)
        self.watcher.future.add_done_callback(self._exited)

    def write(self, text: str) -> bool:
        if self.write_fd < 0:
            return False
        data = text.encode()
        try:
            written = os.write(self.write_fd, data)
        except BlockingIOError:
            written = 0
        except OSError:
            return False  # guardian gone: _exited replaces it
        if written < len(data):
            # Its pipe is full: the guardian has not read for a long time
            # (stopped, or frozen).  The loop must never block on it, and it
            # missed a line: a replacement takes every group over.
            logger.warning(
                "aioproc's guardian process (pid %d) does not read its pipe (stopped?): "
                "replacing it",
                self.popen.pid,
            )
            self.close_pipe()
            self.popen.kill()  # not reaped yet: the pid is still the guardian's
            return False
        return True

    def close_pipe(self) -> None:
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def _exited(self, fut: asyncio.Future[int]) -> None:
        if self.dismissed or fut.cancelled():
            return
        self.close_pipe()
        _replace(self, fut.result())


_lock = threading.Lock()
_current: _Guardian | None = None
_holds = 0  # forks in flight off the loop (see hold())
_token = ""
_token_pid = 0


def token() -> str:
    """This supervisor process's lifeline token (new after a fork)."""
    global _token, _token_pid
    if _token_pid != os.getpid():
        _token = f"{os.getpid()}-{secrets.token_hex(8)}"
        _token_pid = os.getpid()
    return _token


def lineage() -> str:
    """The value of ``TOKEN_VAR`` for this process's workers.

    This process's token after those of the supervisors above it (when
    this process is itself a worker), separated by colons: the guardian
    of every supervisor up the chain then finds every worker below it,
    so a nested supervisor killed with its parent never leaves its own
    workers behind, whatever the order of the sweeps.
    """
    above = os.environ.get(TOKEN_VAR, "")
    mine = token()
    chain = [t for t in above.split(":") if t and t != mine]
    return ":".join([*chain, mine])


_dismissed: list[_Guardian] = []
# What a guardian tidies after a crash: ``d/PATH`` (a private temp log dir)
# and ``c/PATH`` (a cgroup), see tidy_after_crash and remove_cgroup_after_crash
_tidy: set[str] = set()
if hasattr(os, "register_at_fork"):
    # a forked child's guardian must not tidy its parent's dirs
    os.register_at_fork(after_in_child=_tidy.clear)


def _replace(dead: _Guardian, code: int) -> None:
    global _current
    with _lock:
        if _current is not dead:
            return
        _current = None
        groups = set(dead.groups)
    if not groups:
        return
    logger.warning(
        "aioproc's guardian process (pid %d) died (exit status %d) while %d worker "
        "group(s) were running; starting a new one so they still die with this process",
        dead.popen.pid,
        code,
        len(groups),
    )
    try:
        replacement = _Guardian(groups)
    except OSError as e:  # pragma: no cover - fork failing under memory pressure
        logger.error(
            "could not start a new guardian (%s): worker groups %s would outlive a crash "
            "of this process",
            e,
            sorted(groups),
        )
        return
    with _lock:
        _current = replacement


def _ensure_locked() -> _Guardian:
    global _current
    guardian = _current
    if guardian is not None and guardian.owner != os.getpid():
        guardian = None  # inherited through fork(): not ours to use
    if guardian is None:
        guardian = _current = _Guardian(set())
    elif guardian.watcher.loop is not asyncio.get_running_loop():
        guardian.rewatch()  # its loop is gone: notice its death on this one
    return guardian


def ensure() -> None:
    """Start the guardian if none runs: called before forking a worker, so a
    worker that outruns its registration is still swept by token."""
    with _lock:
        _ensure_locked()


def register(pgid: int) -> None:
    """Tell the guardian about a new process group (before it runs user code).

    Starts the guardian if none is running.  Must be called on the loop.
    Idempotent: a group the guardian knows is not written again (the
    guardian's list must hold each group once, or a ``-PGID`` would leave a
    stale copy behind).
    """
    with _lock:
        guardian = _ensure_locked()
        _add_locked(guardian, pgid)
        fence = _scope.get()
        if fence is not None and fence.id in _fences and pgid not in fence.groups:
            fence.groups.add(pgid)
            guardian.write(fence.line())


def register_from_thread(pgid: int) -> None:
    """``register`` from the thread that forked the group, at once.

    Best effort: if the guardian is being replaced at this moment, nothing
    is written and the loop's ``register`` (which must follow) adds it.  A
    ``hold()`` keeps the guardian from being dismissed meanwhile.
    """
    with _lock:
        guardian = _current
        if guardian is not None and guardian.owner == os.getpid():
            _add_locked(guardian, pgid)


def _add_locked(guardian: _Guardian, pgid: int) -> None:
    if pgid in guardian.groups:
        return
    guardian.groups.add(pgid)
    # temp dirs and cgroups made since the last write go with it: no
    # wake-up of their own
    new = _tidy - guardian.tidy
    guardian.tidy |= new
    if not guardian.write("".join(f"{t}\n" for t in sorted(new)) + f"+{pgid}\n"):
        # died before noticing: the exit watcher starts a replacement that
        # already knows this group
        logger.debug("guardian write failed for group %d; a replacement will take it", pgid)


def tidy_after_crash(path: str) -> None:
    """Have the guardian remove what is empty under ``path`` if this process dies.

    For the private temp log dir of a group, as soon as it is made: written
    at once to a running guardian (``hold()`` one first, so that the dir is
    known before anything is made in it), else sent with the next
    registration.  Paths holding a newline are not sent (the protocol is
    line-based).
    """
    _remember(f"d{path}")


def untidy(path: str) -> None:
    """``path`` was pruned by its group's close: a new guardian need not know it.

    A running guardian keeps it (it removes only what is empty, and the name
    came from ``mkdtemp``): forgetting it would cost a wake-up.
    """
    with _lock:
        _tidy.discard(f"d{path}")


def remove_cgroup_after_crash(path: str) -> None:
    """Have the guardian remove the cgroup ``path`` once its processes are gone, if this
    process dies; sent as ``tidy_after_crash`` sends a dir."""
    _remember(f"c{path}")


def forget_cgroup(path: str) -> None:
    """The cgroup ``path`` was removed: a new guardian need not know it.

    A running guardian keeps it, as ``untidy`` says: its name is unique
    (this process's pid and a random part), and removing a cgroup that is
    gone does nothing.
    """
    with _lock:
        _tidy.discard(f"c{path}")


def _remember(line: str) -> None:
    if "\n" in line or not line[1:].startswith("/"):
        return
    with _lock:
        _tidy.add(line)
        guardian = _current
        if guardian is not None and guardian.owner == os.getpid() and line not in guardian.tidy:
            guardian.tidy.add(line)
            guardian.write(f"{line}\n")


@contextlib.contextmanager
def _locked_guardian() -> Iterator[_Guardian | None]:
    """``_lock`` held, and this process's guardian if one runs: what a ``Fence`` writes to."""
    with _lock:
        guardian = _current
        yield guardian if guardian is not None and guardian.owner == os.getpid() else None


_fence.link(_locked_guardian)


def hold() -> None:
    """Start the guardian if needed and keep it until ``unhold()``, even idle.

    Taken around a fork made off the loop: the guardian must still be there
    when the new group is registered.  Must be called on the loop.
    """
    global _holds
    with _lock:
        _ensure_locked()
        _holds += 1


def unhold() -> None:
    """Drop a ``hold()``; dismisses the guardian if it now guards nothing."""
    global _holds
    with _lock:
        _holds -= 1
    forget()


def forget(*pgids: int) -> None:
    """Forget groups whose leaders are about to be reaped; dismiss an idle guardian.

    Written before the reap, so a guardian that outlives a crash right after
    it never signals the id once it may belong to somebody else.  One write
    for all of them (each write wakes the guardian).  A dismissed guardian
    exits at once; ``settle()`` waits until it is reaped.
    """
    global _current
    with _lock:
        guardian = _current
        if guardian is None or guardian.owner != os.getpid():
            return
        known = [g for g in pgids if g in guardian.groups]
        guardian.groups.difference_update(known)
        if guardian.groups or _holds:
            if known:
                # a fence first lets go of the groups, then the guardian: its
                # timer never holds an id once it may be reused
                text = "".join(f.leave(known) for f in _fences.values())
                guardian.write(text + "".join(f"-{g}\n" for g in known))
            return
        for f in _fences.values():
            f.groups.clear()
        _current = None
        guardian.dismissed = True
        _dismissed.append(guardian)
    guardian.write("done\n")  # forgets everything at once
    guardian.close_pipe()


def release(children: Iterable[ExitWatcherOwner]) -> None:
    """Forget the groups of exited leaders in one write, then reap the leaders."""
    for c in forget_exited(children):
        c.watcher.reap()


def forget_exited(children: Iterable[ExitWatcherOwner]) -> list[ExitWatcherOwner]:
    """Forget the groups of the exited, unreaped leaders in one write; return them to reap.

    Each write wakes the guardian, and a shell takes a while over each
    line: a close forgets all its groups at once and then reaps the leaders
    a batch per loop iteration.
    """
    done = [c for c in children if c.watcher.future.done() and not c.watcher.reaped]
    if done:
        forget(*(c.pgid for c in done))
    return done


async def settle() -> None:
    """Wait until every dismissed guardian has exited and been reaped.

    Cancellation: bounded by ``DISMISS_WAIT`` (then the guardian is
    killed); callers run it inside their shielded cleanup.
    """
    while _dismissed:
        guardian = _dismissed.pop()
        fut = guardian.watcher.future
        if fut.done():
            continue
        if guardian.watcher.loop is not asyncio.get_running_loop():
            # watched by a loop that is gone: it exits at once, reap it here
            guardian.watcher.detach()
            try:
                guardian.popen.wait(DISMISS_WAIT)
            except subprocess.TimeoutExpired:
                guardian.popen.kill()
                guardian.popen.wait()
            continue
        try:
            await asyncio.wait_for(asyncio.shield(fut), DISMISS_WAIT)
        except asyncio.TimeoutError:
            guardian.popen.kill()
            await asyncio.shield(fut)


def current_pid() -> int | None:
    """The guardian's pid, or None when no group is registered (for tests)."""
    with _lock:
        return _current.popen.pid if _current is not None else None


def registered_groups() -> frozenset[int]:
    """Process groups registered and not yet forgotten: groups not closed yet."""
    with _lock:
        guardian = _current
        if guardian is None or guardian.owner != os.getpid():
            return frozenset()
        return frozenset(guardian.groups)


def groups_now() -> frozenset[int]:
    """Registered groups, read without the lock: for signal handlers.

    A signal handler runs between two bytecodes of the main thread, which
    may be holding the lock at that moment.  Copying the set is one step
    for the interpreter, so the copy is consistent.
    """
    guardian = _current
    if guardian is None or guardian.owner != os.getpid():
        return frozenset()
    return frozenset(guardian.groups)


def _after_fork_in_child() -> None:
    # A forked copy of the supervisor must not keep the guardian's pipe open,
    # or the guardian would miss the supervisor's death until the copy exits.
    global _current
    guardian = _current
    _current = None
    if guardian is not None and guardian.write_fd >= 0:
        try:
            os.close(guardian.write_fd)
        except OSError:
            pass
        guardian.write_fd = -1
    _dismissed.clear()
    _fences.clear()
    globals()["_lock"] = threading.Lock()
    globals()["_holds"] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
