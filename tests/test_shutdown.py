"""Stopping groups: graceful then forced, descendants, cancellation, no orphans."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest
from helpers import envs, pid_gone
from proc_utils import Fifo, still_alive_after

import aioproc
from aioproc import DefaultLogsSpecs, ForcedKillWarning, Std
from aioproc._proc import lifeline as _lifeline

CHILDREN = Path(__file__).parent / "children"
GRANDCHILD = str(CHILDREN / "grandchild.py")


def blocking_worker(fifo: str) -> None:
    """Function worker: report its pid, then block until signalled."""
    with open(fifo, "w") as f:
        f.write(f"{os.getpid()} 0\n")
    while True:
        signal.pause()


def test_forced_kill_warning_is_public_runtime_warning() -> None:
    assert issubclass(aioproc.ForcedKillWarning, RuntimeWarning)


async def test_close_escalates_to_sigkill_and_names_the_stubborn_worker(tmp_path: Path) -> None:
    async with Fifo(tmp_path / "fifo") as fifo:
        pc = await aioproc.start_processes(
            "stubborn",
            sys.executable,
            {0: (GRANDCHILD, fifo.path, "ignore-term"), 1: (GRANDCHILD, fifo.path, "wait")},
            envs(2),
        )
        pairs = await fifo.pid_pairs(2)
        with pytest.warns(ForcedKillWarning) as record:
            await pc.close(timeout=0.5)
    assert len(record) == 1
    message = str(record[0].message)
    assert f"stubborn/0 (pid {pc.pids()[0]})" in message
    assert "stubborn/1" not in message
    assert "SIGTERM" in message and "SIGKILL" in message
    result = pc.poll()
    assert result is not None
    assert result.failures[0].exitcode == -signal.SIGKILL
    assert result.failures[1].exitcode == -signal.SIGTERM
    assert all(f.stopped for f in result.failures.values())
    assert all(pid_gone(pid) for pid in pc.pids().values())
    # the grandchild of rank 0 inherited SIG_IGN for SIGTERM: only the group SIGKILL ends it
    assert await still_alive_after([g for _, g in pairs], timeout=5) == set()


async def test_close_uses_death_sig() -> None:
    pc = await aioproc.start_processes("sleepers", "sleep", {0: (1000,), 1: (1000,)}, envs(2))
    await pc.close(death_sig=signal.SIGINT, timeout=10)
    result = pc.poll()
    assert result is not None
    assert {r: f.exitcode for r, f in result.failures.items()} == {
        0: -signal.SIGINT,
        1: -signal.SIGINT,
    }
    assert result.failures[0].message == (
        f"Signal {int(signal.SIGINT)} (SIGINT) received by PID {pc.pids()[0]}"
    )


async def test_close_is_idempotent_and_fine_before_start() -> None:
    pc = await aioproc.start_processes("t", "/bin/true", {0: ()}, envs(1))
    await pc.close()
    await pc.close()
    assert pc.poll() is not None
    ctx = aioproc.start_processes("never", "/bin/true", {0: ()}, envs(1))
    async with ctx as started:
        pass
    await started.close()


async def test_close_rejects_bad_death_sig() -> None:
    pc = await aioproc.start_processes("t", "sleep", {0: (1000,)}, envs(1))
    try:
        with pytest.raises(ValueError, match="12345"):
            await pc.close(death_sig=12345)
    finally:
        await pc.close(timeout=5)


async def test_grandchild_left_by_an_exited_worker_is_stopped_on_close(tmp_path: Path) -> None:
    async with Fifo(tmp_path / "fifo") as fifo:
        async with aioproc.start_processes(
            "leaver", sys.executable, {0: (GRANDCHILD, fifo.path, "exit")}, envs(1)
        ) as pc:
            ((worker, grandchild),) = await fifo.pid_pairs(1)
            # the leader's exit alone does not stop what it left in its group
            await asyncio.wait_for(pc._sup.children[0].watcher.future, 10)
            assert await still_alive_after([grandchild], timeout=0.2) == {grandchild}
            # a final result closes the group, as torch's wait() does
            result = await pc.wait()
            assert result is not None and not result.is_failed()
            assert pid_gone(worker)
            assert await still_alive_after([grandchild], timeout=5) == set()


async def test_cancelling_wait_inside_async_with_leaves_nothing(tmp_path: Path) -> None:
    pids: dict[int, int] = {}
    async with Fifo(tmp_path / "fifo") as fifo:

        async def supervise() -> None:
            async with aioproc.start_processes(
                "cancelled", blocking_worker, {r: (fifo.path,) for r in range(3)}, envs(3)
            ) as pc:
                pids.update(pc.pids())
                await pc.wait()

        task = asyncio.create_task(supervise())
        await fifo.lines(3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert len(pids) == 3
    assert all(pid_gone(pid) for pid in pids.values())


async def test_cancelling_a_bare_wait_leaves_the_workers_running(tmp_path: Path) -> None:
    async with Fifo(tmp_path / "fifo") as fifo:
        pc = await aioproc.start_processes(
            "kept", blocking_worker, {r: (fifo.path,) for r in range(2)}, envs(2)
        )
        try:
            await fifo.lines(2)
            with anyio.move_on_after(0.2) as scope:
                await pc.wait()
            assert scope.cancelled_caught
            pids = list(pc.pids().values())
            assert await still_alive_after(pids, 0.5) == set(pids)
            assert pc.poll() is None
            # a later wait() gets the result, once the workers are stopped
            waiting = asyncio.create_task(pc.wait())
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)
            result = await asyncio.wait_for(waiting, 20)
        finally:
            await pc.close(timeout=5)
    assert result is not None
    assert {r: f.exitcode for r, f in result.failures.items()} == {
        0: -signal.SIGUSR1,
        1: -signal.SIGUSR1,
    }
    assert all(pid_gone(pid) for pid in pids)


async def test_a_second_close_with_sigkill_cuts_the_first_ones_grace_short(
    tmp_path: Path,
) -> None:
    async with Fifo(tmp_path / "fifo") as fifo:
        pc = await aioproc.start_processes(
            "deaf",
            sys.executable,
            {r: (GRANDCHILD, fifo.path, "ignore-term") for r in range(2)},
            envs(2),
        )
        try:
            pairs = await fifo.pid_pairs(2)
            with pytest.warns(ForcedKillWarning) as record:
                first = asyncio.create_task(pc.close(timeout=300))
                # the first close has sent its SIGTERM, which they ignore
                await asyncio.sleep(0.3)
                assert not first.done()
                assert pc.poll() is None
                await asyncio.wait_for(pc.close(signal.SIGKILL), 20)
                await asyncio.wait_for(first, 20)  # far within its grace period
        finally:
            await pc.close(signal.SIGKILL)
    assert len(record) == 1
    result = pc.poll()
    assert result is not None
    assert {r: f.exitcode for r, f in result.failures.items()} == {
        0: -signal.SIGKILL,
        1: -signal.SIGKILL,
    }
    assert all(f.stopped for f in result.failures.values())
    assert await still_alive_after([p for pair in pairs for p in pair], timeout=5) == set()


async def test_anyio_cancel_scope_stops_stubborn_workers_within_grace(tmp_path: Path) -> None:
    async with Fifo(tmp_path / "fifo") as fifo:
        with anyio.CancelScope() as scope, pytest.warns(ForcedKillWarning):
            async with aioproc.start_processes(
                "scoped",
                sys.executable,
                {r: (GRANDCHILD, fifo.path, "ignore-term") for r in range(2)},
                envs(2),
                grace_period=0.3,
            ) as pc:
                pairs = await fifo.pid_pairs(2)
                scope.cancel()
                await pc.wait()
    assert scope.cancelled_caught
    assert all(pid_gone(pid) for pid in pc.pids().values())
    assert await still_alive_after([g for _, g in pairs], timeout=5) == set()


async def test_grandchild_holding_stdout_does_not_delay_exit_or_close(tmp_path: Path) -> None:
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), tee=Std.OUT)
    pc = await aioproc.start_processes(
        "holder", "/bin/sh", {0: ("-c", "sleep 30 & echo started")}, envs(1), specs
    )
    try:
        result = await pc.wait(timeout=10)  # the sleep keeps the pipe open for 30 s
        assert result is not None
        assert result.return_values == {0: None}
        with open(result.stdouts[0]) as f:
            assert f.read() == "started\n"
    finally:
        await pc.close(timeout=5)


async def test_exit_detection_uses_no_thread_per_worker(tmp_path: Path) -> None:
    # fork+exec and file work run on one helper thread while a group starts
    # or stops; a running group has no thread of its own, whatever its size
    before = set(threading.enumerate())
    pc = await aioproc.start_processes("many", "sleep", {r: (1000,) for r in range(32)}, envs(32))
    try:
        assert _helpers_gone(before) == before
    finally:
        await pc.close(timeout=5)
    assert _helpers_gone(before) == before


def _helpers_gone(before: set[threading.Thread]) -> set[threading.Thread]:
    """The threads left once the idle helper threads have exited.

    Nothing waits for a released helper thread (a join would hold the
    loop): it exits on its own as soon as its queue is empty.
    """
    for thread in set(threading.enumerate()) - before:
        if thread.name == "aioproc-helper":
            thread.join(5)
    return set(threading.enumerate())


async def test_supervisor_killed_with_sigkill_leaves_no_orphans(tmp_path: Path) -> None:
    async with Fifo(tmp_path / "fifo") as fifo:
        sup = await asyncio.create_subprocess_exec(
            sys.executable,
            str(CHILDREN / "supervisor.py"),
            fifo.path,
            env={**os.environ, "TMPDIR": str(tmp_path)},  # a SIGKILLed run keeps its logs
        )
        try:
            pairs = await fifo.pid_pairs(8)
        finally:
            if sup.returncode is None:
                sup.kill()
            await sup.wait()
        killed_at = time.monotonic()
        pids = [p for pair in pairs for p in pair]
        assert len(set(pids)) == 16
        alive = await still_alive_after(pids, timeout=2.0)
        assert alive == set(), f"alive {time.monotonic() - killed_at:.1f} s after SIGKILL: {alive}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGUSR1])
async def test_signal_stops_workers_with_that_signal(sig: signal.Signals) -> None:
    pc = None
    with pytest.raises(aioproc.SignalException) as info:
        async with aioproc.translate_signals((signal.SIGINT, signal.SIGUSR1)):
            async with aioproc.start_processes(
                "sig", "sleep", {0: (1000,), 1: (1000,)}, envs(2)
            ) as pc:
                asyncio.get_running_loop().call_soon(os.kill, os.getpid(), sig)
                await pc.wait()
    assert info.value.sigval == sig
    assert pc is not None
    result = pc.poll()
    assert result is not None
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: -sig, 1: -sig}
    assert all(pid_gone(pid) for pid in pc.pids().values())


async def test_signal_exception_raised_in_body_stops_workers_with_its_signal() -> None:
    with pytest.raises(aioproc.SignalException):
        async with aioproc.start_processes("sig", "sleep", {0: (1000,)}, envs(1)) as pc:
            raise aioproc.SignalException("stop", signal.SIGINT)
    result = pc.poll()
    assert result is not None
    assert result.failures[0].exitcode == -signal.SIGINT


async def test_unkillable_worker_is_reported_as_running_and_reaped_when_it_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose exit is not seen after SIGKILL (uninterruptible sleep, simulated by
    blinding its exit watcher) is reported truthfully, and reaped once it does exit."""
    import aioproc._proc.shutdown as shutdown

    monkeypatch.setattr(shutdown, "KILL_WAIT", 0.3)
    async with Fifo(tmp_path / "fifo") as fifo:
        pc = await aioproc.start_processes("stuck", blocking_worker, {0: (fifo.path,)}, envs(1))
        try:
            await fifo.lines(1)
            child = pc._sup.children[0]
            child.watcher.detach()  # from now on its exit goes unnoticed
            with pytest.warns(ForcedKillWarning, match="stuck/0"):
                await pc.close(timeout=0.1)
            result = pc.poll()
            assert result is not None
            failure = result.failures[0]
            assert "did not exit after SIGKILL" in str(failure.message)
            assert "will be reaped when it exits" in str(failure.message)
            assert f"worker stuck/0 (pid {child.pid}) survived SIGKILL" in caplog.text
            assert not pid_gone(child.pid)  # a zombie now, kept until its exit is noticed
            # the exit is finally noticed: the late release reaps it
            code = child.watcher._status(block=True)
            assert code in (-signal.SIGTERM, -signal.SIGKILL)
            child.watcher._set(code)
            await asyncio.sleep(0)  # done-callbacks run on the next loop iteration
            assert pid_gone(child.pid)
            await _lifeline.settle()  # the guardian, idle now, was dismissed
            assert _lifeline.current_pid() is None
        finally:
            await pc.close(timeout=1)


