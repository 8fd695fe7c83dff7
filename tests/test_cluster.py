"""aioproc.cluster: TensorFlow's MultiProcessRunner, async, end to end.

The cases port the ideas of TF's ``multi_process_runner_test.py`` (runner
and pool runner), plus what TF had to skip: segfaulting and SIGKILLed tasks
are failures.  Task functions live in ``children/cluster_funcs.py``; the
barrier is test_barrier.py's.  A test that must catch a task mid-run waits
for a line it printed (through a sink), never on a sleep; every process is
gone afterwards (the autouse leak check, and ``pid_gone`` where a pid is
known).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from cluster_fixtures import make
from helpers import CHILDREN_DIR, child_pids, import_child, pid_gone

import aioproc
from aioproc import cluster
from aioproc.agent import RestartPolicy
from aioproc.cluster import (
    ClusterRunner,
    SubprocessTimeoutError,
    UnexpectedSubprocessExitError,
    create_cluster_spec,
)
from aioproc.errors import RemoteTraceback
from aioproc.sinks import Sink

QUICK = RestartPolicy(initial_delay=0.0)


@pytest.fixture
def cf(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The task-function module, importable here and (by path) in the tasks."""
    return import_child(monkeypatch, "cluster_funcs")


class Lines(Sink):
    """A sink that lets a test wait for a line a task wrote."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._waiters: list[tuple[Callable[[list[str]], bool], asyncio.Event]] = []

    def lines(self, rank: int, stream: str, prefix: str, lines: list[str]) -> None:
        self.seen.extend(prefix + line for line in lines)
        for check, event in self._waiters:
            if check(self.seen):
                event.set()

    async def wait_for(self, text: str, times: int = 1) -> None:
        def check(seen: list[str]) -> bool:
            return sum(text in line for line in seen) >= times

        if check(self.seen):
            return
        event = asyncio.Event()
        self._waiters.append((check, event))
        await event.wait()


class Exits:
    """An ``on_exit`` callback that lets a test wait until tasks have ended."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[str, int], int]] = []
        self._changed = asyncio.Event()

    def __call__(self, key: tuple[str, int], code: int) -> None:
        self.seen.append((key, code))
        self._changed.set()

    async def wait_for(self, *keys: tuple[str, int]) -> None:
        while not set(keys) <= {k for k, _ in self.seen}:
            self._changed.clear()
            await self._changed.wait()


# ------------------------------------------------ MultiProcessRunner cases


async def test_run_returns_values_in_task_order(cf: ModuleType) -> None:
    spec = create_cluster_spec(num_workers=2, num_ps=3, has_chief=True)
    result = await cluster.run(cf.task, spec, stream_output=False)
    assert result.return_value == [
        ("chief", 0),
        ("worker", 0),
        ("worker", 1),
        ("ps", 0),
        ("ps", 1),
        ("ps", 2),
    ]
    assert result.task_values[("ps", 2)] == ("ps", 2)
    assert result.exit_codes == {k: 0 for k in result.task_values}
    assert result.terminated == set()


async def test_tf_config_names_the_cluster_and_the_task(cf: ModuleType) -> None:
    spec = create_cluster_spec(has_chief=True, num_workers=1, has_eval=True)

    result = await cluster.run(_tf_config, spec, stream_output=False, rpc_layer="grpc")
    configs = [json.loads(c) for c in result.return_value]
    assert [c["task"] for c in configs] == [
        {"type": "chief", "index": 0},
        {"type": "worker", "index": 0},
        {"type": "evaluator", "index": 0},
    ]
    assert all(c["cluster"] == spec and c["rpc_layer"] == "grpc" for c in configs)
    assert "TF_CONFIG" not in os.environ


def _tf_config() -> str:
    return os.environ["TF_CONFIG"]


async def test_error_propagates_with_its_type_and_traceback(cf: ModuleType) -> None:
    spec = create_cluster_spec(num_workers=1, num_ps=1)
    with pytest.raises(ValueError, match=r"This is an error\.") as info:
        await cluster.run(cf.errors, spec, max_run_time=20, stream_output=False)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert 'cluster_funcs.py", line' in str(cause) and "in errors" in str(cause)
    result = info.value.mpr_result  # type: ignore[attr-defined]
    assert result.return_value == []
    assert result.exit_codes == {("worker", 0): 1, ("ps", 0): 1}


