"""Job control: Ctrl-Z on ``aioproc run`` stops its workers too, ``fg`` continues them.

The workers lead sessions of their own, so the terminal's SIGTSTP reaches
only the supervisor; it stops them with itself (``aioproc._proc.jobcontrol``).
"""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

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
