"""The supervisor at its edges: one test per way a hostile user broke the core.

Each test attacks the public API (``start_processes``, ``PContext``,
``async with``) the way a service embedding aioproc would meet it: pid reuse,
cancellation and ``close()`` at awkward moments, a helper process that needs
its grace period, ``wait()`` without ``close()``, a killed guardian, a foreign
SIGCHLD reaper.

Pid reuse is forced, not waited for: as root, writing ``N - 1`` to
``/proc/sys/kernel/ns_last_pid`` makes the next fork get pid ``N`` if it is
free.  A "stranger" is an unrelated ``sleep`` in a session of its own, started
by the test on a pid a worker used to have; it must never be signalled.
"""

from __future__ import annotations

import asyncio
import os
import random
import select
import signal
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    CHILDREN_DIR,
    REPO_ROOT,
    child_pids,
    envs,
    import_child,
    loop_name,
    open_fds,
    parent_of,
    release_fifo,
)
from proc_utils import Fifo, still_alive_after

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import soak_cancel
from soak_cancel import (
    clean_up,
    describe,
    fd_target,
    kill_all,
    reported_pids,
    running,
    survivors,
    warm_up,
)

import aioproc
from aioproc import DefaultLogsSpecs, ForcedKillWarning, PContext, Std

FAULT_WORKER = os.path.join(CHILDREN_DIR, "fault_worker.py")
SUPERVISOR = os.path.join(CHILDREN_DIR, "fault_supervisor.py")
SUPERVISOR_ENV = {**os.environ, "PYTHONPATH": REPO_ROOT}
NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"
LIMIT = 20  # seconds: bound on any wait for something that should be quick
SEED = int(os.environ.get("AIOPROC_FAULT_SEED", random.randrange(1 << 30)))
STRANGER_WATCH = 0.5  # seconds a stranger is watched for an unwanted signal


def _can_force_pids() -> bool:
    return os.geteuid() == 0 and os.access(NS_LAST_PID, os.W_OK)


needs_pid_forcing = pytest.mark.skipif(
    not _can_force_pids(),
    reason=f"forcing a pid needs root and a writable {NS_LAST_PID}",
)


def start_stranger_on(pid: int, tries: int = 50) -> subprocess.Popen[bytes] | None:
    """Start an unrelated ``sleep 30`` session leader with pid ``pid``.

    Returns ``None`` if ``pid`` is taken (for instance by a worker aioproc
    keeps unreaped, as it should while it may still signal its group).
    Skips the test if other processes on the machine keep winning the race.
    """
    for _ in range(tries):
        if os.path.exists(f"/proc/{pid}"):
            if parent_of(pid) not in (os.getpid(), 0):
                # reused already by a process of somebody else's (another test
                # process forks meanwhile): no stranger of ours can have it
                pytest.skip(f"pid {pid} was taken first by {holder_of(pid)}")
            return None
        with open(NS_LAST_PID, "w") as f:
            f.write(str(pid - 1))
        stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
        if stranger.pid == pid:
            return stranger
        stranger.kill()
        stranger.wait()
    pytest.skip(f"could not get pid {pid} for a stranger in {tries} tries (a busy machine)")


@pytest.fixture
def strangers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Strangers to kill and reap after the test, whatever happened to them."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for s in started:
        if s.poll() is None:
            s.kill()
        s.wait()


async def stranger_survives(stranger: subprocess.Popen[bytes]) -> bool:
    """True if ``stranger`` is still running ``STRANGER_WATCH`` s from now."""
    return await still_alive_after([stranger.pid], timeout=STRANGER_WATCH) == {stranger.pid}