async def test_results_do_not_leak_between_runs(cf: ModuleType) -> None:
    spec = create_cluster_spec(num_workers=2)
    first = await cluster.run(cf.simple_data, spec, stream_output=False)
    assert first.return_value == ["dummy_data", "dummy_data"]
    second = await cluster.run(cf.does_nothing, spec, stream_output=False)
    assert second.return_value == []  # None is dropped, as TF does
    assert second.task_values == {("worker", 0): None, ("worker", 1): None}


async def test_args_and_kwargs_reach_every_task(cf: ModuleType) -> None:
    result = await cluster.run(
        cf.args_and_kwargs,
        create_cluster_spec(num_workers=2),
        args=("a", "b"),
        kwargs={"c_k": "c_v"},
        stream_output=False,
    )
    assert result.return_value == [["a", "b", ("c_k", "c_v")]] * 2


async def test_output_is_prefixed_and_returned(cf: ModuleType) -> None:
    result = await cluster.run(
        cf.prints_and_returns,
        create_cluster_spec(num_workers=2),
        return_output=True,
        stream_output=False,
    )
    for i in (0, 1):
        # each line keeps its newline, as in TF
        assert f"[worker-{i}]:    This is something printed.\n" in result.stdout
        assert f"[worker-{i}]:    This went to stderr.\n" in result.stdout
    assert len(result.stdout) == 4
    # so a TF test's check for a line that must not be there is not vacuous
    assert "[worker-0]:    This is something printed." not in result.stdout
    assert result.return_value == ["This is returned data."] * 2


async def test_stream_output_prints_prefixed_lines(
    cf: ModuleType, capfd: pytest.CaptureFixture[str]
) -> None:
    await cluster.run(cf.prints_and_returns, create_cluster_spec(has_chief=True, num_workers=1))
    out, err = capfd.readouterr()
    lines = (out + err).splitlines()
    assert "[chief-0]:     This is something printed." in lines
    assert "[worker-0]:    This went to stderr." in lines


async def test_termination_stops_one_task_only(
    cf: ModuleType, runners: list[ClusterRunner]
) -> None:
    lines = Lines()
    runner = make(runners, cf.count, create_cluster_spec(num_workers=2), sinks=[lines])
    await runner.start()
    await lines.wait_for("[worker-0]:    blocking now")
    pid = runner.get_process_id("worker", 0)
    await runner.terminate("worker", 0)
    assert pid is not None and pid_gone(pid)
    result = await runner.join()
    assert "[worker-0]:    index 0, iteration 0" in lines.seen
    assert "[worker-0]:    index 0, iteration 9" not in lines.seen
    assert "[worker-1]:    index 1, iteration 9" in lines.seen
    assert result.terminated == {("worker", 0)}
    assert result.exit_codes == {("worker", 0): -signal.SIGTERM, ("worker", 1): 0}
    assert result.return_value == [1]


async def test_terminated_task_started_again(cf: ModuleType, runners: list[ClusterRunner]) -> None:
    lines = Lines()
    runner = make(runners, cf.count, create_cluster_spec(num_workers=2), sinks=[lines])
    await runner.start()
    await lines.wait_for("[worker-0]:    blocking now")
    first = runner.get_process_id("worker", 0)
    await runner.terminate("worker", 0)
    await runner.start_single_process("worker", 0, args=(None,))  # this time it runs through
    assert runner.get_process_id("worker", 0) != first
    result = await runner.join()
    assert sum("index 0, iteration 0" in line for line in lines.seen) == 2
    assert "[worker-0]:    index 0, iteration 9" in lines.seen
    assert result.return_value == [0, 1]
    assert result.terminated == set()


async def test_streaming_includes_tasks_added_later(
    cf: ModuleType, runners: list[ClusterRunner]
) -> None:
    spec = create_cluster_spec(has_chief=True, num_workers=2, num_ps=2)
    runner = make(runners, cf.streams, spec, return_output=True, dependence_on_chief=False)
    await runner.start()
    await runner.start_single_process("worker", 2)
    await runner.start_single_process("ps", 2)
    result = await runner.join()
    jobs = [("chief", 0)] + [(t, i) for t in ("worker", "ps") for i in range(3)]
    for task_type, index in jobs:
        tag = f"[{task_type}-{index}]:".ljust(14) + " "
        for i in range(5):
            assert f"{tag}(logging) {task_type}-{index}, i: {i}\n" in result.stdout
            assert f"{tag}(print) {task_type}-{index}, i: {i}\n" in result.stdout
    assert not any("-3" in line for line in result.stdout)
    assert len(result.stdout) == len(jobs) * 10
    # a task outside the spec is named in its TF_CONFIG all the same
    assert result.exit_codes[("worker", 2)] == 0


