"""Job control: Ctrl-Z on ``aioproc run`` stops its workers too, ``fg`` continues them.

The workers lead sessions of their own, so the terminal's SIGTSTP reaches
only the supervisor; it stops them with itself (``aioproc._proc.jobcontrol``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import _LOOP_FACTORIES
from helpers import CHILDREN_DIR, REPO_ROOT, state

import aioproc
from aioproc._proc import jobcontrol as _jobcontrol
from aioproc._proc import lifeline as _lifeline

ROWS_WORKER = os.path.join(CHILDREN_DIR, "rows_worker.py")

# A shell with job control, reduced to what Ctrl-Z needs: it owns the pty,
# runs the command in a process group of its own in the foreground, and says
# "Stopped" when the command stops, as bash does.
_SHELL = """
import fcntl, os, signal, sys, termios
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
pid = os.fork()
if pid == 0:
    os.setpgid(0, 0)
    os.tcsetpgrp(0, os.getpgrp())
    signal.signal(signal.SIGTTOU, signal.SIG_DFL)
    os.execv(sys.argv[1], sys.argv[1:])
try:
    os.setpgid(pid, pid)
except PermissionError:
    pass  # the child has exec'd already, after its own setpgid (bash ignores this too)
print(f"job {pid}", flush=True)
while True:
    _, status = os.waitpid(pid, os.WUNTRACED)
    if os.WIFSTOPPED(status):
        print("[1]+  Stopped", flush=True)
        continue
    sys.exit(os.waitstatus_to_exitcode(status))
"""
pytestmark = [pytest.mark.timeout(60)]


def _workers(pid: int) -> list[int]:
    """The rows workers among ``pid``'s children (not its guardian)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    found = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if ROWS_WORKER.encode() in f.read().split(b"\0"):
                found.append(child)
    return found


def _wait_for(what: str, check: Callable[[], bool], shown: bytearray, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what}; the terminal showed {bytes(shown)!r}"
        )
        time.sleep(0.02)  # another process's state: nothing to wait on


def _rows(out: Path) -> dict[str, int]:
    return {p.name: len(p.read_bytes().splitlines()) for p in sorted(out.glob("*.rows"))}


