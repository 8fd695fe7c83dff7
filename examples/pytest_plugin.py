"""aioproc's pytest plugin: test bodies on several ranks, group/pool/cluster fixtures, leak checks.

Run: python examples/pytest_plugin.py (it runs pytest on this file), or
pytest examples/pytest_plugin.py with aioproc installed (the plugin comes with it).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import aioproc
from aioproc.testing import barrier, rank, task, world_size


def square(x: int) -> int:
    return x * x


@pytest.mark.aioproc(nprocs=4, timeout=60)  # 4 fresh processes; stacks dumped after 60 s
def test_every_rank_agrees(tmp_path):  # fixture values are sent to every rank
    assert world_size() == 4  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set
    (tmp_path / f"rank{rank()}").write_text(os.environ["MASTER_PORT"])
    barrier()  # every rank has written its file
    assert len(list(tmp_path.iterdir())) == 4
    print(f"rank {rank()} done")  # each rank's output is its own report section


@pytest.mark.aioproc(cluster={"chief": 1, "worker": 2})  # TF_CONFIG for each task
async def test_cluster_tasks():  # async bodies run on an event loop in each rank
    task_type, index = task()
    assert (task_type, index) in {("chief", 0), ("worker", 0), ("worker", 1)}


async def test_group_fixture(aioproc_group):
    pc = await aioproc_group(square, 3, args={0: (1,), 1: (2,), 2: (3,)})
    result = await pc.wait()  # a started PContext; closed at teardown in any case
    assert result.return_values == {0: 1, 1: 4, 2: 9}


async def test_pool_fixture(aioproc_pool):
    pool = await aioproc_pool(2)  # aioproc.open_pool's arguments
    assert await pool.submit(square, 7) == 49


async def test_cluster_fixture(aioproc_cluster):
    runner = await aioproc_cluster(square, {"chief": 1, "worker": 2}, args=(3,))
    result = await runner.join(60)  # a started ClusterRunner; stopped at teardown in any case
    assert result.return_value == [9, 9, 9]


@pytest.mark.aioproc_leakcheck  # or --aioproc-leakcheck for every test
async def test_leaves_nothing_behind():
    async with aioproc.start_processes(
        "echo", "/bin/echo", {0: ("hi",)}, {0: {}}, aioproc.DefaultLogsSpecs(log_dir=os.devnull)
    ) as pc:
        await pc.wait()
    # a child process, fd, thread, aioproc temp dir or group left open here fails the test


if __name__ == "__main__":
    # an empty config (-c os.devnull): only what this file needs
    options = ["-q", "-p", "aioproc.pytest_plugin", "-p", "no:cacheprovider", "-c", os.devnull]
    options += ["-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function"]
    # a fresh interpreter: here aioproc is imported already, too early for
    # pytest to rewrite the asserts of a plugin's package
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", __file__, *options]))