async def test_start_in_process_as(cf: ModuleType, runners: list[ClusterRunner]) -> None:
    spec = create_cluster_spec(has_chief=True, num_workers=1)
    runner = make(runners, cf.task, spec, return_output=True)
    here = await runner.start_in_process_as("chief", 0)
    assert here == ("chief", 0)
    assert "TF_CONFIG" not in os.environ  # restored
    await runner.start_single_process("evaluator", 0)
    result = await runner.join()
    assert result.return_value == [("worker", 0), ("evaluator", 0)]


async def test_terminate_all_does_not_ignore_errors(
    cf: ModuleType, runners: list[ClusterRunner]
) -> None:
    exits = Exits()
    runner = make(runners, cf.errors, create_cluster_spec(num_workers=2), on_exit=exits)
    await runner.start()
    await exits.wait_for(("worker", 0), ("worker", 1))
    await runner.terminate_all()
    with pytest.raises(ValueError, match=r"This is an error\."):
        await runner.join()


async def test_timeout_reports_stacks_and_partial_output(
    cf: ModuleType, runners: list[ClusterRunner]
) -> None:
    lines = Lines()
    spec = create_cluster_spec(num_workers=1, num_ps=1)
    ps_done = asyncio.Event()
    runner = make(
        runners,
        _ps_returns_else(cf),
        spec,
        return_output=True,
        sinks=[lines],
        on_exit=lambda key, code: key == ("ps", 0) and ps_done.set(),
    )
    await runner.start()
    await lines.wait_for("[worker-0]:    blocking now")
    await ps_done.wait()
    pid = runner.get_process_id("worker", 0)
    with pytest.raises(SubprocessTimeoutError) as info:
        await runner.join(timeout=0.2)
    error = info.value
    assert "tasks still running were stopped: worker-0" in str(error)
    assert "in blocked_in_known_function" in str(error)
    assert "in blocked_in_known_function" in error.stacks[("worker", 0)]
    assert "in prints_then_blocks" in error.stacks[("worker", 0)]
    stdout = error.mpr_result.stdout
    assert "[worker-0]:    something printed\n" in stdout
    assert any("in blocked_in_known_function" in line and "[worker-0]" in line for line in stdout)
    assert error.mpr_result.return_value == ["ps done"]
    assert error.mpr_result.terminated == {("worker", 0)}
    assert pid is not None and pid_gone(pid)


def _ps_returns_else(cf: ModuleType) -> Callable[[], str]:
    import functools

    return functools.partial(_ps_or_block, cf.prints_then_blocks)


def _ps_or_block(block: Callable[[], None]) -> str:
    if json.loads(os.environ["TF_CONFIG"])["task"]["type"] == "ps":
        return "ps done"
    block()
    return "unreachable"


async def test_seg_fault_raises_unexpected_exit(cf: ModuleType) -> None:
    with pytest.raises(UnexpectedSubprocessExitError) as info:
        await cluster.run(
            cf.seg_faults,
            create_cluster_spec(num_workers=1),
            return_output=True,
            stream_output=False,
        )
    assert str(info.value) == (
        "Subprocess worker-0 exited with exit code -11: it was killed by SIGSEGV"
    )
    assert any("Segmentation fault" in line for line in info.value.mpr_result.stdout)


async def test_seg_fault_in_chief_stops_the_others(cf: ModuleType) -> None:
    spec = create_cluster_spec(has_chief=True, num_workers=1)
    with pytest.raises(UnexpectedSubprocessExitError) as info:
        await cluster.run(
            cf.worker_blocks_else,
            spec,
            args=("segfault",),
            return_output=True,
            stream_output=False,
            chief_grace_period=0.1,
        )
    assert "Subprocess chief-0 exited with exit code -11" in str(info.value)
    result = info.value.mpr_result
    assert any("Segmentation fault" in line for line in result.stdout)
    assert result.terminated == {("worker", 0)}  # stopped because the chief is gone


async def test_sigkilled_task_raises_unexpected_exit(cf: ModuleType) -> None:
    with pytest.raises(UnexpectedSubprocessExitError) as info:
        await cluster.run(cf.kills_itself, create_cluster_spec(num_workers=2), stream_output=False)
    assert "exited with exit code -9: it was killed by SIGKILL" in str(info.value)
    assert info.value.mpr_result.exit_codes == {("worker", 0): -9, ("worker", 1): -9}