def holder_of(pid: int) -> str:
    """Who holds ``pid`` now, for messages: e.g. "a zombie child of 1234"."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return "nobody"
    state, ppid = fields[0].decode(), int(fields[1])
    return f"{'a zombie' if state == 'Z' else 'a process'} (state {state}) child of {ppid}"


def children_of(pid: int) -> set[int]:
    found: set[int] = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.update(int(p) for p in f.read().split())
        except FileNotFoundError:
            continue
    return found


@pytest.fixture
def fault_worker(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """``children/fault_worker``, importable by name here and in function workers."""
    return import_child(monkeypatch, "fault_worker")


# ------------------------------------------------------------- pid reuse


@needs_pid_forcing
async def test_close_never_signals_a_stranger_that_took_an_exited_workers_pid(
    strangers: list[subprocess.Popen[bytes]],
) -> None:
    """``close()`` signals a worker's group only while the group is provably the worker's."""
    for _ in range(5):
        pc = await aioproc.start_processes("reuse", "/bin/true", {0: ()}, envs(1))
        try:
            result = await pc.wait(timeout=LIMIT)
            assert result is not None and not result.is_failed()
            pid = pc.pids()[0]
            stranger = start_stranger_on(pid)
            if stranger is None:
                holder = holder_of(pid)
                if holder.endswith(f" child of {os.getpid()}"):
                    # aioproc still holds the pid (the exited leader, unreaped): fine,
                    # and no stranger can be hurt; it must be aioproc's own zombie
                    assert holder == f"a zombie (state Z) child of {os.getpid()}"
                    return
                continue  # another program on the machine took the pid first: again
            strangers.append(stranger)
            await pc.close(timeout=5)
            assert await stranger_survives(stranger), (
                f"close() signalled the process group of pid {pid}, which a stranger "
                f"took after the worker had exited and been reaped "
                f"(stranger's exit status {stranger.poll()})"
            )
            return
        finally:
            await pc.close(timeout=5)
    pytest.skip("other programs took every freed worker pid first (a busy machine)")


@needs_pid_forcing
async def test_guardian_never_kills_a_stranger_that_took_an_exited_workers_pid(
    tmp_path: Path, strangers: list[subprocess.Popen[bytes]]
) -> None:
    """A supervisor SIGKILL makes the guardian kill only groups that are still the workers'."""
    async with Fifo(tmp_path / "status") as status:
        sup = subprocess.Popen(
            [sys.executable, SUPERVISOR, "reuse", loop_name(), status.path],
            stdin=subprocess.DEVNULL,
            env={**SUPERVISOR_ENV, "TMPDIR": str(tmp_path)},  # a SIGKILLed run keeps its logs
        )
        try:
            (line,) = await status.lines(1, timeout=LIMIT)
            word, pid_text = line.split()
            assert word == "exited"
            pid = int(pid_text)
            stranger = start_stranger_on(pid)
            if stranger is not None:
                strangers.append(stranger)
            helpers = children_of(sup.pid)  # the guardian(s), an unreaped worker
        finally:
            sup.kill()
            sup.wait(timeout=10)
    # once the supervisor's helpers have exited, whatever they were to do is done
    assert await still_alive_after(sorted(helpers), timeout=LIMIT) == set()
    if stranger is None:
        return  # the pid stayed the supervisor's until it died: no stranger could take it
    assert await stranger_survives(stranger), (
        f"after the supervisor was SIGKILLed, pid {pid}'s group was killed although a "
        f"stranger had taken the pid after the worker exited "
        f"(stranger's exit status {stranger.poll()})"
    )


# ------------------------------------------- cancelling a start mid-launch


async def test_cancelling_start_at_random_points_kills_whole_groups() -> None:
    """A start cancelled while launching leaves no worker and no grandchild."""
    found = await soak_cancel.soak(
        12,
        SEED,
        phases=("start", "start-await"),
        kinds=("binary",),
        nprocs=8,
    )
    assert found.total() == 0, f"seed {SEED}: {found.summary()}\n" + "\n".join(found.details)


# ------------------------------------------------- close() racing start()


async def test_close_while_start_is_launching_stops_everything_truthfully() -> None:
    """``close()`` during start() stops launching, stops what was launched, and reports
    ranks that never started differently from ranks it killed."""
    seen: dict[int, int] = {}
    launched = 0
    fifth = asyncio.Event()

    def on_event(ev: Any) -> None:  # a WorkerEvent (not exported by aioproc)
        if ev.kind == "started":
            seen[ev.local_rank] = ev.pid
            if len(seen) == 5:
                fifth.set()

    n = 40
    pc = PContext(
        "race",
        "sleep",
        {r: ("1000",) for r in range(n)},
        envs(n),
        DefaultLogsSpecs(),
        on_event=on_event,
    )
    start = asyncio.create_task(pc.start())
    try:
        await asyncio.wait_for(fifth.wait(), LIMIT)
        launched = len(seen)
        await pc.close(timeout=10)  # SIGTERM: `sleep` exits on it at once
        pids = set(seen.values()) | set(pc.pids().values())
        alive_at_close = {p for p in pids if running(p)}
        await asyncio.wait([start], timeout=LIMIT)
        pids = set(seen.values()) | set(pc.pids().values())
        alive_after_start = {p for p in pids if running(p)}
        result = pc.poll()
    finally:
        if not start.done():
            start.cancel()
        await asyncio.wait([start])
        if not start.cancelled():
            start.exception()  # whatever start() says of being closed, it is retrieved
        kill_all(p for p in set(seen.values()) | set(pc.pids().values()) if running(p))
        await pc.close(timeout=5)
    assert alive_at_close == set(), (
        f"{len(alive_at_close)} workers still running when close() returned "
        f"(start() had launched {launched} of {n} when close() was called)"
    )
    assert alive_after_start == set(), (
        f"start() went on launching after close(): {alive_after_start}"
    )
    assert result is not None, "a closed group has a final result"
    killed = {r: f.exitcode for r, f in result.failures.items() if f.exitcode == -signal.SIGKILL}
    assert killed == {}, f"ranks reported as SIGKILLed though close() used SIGTERM: {killed}"
    started = {r for r in seen}
    assert {r: result.failures[r].exitcode for r in started if r in result.failures} == {
        r: -signal.SIGTERM for r in started
    }
    assert all(result.failures[r].stopped for r in started)
    # a rank that never ran was not killed by anything: no signal may be claimed for it
    claimed = {
        r: f.exitcode for r, f in result.failures.items() if r not in started and f.exitcode < 0
    }
    assert claimed == {}, f"ranks that never started are reported as killed by a signal: {claimed}"