# SIGTERM: even ranks write their error file (torch's flat layout), odd ranks
# write none; every rank then exits with 3.
WRITES_ERROR_FILE_ON_TERM = (
    "import json, os, signal, sys\n"
    "rank = int(sys.argv[2])\n"
    "def term(*_):\n"
    "    if rank % 2 == 0:\n"
    "        with open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w') as f:\n"
    "            json.dump({'message': f'rank {rank} was stopped', 'timestamp': 1234}, f)\n"
    "    os._exit(3)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "with open(sys.argv[1], 'w') as f:\n"
    "    f.write(f'{os.getpid()} 0\\n')\n"
    "while True:\n"
    "    signal.pause()\n"
)


PRINTS_ON_TERM = (
    "import os, signal, sys\n"
    "rank = int(sys.argv[2])\n"
    "def term(*_):\n"
    "    sys.stdout.write(''.join(f'rank {rank} line {i}\\n' for i in range(3000)))\n"
    "    sys.stdout.flush()\n"
    "    os._exit(rank % 3)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "with open(sys.argv[1], 'w') as f:\n"
    "    f.write(f'{os.getpid()} 0\\n')\n"
    "if rank < 3:\n"
    "    sys.exit(0)\n"
    "while True:\n"
    "    signal.pause()\n"
)