async def test_exit_code_reported_by_chief(cf: ModuleType) -> None:
    spec = create_cluster_spec(has_chief=True, num_workers=1)
    with pytest.raises(
        UnexpectedSubprocessExitError, match=r"^Subprocess chief-0 exited with exit code 20$"
    ):
        await cluster.run(
            cf.worker_blocks_else,
            spec,
            args=("exit", 20),
            stream_output=False,
            chief_grace_period=0.1,
        )


async def test_exit_code_reported_by_task(cf: ModuleType) -> None:
    with pytest.raises(
        UnexpectedSubprocessExitError, match="Subprocess worker-0 exited with exit code 10"
    ):
        await cluster.run(
            cf.exits_with, create_cluster_spec(num_workers=1), args=(10,), stream_output=False
        )


async def test_auto_restart(cf: ModuleType, tmp_path: Path) -> None:
    result = await cluster.run(
        cf.fails_first,
        create_cluster_spec(num_workers=1),
        args=(str(tmp_path),),
        auto_restart=True,
        restart_policy=QUICK,
        stream_output=False,
    )
    assert result.return_value == [2]
    assert (tmp_path / "count").read_text() == "x\nx\n"


async def test_auto_restart_and_timeout(cf: ModuleType) -> None:
    with pytest.raises(ValueError, match="fails every time") as info:
        await cluster.run(
            cf.always_fails,
            create_cluster_spec(num_workers=1),
            auto_restart=True,
            restart_policy=QUICK,
            max_restarts=3,
            return_output=True,
            stream_output=False,
            timeout=20,
        )
    running = [line for line in info.value.mpr_result.stdout if line.endswith("Running\n")]  # type: ignore[attr-defined]
    assert len(running) == 4  # the first attempt and 3 restarts: the budget


async def test_auto_restart_ends_when_chief_succeeds(cf: ModuleType, tmp_path: Path) -> None:
    fifo = tmp_path / "failures"
    os.mkfifo(fifo)
    spec = create_cluster_spec(has_chief=True, num_workers=1)
    with pytest.raises(ValueError, match="worker fails") as info:
        await cluster.run(
            cf.chief_waits_for_worker_failures,
            spec,
            args=(str(fifo),),
            auto_restart=True,
            restart_policy=QUICK,
            stream_output=False,
            chief_grace_period=0.1,
            timeout=30,
        )
    assert info.value.mpr_result.exit_codes[("chief", 0)] == 0  # type: ignore[attr-defined]


async def test_auto_restart_after_terminations(
    cf: ModuleType, runners: list[ClusterRunner], tmp_path: Path
) -> None:
    lines = Lines()
    spec = create_cluster_spec(num_workers=2)
    runner = make(
        runners,
        cf.attempt,
        spec,
        args=(str(tmp_path),),
        auto_restart=True,
        restart_policy=QUICK,
        sinks=[lines],
    )
    await runner.start()
    await lines.wait_for("[worker-1]:    blocking now")
    first = runner.get_process_id("worker", 1)
    await runner.terminate("worker", 1)
    await lines.wait_for("[worker-1]:    attempt 2")
    # worker-0 is stopped right after worker-1 came back
    await lines.wait_for("[worker-0]:    blocking now")
    await runner.terminate("worker", 0)
    result = await runner.join(timeout=20)
    assert result.return_value == [2, 2]
    assert result.terminated == set()  # both came back and finished
    assert first is not None and pid_gone(first)
    assert runner.get_process_id("worker", 1) != first


async def test_auto_restart_after_user_terminate(
    cf: ModuleType, runners: list[ClusterRunner], tmp_path: Path
) -> None:
    lines, exits = Lines(), Exits()
    runner = make(
        runners,
        cf.attempt,
        {"worker": 1},
        args=(str(tmp_path),),
        auto_restart=True,
        restart_policy=QUICK,
        sinks=[lines],
        on_exit=exits,
    )
    await runner.start()
    await lines.wait_for("[worker-0]:    blocking now")
    await runner.terminate("worker", 0)  # terminated by the user: restarted too
    result = await runner.join(timeout=20)
    assert (tmp_path / "worker-0").read_text() == "x\nx\n"
    assert result.return_value == [2]
    assert exits.seen == [(("worker", 0), -signal.SIGTERM), (("worker", 0), 0)]
    assert result.terminated == set()


async def test_error_reporting_overrides_timeout(
    cf: ModuleType, runners: list[ClusterRunner]
) -> None:
    lines = Lines()
    spec = create_cluster_spec(num_workers=2)
    exits = Exits()
    runner = make(runners, cf.worker_errors_other_blocks, spec, sinks=[lines], on_exit=exits)
    await runner.start()
    await exits.wait_for(("worker", 0))
    await lines.wait_for("[worker-1]:    blocking now")
    with pytest.raises(ValueError, match="Worker 0 errored") as info:
        await runner.join(timeout=0.2)
    assert info.value.mpr_result.terminated == {("worker", 1)}  # type: ignore[attr-defined]