@pytest.mark.parametrize("kind", ["binary", "function"])
async def test_close_before_the_log_tree_is_made_launches_nothing(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close() that comes while start() makes the log tree (its first
    await) returns with no worker ever started, leaves no temp dir, and
    start() then returns with every rank reported as never started."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    entrypoint: Any = "sleep" if kind == "binary" else os.getpid
    args = {r: ("1000",) if kind == "binary" else () for r in range(3)}
    before = child_pids()
    for spins in range(1, 5):  # 0: close() before start(), covered elsewhere
        pc = PContext("early", entrypoint, args, envs(3), DefaultLogsSpecs())
        start = asyncio.create_task(pc.start())
        for _ in range(spins):
            await asyncio.sleep(0)
        await pc.close(timeout=5)
        assert pc.pids() == {}, f"{spins} spins: close() let workers start: {pc.pids()}"
        assert child_pids() == before
        assert list(tmp_path.iterdir()) == [], f"{spins} spins: a log tree is left"
        await asyncio.wait_for(start, LIMIT)  # returns: the close is not its failure
        result = pc.poll()
        assert result is not None
        assert result.return_values == {}
        assert {r: (f.pid, f.exitcode, f.stopped) for r, f in result.failures.items()} == {
            r: (-1, 127, True) for r in range(3)
        }
        assert "was never started: the group was closed while it was being launched" in (
            result.failures[0].message
        )
        with pytest.raises(RuntimeError, match="was closed; a PContext can be started once"):
            await pc.start()


async def test_a_cancelled_close_during_the_log_tree_step_still_finishes_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close()`` is shielded from the start: cancelled while start() makes
    the log tree, it re-raises only once the group is closed and gone."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    before = child_pids()
    pc = PContext("early", "sleep", {r: ("1000",) for r in range(3)}, envs(3), DefaultLogsSpecs())
    start = asyncio.create_task(pc.start())
    await asyncio.sleep(0)
    closing = asyncio.create_task(pc.close(timeout=5))
    await asyncio.sleep(0)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert repr(pc).endswith(" closed>"), repr(pc)
    assert pc.pids() == {}
    assert child_pids() == before
    assert list(tmp_path.iterdir()) == []
    await asyncio.wait_for(start, LIMIT)


async def test_concurrent_close_calls_return_only_when_everything_is_stopped(
    tmp_path: Path,
) -> None:
    """A second close() while the first is stopping waits for it, and neither
    returns before every worker has exited."""
    n = 4
    async with Fifo(tmp_path / "fifo") as fifo:
        pc = await aioproc.start_processes(
            "closers",
            sys.executable,
            {r: (FAULT_WORKER, "slow-exit", fifo.path) for r in range(n)},
            envs(n),
        )
        try:
            await fifo.lines(n)
            first = asyncio.create_task(pc.close(timeout=10))
            second = asyncio.create_task(pc.close(timeout=10))
            done, _ = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
            alive = {r: p for r, p in pc.pids().items() if running(p)}
            result = pc.poll()
            which = "first" if first in done else "second"
            await asyncio.gather(first, second)
        finally:
            await pc.close(timeout=10)
    assert alive == {}, f"the {which} close() returned with workers still running: {alive}"
    assert result is not None, f"the {which} close() returned before the result was final"
    # each worker takes 0.5 s to exit on SIGTERM, then exits 0
    assert result.failures == {}
    assert result.return_values == dict.fromkeys(range(n))


# ---------------------------------------------- descendants get the grace


async def test_descendants_of_exited_leaders_get_the_grace_period(tmp_path: Path) -> None:
    """A helper that traps SIGTERM to flush gets the rest of close()'s timeout,
    even though its leader exited at once."""
    done = tmp_path / "flushed"
    helper = 0
    async with Fifo(tmp_path / "fifo") as fifo:
        pc = await aioproc.start_processes(
            "flush",
            sys.executable,
            {0: (FAULT_WORKER, "flush-leader", fifo.path, str(done))},
            envs(1),
        )
        try:
            ((_leader, helper),) = await fifo.pid_pairs(1)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                await pc.close(timeout=10)
        finally:
            await pc.close(timeout=10)
            if helper and running(helper):
                kill_all([helper])
    forced = [str(w.message) for w in caught if issubclass(w.category, ForcedKillWarning)]
    assert forced == []
    assert done.exists(), (
        "the helper was killed before it could flush: it needed 1 s of the 10 s grace"
    )
    assert done.read_text() == "flushed\n"
    assert not running(helper)
    result = pc.poll()
    assert result is not None
    assert result.failures[0].exitcode == -signal.SIGTERM


# ---------------------------------------------------- wait() then no close()


@pytest.mark.parametrize("kind", ["binary", "function"])
async def test_wait_on_a_finished_group_releases_guardian_and_pipes(
    kind: str, tmp_path: Path, fault_worker: types.ModuleType
) -> None:
    """torch closes in ``wait()``: once wait() has the result of a finished group,
    no helper process (guardian) and no pipe of the group is left."""
    await warm_up()  # the loop's own lazily opened fds are not the group's
    entry: Any
    args: dict[int, tuple[Any, ...]]
    if kind == "binary":
        entry, args = "/bin/sh", {0: ("-c", "echo out; echo err >&2")}
    else:
        entry, args = fault_worker.answer, {0: ()}
    lines: list[aioproc.OutputLine] = []
    children_before = child_pids()
    fds_before = open_fds()
    pc = await aioproc.start_processes(
        "finished",
        entry,
        args,
        envs(1),
        DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), tee=Std.ALL),
        sinks=[lines.append],
    )
    try:
        result = await pc.wait(timeout=LIMIT)
        extra_children = {p: describe(p) for p in child_pids() - children_before}
        extra_fds = {fd: fd_target(fd) for fd in open_fds() - fds_before}
    finally:
        await pc.close()
    assert result is not None and not result.is_failed()
    if kind == "binary":
        assert sorted((ln.stream, ln.line) for ln in lines) == [
            ("stderr", "err"),
            ("stdout", "out"),
        ]
    else:
        assert result.return_values == {0: 42}
    assert extra_children == {}, "still running after wait() returned the result"
    assert extra_fds == {}, "still open after wait() returned the result"