async def test_close_records_each_exit_once_with_all_its_output(tmp_path: Path) -> None:
    """A close records the exits it causes together: each rank has one "exited"
    event with its own pid and code, every line written on SIGTERM is in its
    file, and the ranks that had exited before the close keep their outcome
    (recorded as they exited)."""
    n = 19
    events: list[aioproc.WorkerEvent] = []
    async with Fifo(tmp_path / "fifo") as fifo:
        pc = await aioproc.start_processes(
            "printers",
            sys.executable,
            {r: ("-c", PRINTS_ON_TERM, fifo.path, str(r)) for r in range(n)},
            envs(n),
            DefaultLogsSpecs(log_dir=tmp_path / "logs", redirects=Std.OUT),
            on_event=events.append,
        )
        try:
            await fifo.pid_pairs(n)  # every handler is installed
            early = [pc.pids()[r] for r in range(3)]
            assert await still_alive_after(early, 10) == set()
            await pc.close(timeout=10)
        finally:
            await pc.close(timeout=1)
    result = pc.poll()
    assert result is not None
    exited = [e for e in events if e.kind == "exited"]
    assert sorted(e.local_rank for e in exited) == list(range(n))
    for e in exited:
        assert e.pid == pc.pids()[e.local_rank]
        assert e.exitcode == (0 if e.local_rank < 3 else e.local_rank % 3)
    succeeded = [r for r in range(n) if r < 3 or r % 3 == 0]
    assert sorted(result.return_values) == succeeded
    assert sorted(result.failures) == sorted(set(range(n)) - set(succeeded))
    for rank, failure in result.failures.items():
        assert (failure.exitcode, failure.stopped) == (rank % 3, True)
    for rank in range(3, n):
        lines = Path(pc.stdouts[rank]).read_text().splitlines()
        assert lines == [f"rank {rank} line {i}" for i in range(3000)]
    assert all(pid_gone(pid) for pid in pc.pids().values())