async def test_process_exists_and_exit_code(cf: ModuleType, runners: list[ClusterRunner]) -> None:
    lines = Lines()
    runner = make(runners, cf.prints_then_blocks, create_cluster_spec(num_workers=1), sinks=[lines])
    await runner.start()
    assert runner.process_exists("worker", 0)
    assert runner.get_process_exit_code("worker", 0) is None
    await runner.terminate("worker", 0)
    assert not runner.process_exists("worker", 0)
    assert runner.get_process_exit_code("worker", 0) == -signal.SIGTERM
    with pytest.raises(ValueError, match="worker-5 does not exist"):
        runner.get_process_exit_code("worker", 5)
    result = await runner.join()
    assert result.terminated == {("worker", 0)}


async def test_join_without_timeout(cf: ModuleType) -> None:
    with pytest.raises(ValueError, match="Worker 0 errored"):
        await cluster.run(
            cf.worker_errors_other_blocks, {"worker": 1}, timeout=None, stream_output=False
        )


# ---------------------------------------------- pools (MultiProcessPoolRunner)


async def test_pool_keeps_processes_across_runs(cf: ModuleType) -> None:
    async with aioproc.open_pool(create_cluster_spec(num_workers=2)) as pool:
        pids = await pool.run(cf.getpid)
        for _ in range(3):
            assert await pool.run(cf.getpid) == pids
    assert all(pid_gone(p) for p in pids)


async def test_pool_survives_exceptions_in_tasks(cf: ModuleType) -> None:
    async with aioproc.open_pool(create_cluster_spec(num_workers=2)) as pool:
        pids = await pool.run(cf.getpid)
        with pytest.raises(ValueError, match=r"This is an error\."):
            await pool.run(cf.errors)
        assert await pool.run(cf.getpid) == pids


async def test_pool_tf_config(cf: ModuleType) -> None:
    async with aioproc.open_pool(create_cluster_spec(has_chief=True, num_workers=2)) as pool:
        assert sorted(await pool.run(cf.task_type)) == ["chief", "worker", "worker"]


async def test_pool_closed_on_exception_in_main_process(cf: ModuleType) -> None:
    pids: list[int] = []
    with pytest.raises(LookupError, match="failure"):
        async with aioproc.open_pool(create_cluster_spec(has_chief=True, num_workers=2)) as pool:
            pids = await pool.run(cf.getpid)
            raise LookupError("failure")
    assert len(pids) == 3 and all(pid_gone(p) for p in pids)


async def test_pool_initializer(cf: ModuleType) -> None:
    spec = create_cluster_spec(num_workers=2)
    async with aioproc.open_pool(spec, initializer=cf.sets_global, initargs=(1,)) as pool:
        assert await pool.run(cf.sets_global, (2,)) == [1, 1]


async def test_pool_reused_by_several_runs(cf: ModuleType) -> None:
    async with aioproc.open_pool(create_cluster_spec(num_workers=2)) as pool:
        for _ in range(2):
            assert await pool.run(cf.does_nothing) == [None, None]


async def test_nested_pool(cf: ModuleType) -> None:
    async with aioproc.open_pool(create_cluster_spec(num_workers=1)) as pool:
        (inner,) = await pool.run(cf.nested_pool)
    assert len(inner) == 2 and all(pid_gone(p) for p in inner)


# ------------------------------------------------------------------ GPUs


def test_assign_gpus_round_robin() -> None:
    tasks = [("worker", 0), ("chief", 0)]
    assert cluster.assign_gpus(tasks, ["0", "1"]) == {("chief", 0): "0", ("worker", 0): "1"}
    assert cluster.assign_gpus(tasks, ["0", "1", "2", "3"]) == {
        ("chief", 0): "0,2",
        ("worker", 0): "1,3",
    }
    three = [("worker", 0), ("worker", 1), ("ps", 0)]
    assert cluster.assign_gpus(three, ["7"]) == {t: "7" for t in three}
    assert cluster.assign_gpus(tasks, []) == {}


