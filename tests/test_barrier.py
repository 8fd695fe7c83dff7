"""The barrier: ``aioproc.cluster.barrier()`` in function workers.

A worker's ``barrier()`` (``aioproc._child.boot``) sends ARRIVE on its
control channel and blocks until the supervisor's hub
(``aioproc._func.barrier``) sends RELEASE to every member at once; the
barrier is reusable.  A member that ends without arriving breaks it: every
waiter gets ``threading.BrokenBarrierError`` naming that member.  The members
are the tasks of a cluster run or the ranks of an ``aioproc.run`` group.
Worker functions live in ``children/cluster_funcs.py``; the pytest plugin's
``aioproc.testing.barrier`` is tested in test_pytest_plugin.py.
"""

from __future__ import annotations

import asyncio
import os
import threading
from types import ModuleType
from typing import Any

import pytest
from cluster_fixtures import make
from helpers import import_child

import aioproc
from aioproc import cluster
from aioproc.cluster import ClusterRunner, UnexpectedSubprocessExitError, create_cluster_spec


@pytest.fixture
def cf(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The task-function module, importable here and (by path) in the tasks."""
    return import_child(monkeypatch, "cluster_funcs")


# ------------------------------------------------------ every member meets


async def test_barrier(cf: ModuleType) -> None:
    spec = create_cluster_spec(has_chief=True, num_workers=2)
    result = await cluster.run(cf.with_barrier, spec, stream_output=False)
    assert result.return_value == ["chief", "worker", "worker"]


async def test_barrier_in_run_groups(cf: ModuleType) -> None:
    result = await aioproc.run(cf.barrier_rank, 3, args={r: (r,) for r in range(3)})
    assert result.return_values == {0: 0, 1: 1, 2: 2}


async def test_barrier_in_forkserver_workers(cf: ModuleType) -> None:
    result = await aioproc.run(
        cf.barrier_rank, 2, args={r: (r,) for r in range(2)}, start_method="forkserver"
    )
    assert result.return_values == {0: 0, 1: 1}


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_ranks_that_arrive_before_their_launch_is_over_are_counted(
    cf: ModuleType, start_method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker runs, and may reach the barrier, while the supervisor still
    finishes its launch (a loaded machine, a forkserver's replies): each
    launch here ends only once its worker's arrival is in, and the barrier
    still passes for all of them."""
    from aioproc._child.channel import ARRIVE
    from aioproc._group.rank_launcher import RankLauncher

    launch = RankLauncher.launch

    async def late_launch(
        self: RankLauncher, rank: int, dest: Any, payload: Any, on_frame: Any, *args: Any
    ) -> Any:
        arrived = asyncio.Event()

        def watching(kind: int, body: bytearray) -> None:
            if kind == ARRIVE:
                arrived.set()
            on_frame(kind, body)

        child = await launch(self, rank, dest, payload, watching, *args)
        await asyncio.wait_for(arrived.wait(), 30)
        return child

    monkeypatch.setattr(RankLauncher, "launch", late_launch)
    result = await asyncio.wait_for(
        aioproc.run(
            cf.barrier_rank, 3, args={r: (r,) for r in range(3)}, start_method=start_method
        ),
        30,  # a rank never counted hangs the group: it fails here
    )
    assert result.return_values == {0: 0, 1: 1, 2: 2}


def test_barrier_called_in_main_process() -> None:
    # TF's multi_process_runner raises ValueError here, with these words
    with pytest.raises(ValueError, match=r"^barrier is not defined") as info:
        cluster.barrier()
    assert str(info.value) == (
        "barrier is not defined. It is likely because you are calling barrier() in the "
        "main process. barrier() can only be called in the subprocesses: the function "
        "workers aioproc starts (cluster.run, ClusterRunner, run or start_processes)."
    )


# ----------------------------------------------- a member that never arrives


async def test_dead_task_breaks_the_barrier(cf: ModuleType) -> None:
    spec = create_cluster_spec(has_chief=True, num_workers=2)
    with pytest.raises(threading.BrokenBarrierError) as info:
        await cluster.run(cf.barrier_unless, spec, args=(1,), stream_output=False)
    assert "barrier broken: worker-1 exited with code 0 without reaching it" in str(info.value)


async def test_killed_task_breaks_the_barrier_of_the_others(cf: ModuleType) -> None:
    spec = create_cluster_spec(has_chief=True, num_workers=2)
    with pytest.raises(UnexpectedSubprocessExitError, match="worker-1 exited with exit code -9"):
        try:
            await cluster.run(cf.barrier_then_die, spec, stream_output=False)
        except UnexpectedSubprocessExitError as e:
            broken = "BrokenBarrierError: barrier broken: worker-1 was killed by signal 9"
            values = e.mpr_result.return_value
            assert values == [f"{broken} without reaching it"] * 2
            raise


async def test_rank_that_returns_breaks_the_barrier_in_run(cf: ModuleType) -> None:
    with pytest.raises(aioproc.ChildFailedError) as info:
        await aioproc.run(
            cf.barrier_rank_leaves,
            3,
            args={r: (r,) for r in range(3)},
            logs_specs=aioproc.DefaultLogsSpecs(log_dir=os.devnull),
        )
    cause = info.value.__cause__
    assert isinstance(cause, threading.BrokenBarrierError)
    assert str(cause) == (
        "barrier broken: barrier_rank_leaves/1 exited with code 0 without reaching it"
    )


# ------------------------------------------------------ an in-process task


async def test_in_process_task_takes_no_part_in_the_barrier(
    cf: ModuleType, runners: list[ClusterRunner]
) -> None:
    spec = create_cluster_spec(has_chief=True, num_workers=2)
    runner = make(runners, cf.with_barrier_unless_chief, spec)
    assert await runner.start_in_process_as("chief", 0) == "chief"
    result = await runner.join()
    assert result.return_value == ["worker", "worker"]