@pytest.mark.parametrize("loop", list(_LOOP_FACTORIES))
def test_ctrl_z_stops_the_workers_with_the_agent_and_fg_continues_them(
    tmp_path: Path, loop: str
) -> None:
    out = tmp_path / "rows"
    out.mkdir()
    master, slave = pty.openpty()
    env = {**os.environ, "AIOPROC_LOOP": loop, "PYTHONPATH": REPO_ROOT, "TERM": "dumb"}
    argv = [sys.executable, "-m", "aioproc", "run", "--nproc-per-node", "2", "--no-live"]
    argv += ["--log-dir", str(tmp_path / "logs"), ROWS_WORKER, str(out)]
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SHELL, *argv],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
        )
    finally:
        os.close(slave)
    drawn = bytearray()

    def drain() -> None:  # what the terminal shows, so no write ever blocks
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            drawn.extend(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    agent = 0
    try:
        _wait_for("both workers' rows", lambda: len(_rows(out)) == 2, drawn)
        agent = int(bytes(drawn).split(b"job ", 1)[1].split()[0])
        workers = _workers(agent)
        assert len(workers) == 2
        os.write(master, b"\x1a")  # Ctrl-Z: the terminal sends SIGTSTP
        _wait_for("the agent to stop", lambda: state(agent) == "T", drawn)
        _wait_for("the shell to say so", lambda: b"Stopped" in drawn, drawn)
        _wait_for("the workers to stop", lambda: {state(w) for w in workers} == {"T"}, drawn)
        stopped = _rows(out)
        time.sleep(0.5)  # ~25 rows each if they still ran
        assert _rows(out) == stopped
        os.killpg(agent, signal.SIGCONT)  # what `fg` sends
        _wait_for(
            "the rows to grow again",
            lambda: all(n > stopped[name] + 5 for name, n in _rows(out).items()),
            drawn,
        )
        assert state(agent) != "T"
        os.kill(agent, signal.SIGTERM)
        assert proc.wait(20) == 128 + signal.SIGTERM
        assert all(not os.path.exists(f"/proc/{w}") for w in workers)
    finally:
        if proc.poll() is None:
            for pid in (agent, proc.pid):
                if pid:
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
        os.close(master)
        reader.join(5)


async def test_fg_never_continues_a_group_whose_fence_expired_while_stopped() -> None:
    """``fg`` after a stop longer than the fence deadline: the fenced group stays
    stopped for the guardian to kill (its world is stale), the others go on.
    The guardian is told of a long deadline only, so it kills nothing here."""
    fence = _lifeline.Fence()
    groups: list[aioproc.PContext] = []
    try:
        with fence.scope():
            groups.append(await aioproc.start_processes("fenced", "sleep", {0: (60,)}, {0: {}}))
        groups.append(await aioproc.start_processes("free", "sleep", {0: (60,)}, {0: {}}))
        fenced, free = (pc.pids()[0] for pc in groups)
        fence.renew(time.monotonic() + 60)  # what the guardian hears
        assert _lifeline.fenced_out() == frozenset()
        # Ctrl-Z: the agent stops its groups (then itself, left out here)
        _jobcontrol._signal_groups(_lifeline.groups_now(), signal.SIGSTOP)
        for pid in (fenced, free):
            _wait_for(f"{pid} to stop", lambda p=pid: state(p) == "T", bytearray())
        # the stop outlasted the deadline: renewed no more, not told to the guardian
        fence.renew(time.monotonic() - 1, lag=3600)
        assert _lifeline.fenced_out() == {fenced}
        _jobcontrol._on_continue(signal.SIGCONT, None)  # fg
        _wait_for("the free group to go on", lambda: state(free) == "S", bytearray())
        assert state(fenced) == "T"
    finally:
        fence.close()
        for i, pc in enumerate(groups):
            # the fenced group is still stopped: SIGKILL, as its guardian would
            await pc.close(signal.SIGKILL if i == 0 else signal.SIGTERM, timeout=5)
    outcomes = [pc.poll() for pc in groups]
    assert [r.failures[0].signal_name() for r in outcomes if r is not None] == [
        "SIGKILL",
        "SIGTERM",
    ]


# ------------------------------------------------- closing a group of stopped workers

# The handler leaves by os._exit: a SystemExit raised while the interpreter
# finalizes an object (the FIFO's, just written) would be ignored.
ON_TERM = (
    "import os, signal, sys\n"
    "def term(*_):\n"
    "    with open(sys.argv[1], 'a') as f:\n"
    "        f.write('term\\n')\n"
    "    os._exit(0)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "open(sys.argv[2], 'w').write('ready\\n')\n"
    "while True:\n"
    "    signal.pause()\n"
)


def on_term(out: str, fifo: str) -> None:
    """``ON_TERM`` as a function worker: its SIGTERM handler writes a line, then exits."""
    import sys

    sys.argv[1:] = [out, fifo]
    exec(ON_TERM)


def _stopped(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    _wait_for(f"{pid} to stop", lambda: state(pid) == "T", bytearray())


@pytest.mark.parametrize("kind", ["function", "binary"])
@pytest.mark.parametrize("grace", [5.0, None], ids=["grace5", "default"])
async def test_a_stopped_worker_is_continued_and_closed_in_what_it_needs(
    tmp_path: Path, kind: str, grace: float | None
) -> None:
    """A worker stopped (SIGSTOP: a debugger, a suspended job) when its group is
    closed gets SIGCONT right after SIGTERM, as systemd sends it: its handler
    runs at once, and the close takes what the worker needs, not the grace period
    (5 s, or the default 30 s) ending in a SIGKILL."""
    from proc_utils import Fifo

    out = tmp_path / "out"
    kw = {} if grace is None else {"grace_period": grace}
    async with Fifo(tmp_path / "fifo") as fifo:
        if kind == "function":
            entry: Any = on_term
            args: tuple[str, ...] = (str(out), fifo.path)
        else:
            entry, args = sys.executable, ("-c", ON_TERM, str(out), fifo.path)
        with warnings.catch_warnings():
            warnings.simplefilter("error", aioproc.ForcedKillWarning)
            async with aioproc.start_processes(
                "stopped", entry, {0: args}, {0: {}}, sinks=[], **kw
            ) as pc:
                await fifo.lines(1)
                _stopped(pc.pids()[0])
                began = time.monotonic()
            took = time.monotonic() - began  # leaving: SIGTERM, then the grace period
    assert took < (2.5 if grace else 10.0), took
    assert out.read_text() == "term\n"
    result = pc.poll()
    assert result is not None and not result.failures  # its handler exited 0


async def test_a_fenced_groups_stopped_worker_is_never_continued(tmp_path: Path) -> None:
    """Two stopped groups closed together: the one whose lease fence expired is
    never continued (its handler never runs; it is SIGKILLed, stopped, at the end
    of the grace period); the other is continued and stops on its own."""
    from proc_utils import Fifo

    fence = _lifeline.Fence()
    outs = [tmp_path / "fenced", tmp_path / "free"]
    groups: list[aioproc.PContext] = []
    async with Fifo(tmp_path / "fifo") as fifo:
        try:
            for name, out in zip(("fenced", "free"), outs, strict=True):
                with fence.scope() if name == "fenced" else contextlib.nullcontext():
                    groups.append(
                        await aioproc.start_processes(
                            name,
                            sys.executable,
                            {0: ("-c", ON_TERM, str(out), fifo.path)},
                            {0: {}},
                            sinks=[],
                        )
                    )
            await fifo.lines(2)
            fenced, free = (pc.pids()[0] for pc in groups)
            fence.renew(time.monotonic() + 60)  # what the guardian hears
            _stopped(fenced)
            _stopped(free)
            # the lease was lost while they were stopped; the guardian is not told
            fence.renew(time.monotonic() - 1, lag=3600)
            assert _lifeline.fenced_out() == {fenced}
            closing = asyncio.ensure_future(groups[0].close(timeout=1.5))
            await groups[1].close(timeout=1.5)
            assert state(fenced) == "T"  # still stopped, well into its grace period
            with pytest.warns(aioproc.ForcedKillWarning, match=r"fenced/0 \(pid"):
                await closing
        finally:
            fence.close()
            for pc in groups:
                await pc.close(signal.SIGKILL)
    assert (outs[0].exists(), outs[1].read_text()) == (False, "term\n")
    results = [pc.poll() for pc in groups]
    assert results[0] is not None and results[0].failures[0].signal_name() == "SIGKILL"
    assert results[1] is not None and not results[1].failures