def test_visible_gpus_from_env_or_driver(tmp_path: Path) -> None:
    from aioproc._cluster.tfconfig import visible_gpus

    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]
    gpus = tmp_path / "driver" / "nvidia" / "gpus"
    gpus.mkdir(parents=True)
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        (gpus / bus).mkdir()
    assert visible_gpus({}, proc_root=str(tmp_path)) == ["0", "1"]
    assert visible_gpus({}, proc_root=str(tmp_path / "none")) == []


async def test_not_share_gpu(cf: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = create_cluster_spec(has_chief=True, num_workers=1)
    result = await cluster.run(
        cf.cuda_visible_devices, spec, share_gpu=False, gpus=["0", "1"], stream_output=False
    )
    assert result.return_value == ["0", "1"]
    four = await cluster.run(
        cf.cuda_visible_devices,
        spec,
        share_gpu=False,
        gpus=["0", "1", "2", "3"],
        stream_output=False,
    )
    assert four.return_value == ["0,2", "1,3"]
    # by default the GPUs are the parent's CUDA_VISIBLE_DEVICES, shared or handed out
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    shared = await cluster.run(cf.cuda_visible_devices, spec, stream_output=False)
    assert shared.return_value == ["4,5", "4,5"]
    split = await cluster.run(cf.cuda_visible_devices, spec, share_gpu=False, stream_output=False)
    assert split.return_value == ["4", "5"]


# ------------------------------------------------------------ worker threads


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_group_workers_run_no_thread_of_their_own(cf: ModuleType, start_method: str) -> None:
    # only a cluster run asks for stacks at any time; a group's worker reads
    # its channel only at the barrier, in the thread that waits there
    result = await aioproc.run(cf.threads_then_barrier, 3, start_method=start_method)
    assert result.return_values == {0: 1, 1: 1, 2: 1}


async def test_cluster_workers_keep_a_thread_that_answers_stack_requests(
    cf: ModuleType,
) -> None:
    spec = create_cluster_spec(has_chief=True, num_workers=2)
    result = await cluster.run(cf.threads_then_barrier, spec, stream_output=False)
    assert result.return_value == [2, 2, 2]


# ------------------------------------------------------- kwargs, bad input


async def test_per_rank_kwargs_in_run_and_start_processes(cf: ModuleType) -> None:
    result = await aioproc.run(
        cf.kwargs_rank, 2, args={0: (1,), 1: (2,)}, kwargs={1: {"scale": 10, "tag": "b"}}
    )
    assert result.return_values == {0: (1, ""), 1: (20, "b")}
    shared = await aioproc.run(cf.kwargs_rank, 2, args=(3,), kwargs={"tag": "all"})
    assert shared.return_values == {0: (3, "all"), 1: (3, "all")}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({5: {}}, ValueError, r"kwargs for local rank 5, but the ranks are \[0, 1\]"),
        ({0: {1: 2}}, TypeError, r"kwargs\[0\] must be a dict with str keys"),
        (
            {0: {"x": threading.Lock()}},
            TypeError,
            "args or kwargs for local rank 0 cannot be pickled",
        ),
    ],
)
async def test_bad_kwargs_fail_before_anything_starts(
    cf: ModuleType, kwargs: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        await aioproc.run(cf.kwargs_rank, 2, args=(1,), kwargs=kwargs)  # type: ignore[arg-type]


async def test_binary_workers_take_no_kwargs() -> None:
    with pytest.raises(TypeError, match="binary worker 'true' takes argv only"):
        await aioproc.run("true", 1, kwargs={0: {"x": 1}})


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ({"chief": ["a:1", "b:1"]}, ValueError, "at most one chief, got 2"),
        ({}, TypeError, "cluster_spec must be a non-empty dict"),
        ({"worker": 0}, ValueError, r"cluster_spec\['worker'\] must be a positive count"),
        ({"worker": "a:1"}, ValueError, "must be a positive count or a list"),
    ],
)
async def test_bad_cluster_spec_fails_before_anything_starts(
    cf: ModuleType, spec: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        await cluster.run(cf.task, spec)  # type: ignore[arg-type]


async def test_bad_arguments_fail_before_anything_starts(cf: ModuleType) -> None:
    spec = create_cluster_spec(num_workers=1)
    with pytest.raises(TypeError, match="fn must be callable"):
        await cluster.run("not callable", spec)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot be pickled"):
        await cluster.run(cf.args_and_kwargs, spec, args=(threading.Lock(),))
    with pytest.raises(ValueError, match="max_run_time"):
        await cluster.run(cf.task, spec, max_run_time=-1)
    with pytest.raises(ValueError, match="num_workers must be a non-negative int"):
        create_cluster_spec(num_workers=-1)


def test_create_cluster_spec_picks_distinct_ports() -> None:
    spec = create_cluster_spec(has_chief=True, num_workers=2, num_ps=1, has_eval=True)
    assert list(spec) == ["chief", "worker", "ps", "evaluator"]
    addresses = [a for tasks in spec.values() for a in tasks]
    assert len(set(addresses)) == 5
    assert all(a.startswith("localhost:") and not a.endswith(":0") for a in addresses)


# ------------------------------------------------- lifetime, cancellation


async def test_max_run_time_ends_tasks_as_done(cf: ModuleType) -> None:
    result = await cluster.run(
        cf.prints_then_blocks,
        create_cluster_spec(num_workers=1),
        max_run_time=0.5,
        stream_output=False,
    )
    assert result.task_values == {("worker", 0): None}
    assert result.exit_codes == {("worker", 0): -signal.SIGTERM}


async def test_cancelled_run_leaves_no_process(cf: ModuleType) -> None:
    lines = Lines()
    pids: list[int] = []

    async def go() -> None:
        await cluster.run(cf.prints_then_blocks, {"worker": 2}, sinks=[lines], stream_output=False)

    task = asyncio.ensure_future(go())
    await lines.wait_for("blocking now", times=2)
    pids = [int(p) for p in child_pids()]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pids and all(pid_gone(p) for p in pids)


async def test_repr_and_lifecycle_misuse(cf: ModuleType, runners: list[ClusterRunner]) -> None:
    runner = make(runners, cf.task, {"worker": 1})
    assert repr(runner) == "<ClusterRunner task new>"
    with pytest.raises(RuntimeError, match="not running"):
        await runner.start_single_process("worker", 1)
    await runner.start()
    with pytest.raises(RuntimeError, match="already started"):
        await runner.start()
    await runner.join()
    await runner.aclose()
    assert repr(runner) == "<ClusterRunner task closed>"


async def test_cancel_at_random_points_leaves_nothing(cf: ModuleType) -> None:
    import random

    from helpers import child_pids

    rng = random.Random(1234)
    for _ in range(12):
        task = asyncio.ensure_future(
            cluster.run(cf.prints_then_blocks, {"worker": 2, "ps": 1}, stream_output=False)
        )
        await asyncio.sleep(rng.uniform(0, 0.4))  # a random point: launch, run or join
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert child_pids() == set()


async def test_on_exit_reports_every_attempt(cf: ModuleType, tmp_path: Path) -> None:
    exits: list[tuple[tuple[str, int], int]] = []
    await cluster.run(
        cf.fails_first,
        {"worker": 1},
        args=(str(tmp_path),),
        auto_restart=True,
        restart_policy=QUICK,
        stream_output=False,
        on_exit=lambda key, code: exits.append((key, code)),
    )
    assert exits == [(("worker", 0), 1), (("worker", 0), 0)]


async def test_sigkilled_supervisor_leaves_no_task(tmp_path: Path) -> None:
    from helpers import REPO_ROOT
    from proc_utils import Fifo, still_alive_after

    script = os.path.join(CHILDREN_DIR, "cluster_supervisor.py")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    async with Fifo(tmp_path / "pids") as fifo:
        proc = await asyncio.create_subprocess_exec(sys.executable, script, fifo.path, env=env)
        try:
            pids = [int(line) for line in await fifo.lines(3)]
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
    assert await still_alive_after(pids, 10) == set()


@pytest.mark.parametrize("mode", ["grandchild", "barrier"])
async def test_tasks_kill_their_groups_on_their_channels_eof_with_the_guardian_stopped(
    tmp_path: Path, mode: str
) -> None:
    """Nobody sweeps (the guardian is SIGSTOPped when the supervisor is SIGKILLed):
    each cluster task, each rank waiting at ``barrier()`` and one that calls it
    after the supervisor is gone see their control socket's EOF and kill their
    own group, the grandchild they started included.  A rank busy elsewhere
    runs on (no thread of its own watches the socket) until the guardian,
    continued, sweeps it."""
    from helpers import REPO_ROOT, cmdline, parent_of, state
    from proc_utils import Fifo, still_alive_after

    script = os.path.join(CHILDREN_DIR, "cluster_supervisor.py")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    guardian = 0
    async with Fifo(tmp_path / "pids") as fifo:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, script, fifo.path, mode, env=env
        )
        try:
            lines = [[int(p) for p in line.split()] for line in await fifo.lines(3)]
            busy = [pids[0] for pids in lines if len(pids) == 1]
            pids = [pid for pair in lines if len(pair) == 2 for pid in pair]
            assert (len(pids), len(busy)) == ((6, 0) if mode == "grandchild" else (4, 1))
            (guardian,) = (
                int(p)
                for p in os.listdir("/proc")
                if p.isdigit()
                and parent_of(int(p)) == proc.pid
                and cmdline(int(p)).startswith(b"aioproc-guardian ")
            )
            os.kill(guardian, signal.SIGSTOP)
            proc.kill()
            await proc.wait()
            assert await still_alive_after(pids, 10) == set()
            assert state(guardian) == "T"  # stopped all along: nobody swept them
            assert await still_alive_after(busy, 0.2) == set(busy)
            os.kill(guardian, signal.SIGCONT)
            assert await still_alive_after(busy, 10) == set()
            # it prunes the group's temp log dir after its sweep, then exits
            assert await still_alive_after([guardian], 10) == set()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            if guardian:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(guardian, signal.SIGCONT)