async def test_a_started_pcontext_works_as_async_context_manager() -> None:
    """``pc = await start_processes(...)`` then ``async with pc:`` closes it on exit."""
    pc = await aioproc.start_processes("ctx", "sleep", {0: ("1000",), 1: ("1000",)}, envs(2))
    try:
        async with pc as same:
            assert same is pc
            pids = pc.pids()
    finally:
        await pc.close(timeout=5)
    assert not any(running(p) for p in pids.values())
    result = pc.poll()
    assert result is not None
    assert {r: f.exitcode for r, f in result.failures.items()} == {
        0: -signal.SIGTERM,
        1: -signal.SIGTERM,
    }


# --------------------------------------------------------------- smaller edges


async def test_killed_guardian_is_noticed_and_a_supervisor_sigkill_still_kills_workers(
    tmp_path: Path,
) -> None:
    """A guardian killed from outside is noticed and replaced: when the
    supervisor is SIGKILLed later, the workers of the group it was guarding die too."""
    mark = "guardian-" + os.urandom(8).hex()
    report = str(tmp_path / "report")
    async with Fifo(tmp_path / "status") as status:
        sup = subprocess.Popen(
            [sys.executable, SUPERVISOR, "guardian", loop_name(), status.path, report, mark],
            stdin=subprocess.PIPE,
            env={**SUPERVISOR_ENV, "TMPDIR": str(tmp_path)},  # a SIGKILLed run keeps its logs
        )
        assert sup.stdin is not None
        try:
            (line,) = await status.lines(1, timeout=LIMIT)
            word, *pids_a = line.split()
            assert word == "ready-a"
            workers_a = {int(p) for p in pids_a}
            guardians = children_of(sup.pid) - workers_a
            assert guardians, "no guardian found among the supervisor's children"
            kill_all(guardians)
            assert await still_alive_after(sorted(guardians), timeout=LIMIT) == set()
            sup.stdin.write(b"go\n")  # the supervisor starts group B
            sup.stdin.flush()
            (line,) = await status.lines(1, timeout=LIMIT)
            assert line.split()[0] == "ready-b"
        finally:
            sup.kill()
            sup.wait(timeout=10)
            sup.stdin.close()
    alive = await survivors(mark, reported_pids(report) | workers_a)
    await clean_up(mark, alive)
    assert alive == set(), (
        "group A outlived its supervisor after its guardian had been killed: "
        + ", ".join(describe(p) for p in sorted(alive))
    )