@pytest.mark.parametrize("layout", ["rank dirs", "temp dir"])
async def test_close_reports_every_error_file_written_on_sigterm(
    tmp_path: Path, layout: str
) -> None:
    """More stopped workers than a close records per loop iteration: each failure
    has its own error file, read in the close's one pass.  Without a log_dir the
    files lie side by side in the temp dir (the close lists it once instead of
    looking for each file) and the prune, done while the exits are recorded,
    keeps exactly the files written."""
    from aioproc._errors import failure as _failure
    from aioproc._supervisor import exits
    from aioproc.errors import ProcessFailure

    n = exits.RECORD_BATCH + 5
    assert n >= _failure.LIST_DIR_FROM
    log_dir = tmp_path / "logs" if layout == "rank dirs" else None
    async with Fifo(tmp_path / "fifo") as fifo:
        pc = await aioproc.start_processes(
            "writers",
            sys.executable,
            {r: ("-c", WRITES_ERROR_FILE_ON_TERM, fifo.path, str(r)) for r in range(n)},
            envs(n),
            DefaultLogsSpecs(log_dir=log_dir),
        )
        try:
            await fifo.pid_pairs(n)  # every handler is installed
            await pc.close(timeout=10)
        finally:
            await pc.close(timeout=1)
    result = pc.poll()
    assert result is not None
    assert sorted(result.failures) == list(range(n))
    for rank, failure in result.failures.items():
        pid = pc.pids()[rank]
        assert (failure.pid, failure.exitcode, failure.stopped) == (pid, 3, True)
        written = pc.error_files[rank]
        if rank % 2 == 0:
            assert failure.error_file == written
            assert failure.message == f"rank {rank} was stopped"
            assert failure.timestamp == 1234
            assert failure.error_file_data == {
                "message": f"rank {rank} was stopped",
                "timestamp": 1234,
            }
        else:
            assert failure.error_file == "<N/A>"
            assert not os.path.exists(written)
        # as a failure built the synchronous way from the same file reports it
        expected = ProcessFailure(rank, pid, 3, written, stopped=True)
        assert (failure.message, failure.error_file, failure.error_file_data) == (
            expected.message,
            expected.error_file,
            expected.error_file_data,
        )
    if log_dir is None:
        attempt = Path(pc.error_files[0]).parent
        written = sorted(f"error_{r}.json" for r in range(0, n, 2))
        assert sorted(p.name for p in attempt.iterdir()) == written
        for r in range(0, n, 2):
            Path(pc.error_files[r]).unlink()
        pc.logs_specs.prune()  # nothing else was left behind
        assert not attempt.parent.parent.exists()
    assert all(pid_gone(pid) for pid in pc.pids().values())