async def test_restarts_back_off_by_policy(cf: ModuleType) -> None:
    asked: list[int] = []

    class Recording(RestartPolicy):
        def delay(self, n: int, rng: Callable[[float, float], float] = random.uniform) -> float:
            asked.append(n)
            return 0.0

    with pytest.raises(ValueError, match="fails every time"):
        await cluster.run(
            cf.always_fails,
            {"worker": 1},
            auto_restart=True,
            restart_policy=Recording(),
            max_restarts=3,
            stream_output=False,
        )
    assert asked == [0, 1, 2]  # one delay per restart, growing; none once the budget is spent


# ----------------------------------------------- open_cluster() and aclose()


async def test_open_cluster_awaited_then_aclose_from_two_tasks(cf: ModuleType) -> None:
    lines = Lines()
    runner = await cluster.open_cluster(
        cf.prints_then_blocks, {"worker": 2}, stream_output=False, sinks=[lines]
    )
    try:
        await lines.wait_for("blocking now", times=2)
        pids = [runner.get_process_id("worker", i) for i in range(2)]
        assert repr(runner) == "<ClusterRunner prints_then_blocks running=2>"
    finally:
        # two tasks close it at once: both return once every task is gone
        await asyncio.gather(runner.aclose(), runner.aclose())
    assert all(p is not None and pid_gone(p) for p in pids)
    assert repr(runner) == "<ClusterRunner prints_then_blocks closed>"
    assert runner.get_process_exit_code("worker", 0) == -signal.SIGTERM
    await runner.aclose()  # closed: returns at once


