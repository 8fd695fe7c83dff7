"""Binary workers started in batches, by ``posix_spawn`` where it keeps Popen's promises."""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path
from typing import Any

import pytest
from helpers import aioproc_temp_dirs, child_pids, pid_gone, write_file

import aioproc
from aioproc import DefaultLogsSpecs, Std
from aioproc._base import pipes as _pipes
from aioproc._group import rankdirs as _rankdirs
from aioproc._proc import lifeline as _lifeline
from aioproc._proc import posix_spawn
from aioproc._proc.spawn import BinaryStart, discard, spawn_binaries

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import soak_cancel

SEED = int(os.environ.get("AIOPROC_FAULT_SEED", random.randrange(1 << 30)))

# what a worker reports about itself: session, group, pid, cwd, fds beyond 0-2
REPORT = """
import errno
import logging
import os
fds = {}
for f in os.listdir("/proc/self/fd"):
    try:
        fds[int(f)] = os.readlink(f"/proc/self/fd/{f}")
    except OSError:
        pass  # the listing's own fd
print(os.getsid(0), os.getpgid(0), os.getpid())
print(os.getcwd())
print(sorted(t for f, t in fds.items() if f > 2 and not t.startswith("/proc/")))
"""


def _refuse_popen(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("binary worker started with Popen, not posix_spawn")


@pytest.fixture
def no_popen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any binary start that falls back to ``Popen`` fail the test."""
    fake = types.SimpleNamespace(PIPE=subprocess.PIPE, Popen=_refuse_popen)
    monkeypatch.setattr(posix_spawn, "subprocess", fake)
    monkeypatch.setattr(posix_spawn, "_skip_scans", 0)  # no back-off left by another test


def pipe_target(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.mark.parametrize("how", ["posix_spawn", "popen"])
async def test_binary_workers_lead_sessions_and_inherit_no_stray_fd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setattr(posix_spawn, "_skip_scans", 0)  # no back-off left by another test
    if how == "popen":
        monkeypatch.setattr(posix_spawn, "SCAN_LIMIT", 0)  # too many fds to scan: Popen
    else:
        fake = types.SimpleNamespace(PIPE=subprocess.PIPE, Popen=_refuse_popen)
        monkeypatch.setattr(posix_spawn, "subprocess", fake)
    r, w = os.pipe()
    os.set_inheritable(w, True)  # as a C library or an os.dup2() leaves an fd
    inherited = pipe_target(w)
    monkeypatch.chdir(tmp_path)
    n = 20  # more than one batch
    try:
        async with aioproc.start_processes(
            "report",
            sys.executable,
            {rank: ("-c", REPORT) for rank in range(n)},
            {rank: {} for rank in range(n)},
            DefaultLogsSpecs(tmp_path / "logs", redirects=Std.OUT),
        ) as pc:
            result = await pc.wait()
            pids = pc.pids()
    finally:
        os.close(r)
        os.close(w)
    assert result is not None and not result.failures
    for rank in range(n):
        ids, cwd, fds = Path(result.stdouts[rank]).read_text().splitlines()
        sid, pgid, pid = ids.split()
        assert sid == pgid == pid == str(pids[rank])
        assert cwd == str(tmp_path)
        assert inherited not in fds
        assert fds == "[]"


async def test_signals_the_supervisor_ignores_are_at_their_defaults(
    tmp_path: Path, no_popen: None
) -> None:
    # Python ignores SIGPIPE and SIGXFSZ; a worker must not inherit that
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
    async with aioproc.start_processes(
        "sigs",
        "/bin/sh",
        {0: ("-c", "exec grep SigIgn /proc/self/status")},
        {0: {}},
        DefaultLogsSpecs(tmp_path, redirects=Std.OUT),
    ) as pc:
        result = await pc.wait()
    assert result is not None and not result.failures
    (line,) = Path(result.stdouts[0]).read_text().splitlines()
    ignored = int(line.split()[1], 16)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        assert not ignored & (1 << (sig - 1)), f"{sig.name} ignored in the worker: {line}"


async def test_entrypoint_is_searched_on_the_rank_path_and_keeps_its_name(
    tmp_path: Path, no_popen: None
) -> None:
    # the same name is a different program on each rank's PATH
    for sub, target in (("a", "/bin/cat"), ("b", "/bin/echo")):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "aioproc-tool").symlink_to(target)
    async with aioproc.start_processes(
        "tool",
        "aioproc-tool",
        {0: ("/proc/self/cmdline",), 1: ("hello",)},
        {0: {"PATH": str(tmp_path / "a")}, 1: {"PATH": str(tmp_path / "b")}},
        DefaultLogsSpecs(tmp_path / "logs", redirects=Std.OUT),
    ) as pc:
        result = await pc.wait()
    assert result is not None and not result.failures
    assert Path(result.stdouts[0]).read_bytes() == b"aioproc-tool\0/proc/self/cmdline\0"
    assert Path(result.stdouts[1]).read_text() == "hello\n"


async def test_tee_pipes_of_posix_spawned_workers_deliver_every_line(
    tmp_path: Path, no_popen: None
) -> None:
    lines: list[tuple[int, str, str]] = []
    n = 18
    async with aioproc.start_processes(
        "tee",
        "/bin/sh",
        {
            r: (
                "-c",
                f"i=0; while [ $i -lt 50 ]; do echo out{r}-$i; echo err{r}-$i >&2; "
                "i=$((i+1)); done",
            )
            for r in range(n)
        },
        {r: {} for r in range(n)},
        DefaultLogsSpecs(tmp_path, tee=Std.ALL),
        sinks=[lambda line: lines.append((line.rank, line.stream, line.line))],
    ) as pc:
        result = await pc.wait()
    assert result is not None and not result.failures
    for r in range(n):
        for stream, tag in (("stdout", "out"), ("stderr", "err")):
            got = [text for rank, s, text in lines if rank == r and s == stream]
            assert got == [f"{tag}{r}-{i}" for i in range(50)]
        assert Path(result.stdouts[r]).read_text() == "".join(f"out{r}-{i}\n" for i in range(50))


@pytest.mark.parametrize("kind", ["binary", "forked function"])
async def test_a_given_fd_closed_behind_our_back_loses_no_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """Another part of the process closes the write ends aioproc handed to the
    workers before aioproc does: the workers still start, their output still
    arrives, the error names the fd, and close() leaves no worker behind."""
    real_close = os.close
    closed: list[int] = []

    def closed_first(fd: int) -> None:
        real_close(fd)  # what the other part did
        closed.append(fd)
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    monkeypatch.setattr(_pipes, "os", types.SimpleNamespace(close=closed_first, dup=os.dup))
    n = 4
    lines: list[tuple[int, str]] = []
    if kind == "binary":
        entry: Any = "/bin/echo"
        args: dict[int, tuple[Any, ...]] = {r: (f"out-{r}",) for r in range(n)}
        method = "spawn"
    else:
        entry, args, method = print, {r: (f"out-{r}",) for r in range(n)}, "forkserver"
    with caplog.at_level(logging.ERROR, logger="aioproc"):
        async with aioproc.start_processes(
            "w",
            entry,
            args,
            {r: {} for r in range(n)},
            DefaultLogsSpecs(tmp_path, tee=Std.OUT),
            sinks=[lambda line: lines.append((line.rank, line.line))],
            start_method=method,
        ) as pc:
            result = await pc.wait()
            pids = list(pc.pids().values())
    assert result is not None and not result.failures
    assert sorted(lines) == [(r, f"out-{r}") for r in range(n)]
    assert len(closed) >= n, closed
    assert f"fd {closed[0]}, handed to a worker at its start, was closed by another part" in (
        caplog.text
    )
    for pid in pids:
        assert pid_gone(pid)


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda d: str(d / "missing"), FileNotFoundError),
        (lambda d: write_file(str(d / "plain"), "#!/bin/sh\n", 0o644), PermissionError),
        (lambda d: str(d), PermissionError),
    ],
    ids=["missing", "not-executable", "directory"],
)
def test_exec_errors_name_the_file_and_leave_nothing(
    tmp_path: Path, make: Any, error: type[OSError], no_popen: None
) -> None:
    path = make(tmp_path)
    fds_before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(error) as info:
        posix_spawn.exec_binary(
            [path], dict(os.environ), subprocess.PIPE, subprocess.PIPE, (), posix_spawn.Batch()
        )
    assert info.value.filename == path
    assert child_pids() == set()
    assert sorted(os.listdir("/proc/self/fd")) == fds_before  # its pipes were closed


async def test_a_failed_start_stops_its_batch_and_keeps_the_started_ones(
    tmp_path: Path, no_popen: None
) -> None:
    plain = write_file(str(tmp_path / "plain"), "#!/bin/sh\n", 0o644)
    env = dict(os.environ)
    starts = [
        BinaryStart(["/bin/sleep", "1000"], env, None, None),
        BinaryStart([plain], env, None, None),
        BinaryStart(["/bin/sleep", "1000"], env, None, None),
    ]
    procs, error = await spawn_binaries(starts)
    try:
        assert isinstance(error, PermissionError) and error.filename == plain
        guardian = _lifeline.current_pid()
        assert {p.pid for p in procs} == child_pids() - {guardian}  # the first one only
        assert len(procs) == 1
        assert _lifeline.registered_groups() == {procs[0].pid}
    finally:
        for proc in procs:
            discard(proc)
    assert pid_gone(procs[0].pid)
    assert _lifeline.registered_groups() == frozenset()
    await _lifeline.settle()


async def test_a_binary_group_whose_entrypoint_vanishes_raises_and_leaves_nothing(
    tmp_path: Path, no_popen: None
) -> None:
    tool = write_file(str(tmp_path / "tool"), "#!/bin/sh\nexec sleep 1000\n", 0o755)
    real = posix_spawn.exec_binary
    started = 0

    def vanishing(*args: Any) -> Any:
        nonlocal started
        started += 1
        if started == 21:
            os.unlink(tool)  # after the checks, in the middle of the second batch
        return real(*args)

    pc = aioproc.PContext(
        "gone",
        tool,
        {r: () for r in range(40)},
        {r: {} for r in range(40)},
        DefaultLogsSpecs(tmp_path / "logs"),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(posix_spawn, "exec_binary", vanishing)
        with pytest.raises(FileNotFoundError) as info:
            await pc.start()
    assert info.value.filename == tool
    assert child_pids() == set()
    assert _lifeline.registered_groups() == frozenset()
    result = pc.poll()
    assert result is not None
    assert len(result.failures) == 40  # 20 killed, 20 never started


async def test_cancelling_a_start_of_several_batches_leaves_nothing() -> None:
    found = await soak_cancel.soak(
        6, SEED, phases=("start", "start-await"), kinds=("binary",), nprocs=40
    )
    assert found.total() == 0, f"seed {SEED}: {found.summary()}\n" + "\n".join(found.details)


async def test_rank_dirs_exist_before_each_worker_starts_and_their_thread_goes(
    tmp_path: Path, no_popen: None
) -> None:
    # each worker writes its error file into its rank dir, made during the launch
    n = 40  # three batches
    code = 'echo "{\\"rank\\": $LOCAL_RANK}" > "$TORCHELASTIC_ERROR_FILE"'
    async with aioproc.start_processes(
        "dirs",
        "/bin/sh",
        {r: ("-c", code) for r in range(n)},
        {r: {"LOCAL_RANK": str(r)} for r in range(n)},
        DefaultLogsSpecs(tmp_path),
    ) as pc:
        assert not [t for t in threading.enumerate() if t.name.startswith("aioproc-dirs")]
        result = await pc.wait()
    assert result is not None and not result.failures
    for r in range(n):
        assert Path(pc.error_files[r]).read_text() == f'{{"rank": {r}}}\n'


async def test_a_rank_dir_that_cannot_be_made_fails_the_start_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, no_popen: None
) -> None:
    made: list[str] = []

    def make_dirs(paths: list[str]) -> None:
        if len(made) > 1:  # the third batch (rank 0 goes alone, then 1-16)
            raise OSError(28, "No space left on device", paths[0])
        for path in paths:
            os.mkdir(path)
            made.append(path)

    monkeypatch.setattr(_rankdirs, "_make_dirs", make_dirs)
    temp_before = aioproc_temp_dirs(tempfile.gettempdir())
    pc = aioproc.PContext(
        "nospace",
        "/bin/sleep",
        {r: ("1000",) for r in range(40)},
        {r: {} for r in range(40)},
        DefaultLogsSpecs(redirects=Std.OUT),  # a rank dir each, for its stdout.log
    )
    with pytest.raises(OSError, match="No space left on device") as info:
        await pc.start()
    assert info.value.filename == os.path.join(os.path.dirname(made[0]), "17")
    assert len(made) == 17
    assert child_pids() == set()
    assert _lifeline.registered_groups() == frozenset()
    assert not [t for t in threading.enumerate() if t.name.startswith("aioproc-dirs")]
    assert aioproc_temp_dirs(tempfile.gettempdir()) == temp_before  # pruned
    result = pc.poll()
    assert result is not None
    assert len(result.failures) == 40  # 17 killed, 23 never started