def test_error_files_read_together_as_one_by_one(tmp_path: Path) -> None:
    """A stopped group's error files, read with their dir listed once, come back as
    ``read_error_file`` reads each: absent, empty, with content, a dir of that
    name, in a dir that does not exist, and no path at all."""
    from aioproc._errors import failure
    from aioproc.errors import read_error_file

    flat = tmp_path / "attempt_0"
    flat.mkdir()
    paths = [str(flat / f"error_{r}.json") for r in range(failure.LIST_DIR_FROM + 4)]
    Path(paths[1]).write_text("")
    Path(paths[2]).write_text('{"message": "boom", "timestamp": 7}')
    Path(paths[3]).mkdir()
    paths += [str(tmp_path / "gone" / "error.json"), "", str(tmp_path / "other.json")]
    Path(paths[-1]).write_text('{"message": "alone"}')
    together = failure.read_error_files(paths)
    assert together == [read_error_file(p) for p in paths]
    assert [c is None for c in together] == [
        p not in (paths[1], paths[2], paths[-1]) for p in paths
    ]


async def test_helper_results_reach_the_loop_a_bounded_batch_per_iteration() -> None:
    """A burst of finished helper jobs resumes at most ``Delivery.BATCH`` callers per
    loop iteration, in the order they were submitted, each with its own result."""
    from aioproc._base import offloop as _offloop

    loop = asyncio.get_running_loop()
    n = 5 * _offloop.Delivery.BATCH
    iteration = 0
    counting = True

    def tick() -> None:  # runs once per loop iteration
        nonlocal iteration
        iteration += 1
        if counting:
            loop.call_soon(tick)

    resumed: list[tuple[int, int]] = []

    async def caller(i: int) -> int:
        value = await _offloop.run_blocking(lambda: i * i)
        resumed.append((i, iteration))
        return value

    with _offloop.helper() as pool:
        callers = [asyncio.ensure_future(caller(i)) for i in range(n)]
        await asyncio.sleep(0)  # every caller has submitted its job
        # hold the loop until the helper thread (FIFO) has finished them all:
        # their results are all waiting when the loop next looks
        pool.submit(lambda: None).result(timeout=10)
        loop.call_soon(tick)
        try:
            values = await asyncio.wait_for(asyncio.gather(*callers), 10)
        finally:
            counting = False
    assert values == [i * i for i in range(n)]
    assert [i for i, _ in resumed] == list(range(n))
    per_iteration: dict[int, int] = {}
    for _, at in resumed:
        per_iteration[at] = per_iteration.get(at, 0) + 1
    assert max(per_iteration.values()) <= _offloop.Delivery.BATCH
    assert len(per_iteration) >= n // _offloop.Delivery.BATCH