async def test_open_cluster_with_async_with_joins_and_closes(cf: ModuleType) -> None:
    async with cluster.open_cluster(cf.task, {"chief": 1, "worker": 2}, stream_output=False) as r:
        result = await r.join()
    assert result.return_value == [("chief", 0), ("worker", 0), ("worker", 1)]
    assert repr(r) == "<ClusterRunner task closed>"


async def test_aclose_honours_the_runners_grace_period(cf: ModuleType) -> None:
    """A task ignoring SIGTERM is SIGKILLed once the runner's grace period is over."""
    lines = Lines()
    runner = await cluster.open_cluster(
        cf.ignores_sigterm, {"worker": 1}, stream_output=False, sinks=[lines], grace_period=1
    )
    try:
        await lines.wait_for("blocking now")
        pid = runner.get_process_id("worker", 0)
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.warns(aioproc.ForcedKillWarning, match=r"did not exit"):
            await runner.aclose()
        took = loop.time() - began
    finally:
        await runner.aclose()
    assert pid is not None and pid_gone(pid)
    assert runner.get_process_exit_code("worker", 0) == -signal.SIGKILL
    assert 0.9 <= took < 15, took  # the grace period, and a generous bound above it


def test_the_runners_grace_period_default_is_its_own() -> None:
    from aioproc._cluster.runner import GRACE_PERIOD

    runner = ClusterRunner(print, {"worker": 1})
    assert runner.grace_period == GRACE_PERIOD == 5.0


async def test_open_cluster_checks_its_arguments_at_the_call(cf: ModuleType) -> None:
    with pytest.raises(ValueError, match="grace_period"):
        cluster.open_cluster(cf.task, {"worker": 1}, grace_period=-1)
    with pytest.raises(TypeError, match="fn must be callable, got 42"):
        cluster.open_cluster(42, {"worker": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument 'grace'"):
        cluster.open_cluster(cf.task, {"worker": 1}, grace=1)
    with pytest.raises(TypeError, match="positional"):
        cluster.open_cluster(cf.task, {"worker": 1}, ())  # type: ignore[call-arg]
