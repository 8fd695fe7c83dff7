"""Failures point at the evidence, and nothing litters.

A failed group's summary names the failing rank's log files and the run's
log dir; a run without ``log_dir`` leaves its private temp dir only when it
holds something the user may need (then the result or the summary names
it); ``log_dir=os.devnull`` writes no files but still feeds the sinks, and a
failing function worker's summary shows its own exception.

The suite runs with a ``$TMPDIR`` of its own that the leak check in
``conftest.py`` inspects after every test, so a test here that leaves a temp
dir behind fails; the tests that keep one on purpose remove it themselves.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import aioproc
from aioproc import ChildFailedError, DefaultLogsSpecs, OutputLine, Std


def shout_or_fail(rank: int) -> int:
    print(f"out of rank {rank}", flush=True)
    print(f"err of rank {rank}", file=sys.stderr, flush=True)
    if rank == 1:
        raise ValueError(f"rank {rank} refuses")
    return rank


def args(n: int) -> dict[int, tuple[int]]:
    return {r: (r,) for r in range(n)}


def temp_entries() -> set[str]:
    tmp = tempfile.gettempdir()
    return {n for n in os.listdir(tmp) if not n.startswith("pytest-of-")}


async def test_summary_names_the_failing_ranks_logs_and_the_log_dir(tmp_path: Path) -> None:
    specs = DefaultLogsSpecs(log_dir=tmp_path, redirects=Std.ALL)
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(shout_or_fail, nprocs=2, args=args(2), logs_specs=specs)
    err = info.value
    rank, failure = err.get_first_failure()
    assert rank == 1
    run_dir = err.log_dir
    assert run_dir and Path(run_dir).parent == tmp_path
    stdout_log = os.path.join(run_dir, "attempt_0", "1", "stdout.log")
    stderr_log = os.path.join(run_dir, "attempt_0", "1", "stderr.log")
    assert (failure.stdout_log, failure.stderr_log) == (stdout_log, stderr_log)
    assert Path(stdout_log).read_text() == "out of rank 1\n"
    assert "ValueError: rank 1 refuses" in Path(stderr_log).read_text()
    summary = str(err)
    assert f"  stdout    : {stdout_log}\n" in summary
    assert f"  stderr    : {stderr_log}\n" in summary
    assert f"Logs: {run_dir}\n" in summary
    assert "ValueError: rank 1 refuses" in summary


async def test_summary_leaves_out_log_files_the_worker_never_wrote(tmp_path: Path) -> None:
    # rank 1 writes to both; a worker that printed nothing has no file worth naming
    specs = DefaultLogsSpecs(log_dir=tmp_path, redirects=Std.ALL)
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(os._exit, nprocs=1, args={0: (3,)}, logs_specs=specs)
    summary = str(info.value)
    assert "exitcode  : 3" in summary
    assert "stdout    :" not in summary and "stderr    :" not in summary
    assert f"Logs: {info.value.log_dir}" in summary


async def test_failed_run_without_log_dir_keeps_its_temp_dir_and_names_it() -> None:
    before = temp_entries()
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(
            shout_or_fail, nprocs=2, args=args(2), logs_specs=DefaultLogsSpecs(tee=Std.ALL)
        )
    kept = temp_entries() - before
    try:
        assert len(kept) == 1
        run_dir = info.value.log_dir
        assert run_dir.startswith(os.path.join(tempfile.gettempdir(), kept.pop()) + os.sep)
        assert f"Logs: {run_dir}" in str(info.value)
        _, failure = info.value.get_first_failure()
        assert "ValueError: rank 1 refuses" in Path(failure.stderr_log).read_text()
        assert Path(failure.error_file).is_file()
    finally:
        for name in temp_entries() - before:
            shutil.rmtree(os.path.join(tempfile.gettempdir(), name))


async def test_successful_run_without_log_dir_leaves_nothing() -> None:
    # the error files it was given stayed empty: nothing worth keeping
    before = temp_entries()
    result = await aioproc.run(shout_or_fail, nprocs=2, args={0: (0,), 1: (2,)})
    assert result.return_values == {0: 0, 1: 2}
    assert result.log_dir == ""
    assert temp_entries() == before


async def test_teed_output_without_log_dir_is_kept_and_named() -> None:
    # the console showed it, but the files are what the result points at
    before = temp_entries()
    result = await aioproc.run(
        shout_or_fail, nprocs=1, args=args(1), logs_specs=DefaultLogsSpecs(tee=Std.ALL)
    )
    try:
        assert result.return_values == {0: 0}
        assert result.log_dir and os.path.isdir(result.log_dir)
        assert Path(result.stdouts[0]).read_text() == "out of rank 0\n"
        assert Path(result.stderrs[0]).read_text() == "err of rank 0\n"
    finally:
        for name in temp_entries() - before:
            shutil.rmtree(os.path.join(tempfile.gettempdir(), name))


async def test_redirected_output_without_log_dir_is_kept_and_named() -> None:
    # redirected output is shown nowhere else: the user may need it
    before = temp_entries()
    result = await aioproc.run(
        shout_or_fail, nprocs=1, args=args(1), logs_specs=DefaultLogsSpecs(redirects=Std.OUT)
    )
    try:
        assert result.log_dir and os.path.isdir(result.log_dir)
        assert result.stdouts[0].startswith(result.log_dir + os.sep)
        assert Path(result.stdouts[0]).read_text() == "out of rank 0\n"
    finally:
        for name in temp_entries() - before:
            shutil.rmtree(os.path.join(tempfile.gettempdir(), name))


async def test_devnull_feeds_the_sinks_and_writes_no_file(tmp_path: Path) -> None:
    os.chdir(tmp_path)  # restored by keep_cwd
    lines: list[OutputLine] = []
    before = temp_entries()
    result = await aioproc.run(
        shout_or_fail,
        nprocs=3,
        args={r: (r * 2,) for r in range(3)},  # 0, 2, 4: all succeed
        logs_specs=DefaultLogsSpecs(log_dir=os.devnull, tee=Std.ALL),
        sinks=[lines.append],
    )
    assert result.return_values == {0: 0, 1: 2, 2: 4}
    got = sorted((rec.rank, rec.stream, rec.line, rec.prefix) for rec in lines)
    assert got == sorted(
        (rank, stream, f"{stream[3:]} of rank {rank * 2}", f"[shout_or_fail{rank}]:")
        for rank in range(3)
        for stream in ("stdout", "stderr")
    )
    assert result.log_dir == ""
    assert temp_entries() == before
    assert os.listdir(tmp_path) == []


async def test_devnull_failure_shows_the_workers_exception(tmp_path: Path) -> None:
    os.chdir(tmp_path)
    lines: list[OutputLine] = []
    before = temp_entries()
    with pytest.raises(ChildFailedError) as info:
        await aioproc.run(
            shout_or_fail,
            nprocs=1,
            args={0: (1,)},
            logs_specs=DefaultLogsSpecs(log_dir=os.devnull, tee=Std.ALL),
            sinks=[lines.append],
        )
    assert ("stdout", "out of rank 1") in {(rec.stream, rec.line) for rec in lines}
    assert temp_entries() == before
    assert os.listdir(tmp_path) == []
    err = info.value
    assert err.log_dir == ""
    _, failure = err.get_first_failure()
    assert failure.error_file == "<N/A>"
    summary = str(err)
    # the exception came over the control channel: shown with the worker's frames
    assert "ValueError: rank 1 refuses" in summary
    assert "in shout_or_fail" in summary
    assert "wrote no error file" not in summary
    assert "Logs:" not in summary


@pytest.fixture(autouse=True)
def keep_cwd() -> Iterator[None]:
    cwd = os.getcwd()
    yield
    os.chdir(cwd)


async def test_agent_result_names_the_log_dir_of_a_failed_run(tmp_path: Path) -> None:
    from aioproc import LocalElasticAgent, WorkerSpec

    spec = WorkerSpec(
        role="trainer",
        local_world_size=1,
        entrypoint=shout_or_fail,
        args=(1,),
        max_restarts=0,
    )
    result = await LocalElasticAgent(spec, log_dir=str(tmp_path)).run()
    assert result.is_failed()
    assert result.log_dir and Path(result.log_dir).parent == tmp_path
    summary = ChildFailedError("trainer", result.failures, result.log_dir).format_msg()
    assert f"Logs: {result.log_dir}" in summary