async def test_run_blocking_raises_what_the_job_raised() -> None:
    from aioproc._base import offloop as _offloop

    def fails() -> None:
        raise PermissionError(13, "Permission denied", "/x")

    with pytest.raises(PermissionError, match=r"\[Errno 13\] Permission denied: '/x'"):
        await _offloop.run_blocking(fails)


async def test_run_blocking_cancelled_finishes_the_job_then_raises() -> None:
    from aioproc._base import offloop as _offloop

    started = threading.Event()
    release = threading.Event()
    finished: list[str] = []

    def job() -> str:
        started.set()
        release.wait(10)
        finished.append("job")
        return "done"

    task = asyncio.ensure_future(_offloop.run_blocking(job))
    await asyncio.to_thread(started.wait, 10)
    task.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()  # the cancellation waits for the job
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == ["job"]


async def test_an_unreadable_error_file_is_reported_with_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The supervisor's read (on its helper thread) fails: the failure says so, and why."""
    from aioproc._child import errorfile as _errorfile

    def denied(name: str, *args: object) -> tuple[bytes, int]:
        raise PermissionError(13, "Permission denied", name)

    monkeypatch.setattr(_errorfile, "read_capped", denied)
    writes_and_fails = (
        "import os, sys\n"
        "with open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w') as f:\n"
        "    f.write('{}')\n"
        "sys.exit(2)\n"
    )
    with pytest.raises(aioproc.ChildFailedError) as info:
        await aioproc.run(
            sys.executable,
            nprocs=1,
            args=("-c", writes_and_fails),
            logs_specs=DefaultLogsSpecs(log_dir=tmp_path / "logs"),
        )
    failure = info.value.failures[0]
    assert failure.exitcode == 2
    assert failure.message == (
        f"Process {failure.pid} exited with code 2; its error file {failure.error_file} "
        "holds no message"
    )
    assert os.path.isfile(failure.error_file)
    assert [r.getMessage() for r in caplog.records if "error file" in r.getMessage()] == [
        f"could not read error file {failure.error_file} of local_rank 0 (pid {failure.pid}): "
        f"[Errno 13] Permission denied: '{failure.error_file}'"
    ]


async def test_group_members_lists_live_descendants_not_the_leader_nor_zombies() -> None:
    """The /proc scan behind close()'s wait for what workers left in their groups."""
    from aioproc._proc.shutdown import group_members

    # a leader in a session of its own with two live children and one zombie
    # (a child it never reaps), and one child that leaves for a group of its own
    script = (
        "import os, subprocess, sys, time\n"
        "live = [subprocess.Popen(['sleep', '30']) for _ in range(2)]\n"
        "zombie = subprocess.Popen(['true'])\n"
        "away = subprocess.Popen(['sleep', '30'], start_new_session=True)\n"
        "while open(f'/proc/{zombie.pid}/stat').read().split(') ')[1][0] != 'Z':\n"
        "    time.sleep(0.01)\n"
        "print(*(p.pid for p in live), zombie.pid, away.pid, flush=True)\n"
        "sys.stdin.read()\n"
        "away.kill()\n"
    )
    import subprocess

    leader = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    live: list[int] = []
    try:
        assert leader.stdout is not None
        *live, zombie, away = map(int, leader.stdout.readline().split())
        members = await group_members([leader.pid])
        assert sorted(members) == sorted(live)
        assert leader.pid not in members and zombie not in members and away not in members
        assert await group_members([]) == []
    finally:
        leader.stdin.close()  # type: ignore[union-attr]
        leader.stdout.close()  # type: ignore[union-attr]
        leader.wait(timeout=10)
        os.killpg(leader.pid, signal.SIGKILL)  # the leader is reaped: its group is the sleeps
        assert await still_alive_after(live, 10) == set()
    assert await group_members([leader.pid]) == []