# 17b (an unkillable worker): no process SIGKILL cannot end can be made reliably
# here (vfork, FUSE, freezer and core-dump tricks are unavailable or racy), so
# tests/test_shutdown.py simulates one by blinding its exit watcher.


class ForeignReaper:
    """A SIGCHLD handler that reaps every exited child of this process, as some
    libraries do; installed for the ``with`` block, then the old one restored."""

    def __init__(self) -> None:
        self.reaped: dict[int, int] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.reaped[pid] = os.waitstatus_to_exitcode(status)

    def __enter__(self) -> ForeignReaper:
        self._old = signal.signal(signal.SIGCHLD, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGCHLD, self._old)


EXIT_3_ON_RELEASE = 'dd bs=1 count=1 if="$1" of=/dev/null 2>/dev/null; exit 3'


async def _reaped_behind_aiprocs_back(
    tmp_path: Path,
) -> tuple[aioproc.PContext, ForeignReaper, int]:
    """Start a worker that exits 3 when released; release it and let a foreign
    SIGCHLD reaper reap it before aioproc can (the loop is blocked until it exited)."""
    gate = str(tmp_path / "gate")
    with release_fifo(gate) as release:
        pc = await aioproc.start_processes(
            "reaped", "/bin/sh", {0: ("-c", EXIT_3_ON_RELEASE, "w", gate)}, envs(1)
        )
        pid = pc.pids()[0]
        pidfd = os.pidfd_open(pid)
        try:
            with ForeignReaper() as reaper:
                release(1)
                # block the loop until the worker has exited: the handler runs as soon
                # as select() returns, before aioproc's exit watcher gets its turn
                readable, _, _ = select.select([pidfd], [], [], LIMIT)
                assert readable == [pidfd], "the worker did not exit when released"
                if pid not in reaper.reaped:
                    # SIGCHLD may come a moment after the pidfd turned readable
                    # (a loaded host): reap as the handler would have
                    reaper.reaped[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        finally:
            os.close(pidfd)
    return pc, reaper, pid


async def test_foreign_sigchld_reaper_is_explained(tmp_path: Path) -> None:
    """When something else reaped a worker, the failure says so instead of
    passing a made-up status off as the worker's."""
    pc, reaper, pid = await _reaped_behind_aiprocs_back(tmp_path)
    try:
        assert reaper.reaped.get(pid) == 3, "precondition: the foreign reaper got the worker"
        result = await pc.wait(timeout=LIMIT)
    finally:
        await pc.close(timeout=5)
    assert result is not None
    assert result.is_failed(), "a worker whose exit status was lost is not a success"
    failure = result.failures[0]
    assert "reaped" in str(failure.message).lower(), (
        f"the failure does not say the exit status was lost to another reaper: "
        f"exitcode {failure.exitcode}, message {failure.message!r}"
    )


@needs_pid_forcing
async def test_foreign_reaped_worker_pid_is_never_signalled(
    tmp_path: Path, strangers: list[subprocess.Popen[bytes]]
) -> None:
    """A worker reaped by someone else is gone for good: its pid, reused by a
    stranger, is never signalled by aioproc."""
    pc, reaper, pid = await _reaped_behind_aiprocs_back(tmp_path)
    try:
        assert reaper.reaped.get(pid) == 3, "precondition: the foreign reaper got the worker"
        result = await pc.wait(timeout=LIMIT)
        assert result is not None
        stranger = start_stranger_on(pid)
        assert stranger is not None, f"pid {pid} is held by {holder_of(pid)} though reaped"
        strangers.append(stranger)
        await pc.close(timeout=5)
        assert await stranger_survives(stranger), (
            f"aioproc signalled pid {pid}'s group after another reaper had taken the "
            f"worker and a stranger the pid (stranger's exit status {stranger.poll()})"
        )
    finally:
        await pc.close(timeout=5)