async def test_batched_calls_made_together_run_in_one_helper_job() -> None:
    """Many exits read their error files in one helper-thread job, not one job each;
    every caller gets its own result or exception."""
    from aioproc._base import offloop as _offloop

    threads: set[int] = set()
    jobs = 0
    drain = _offloop.Batched._drain

    def counting_drain(self: _offloop.Batched[int, int]) -> None:
        nonlocal jobs
        jobs += 1
        drain(self)

    def square(x: int) -> int:
        threads.add(threading.get_ident())
        if x == 3:
            raise ValueError("three")
        return x * x

    batched = _offloop.Batched(square)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_offloop.Batched, "_drain", counting_drain)
        with _offloop.helper() as pool:
            gate = threading.Event()
            pool.submit(gate.wait, 10)  # the helper thread is busy while all queue
            calls = [asyncio.ensure_future(batched(x)) for x in range(20)]
            await asyncio.sleep(0)
            gate.set()
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    assert jobs == 1
    assert threads != {threading.get_ident()} and len(threads) == 1  # off the loop
    assert [r for i, r in enumerate(results) if i != 3] == [x * x for x in range(20) if x != 3]
    assert isinstance(results[3], ValueError) and str(results[3]) == "three"
    assert await batched(5) == 25  # a later burst starts a job of its own


def test_batched_works_in_a_child_forked_while_it_ran() -> None:
    """A process forked while a job ran must not wait for that job, which its
    child does not have."""
    from aioproc._base import offloop as _offloop

    batched = _offloop.Batched(lambda x: x + 1)
    release = threading.Event()
    running = threading.Event()

    def slow(x: int) -> int:
        running.set()
        release.wait(10)
        return x

    slow_batched = _offloop.Batched(slow)

    async def parent() -> None:
        call = asyncio.ensure_future(slow_batched(1))
        await asyncio.to_thread(running.wait, 10)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                release.set()  # this process's copy: the child's own calls return at once
                got = asyncio.run(asyncio.wait_for(slow_batched(41), 5))
                code = 0 if got == 41 and asyncio.run(batched(1)) == 2 else 2
            finally:
                os._exit(code)
        release.set()
        assert await call == 1
        hung = await still_alive_after([pid], 20)
        if hung:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert not hung, "the child's call waited for the parent's job"
        assert os.waitstatus_to_exitcode(status) == 0

    asyncio.run(parent())


async def test_helper_thread_start_and_end_never_wait_on_the_loop() -> None:
    # jobs queue at once, in order, whether or not the thread runs yet; the
    # last release lets the thread go without a join, and it leaves on its own
    from aioproc._base import offloop

    started = threading.Event()
    release = threading.Event()
    with offloop.helper() as pool:
        first = pool.submit(lambda: (started.set(), release.wait(5))[1])
        second = pool.submit(threading.get_ident)
        assert not second.done()
        release.set()
        assert await asyncio.wrap_future(first) is True
        ident = await asyncio.wrap_future(second)
    with offloop.helper() as pool:
        again = await asyncio.wrap_future(pool.submit(threading.get_ident))
    assert started.is_set()
    helpers = [t for t in threading.enumerate() if t.name == "aioproc-helper"]
    for thread in helpers:
        thread.join(5)
        assert not thread.is_alive()
    assert threading.get_ident() not in (ident, again)
