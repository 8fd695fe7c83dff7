"""Task functions for tests/test_cluster.py and tests/test_barrier.py (importable by path).

A task learns who it is from ``TF_CONFIG``.  Tasks that must be caught
mid-run print a line the test waits for (through a sink), then block.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import time
from typing import Any


def task() -> tuple[str, int]:
    config = json.loads(os.environ["TF_CONFIG"])["task"]
    return config["type"], config["index"]


def task_type() -> str:
    return task()[0]


def errors() -> None:
    raise ValueError("This is an error.")


def does_nothing() -> None:
    pass


def simple_data() -> str:
    return "dummy_data"


def args_and_kwargs(*args: Any, **kwargs: Any) -> list[Any]:
    return list(args) + list(kwargs.items())


def prints_and_returns() -> str:
    print("This is something printed.", flush=True)
    print("This went to stderr.", file=sys.stderr, flush=True)
    return "This is returned data."


def count(block_index: int | None = 0) -> int:
    """Ten numbered lines; task ``block_index`` stops for good after the first."""
    _, index = task()
    for i in range(10):
        print(f"index {index}, iteration {i}", flush=True)
        if index == block_index:
            blocked_in_known_function()
    return index


def streams() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    task_type, index = task()
    for i in range(5):
        logging.info("(logging) %s-%d, i: %d", task_type, index, i)
        print(f"(print) {task_type}-{index}, i: {i}", flush=True)


def blocked_in_known_function() -> None:
    print("blocking now", flush=True)
    while True:
        time.sleep(1000)


def prints_then_blocks() -> None:
    print("something printed", flush=True)
    blocked_in_known_function()


def ignores_sigterm() -> None:
    """Survives SIGTERM: only the SIGKILL after the grace period ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    blocked_in_known_function()


def seg_faults() -> None:
    ctypes.string_at(0)


def worker_blocks_else(then: str, code: int = 0) -> None:
    """Workers block; the other tasks segfault or exit with ``code``."""
    if task_type() == "worker":
        blocked_in_known_function()
    if then == "segfault":
        seg_faults()
    sys.exit(code)


def exits_with(code: int) -> None:
    sys.exit(code)


def kills_itself() -> None:
    print("about to die", flush=True)
    os.kill(os.getpid(), 9)


def attempt(directory: str) -> int:
    """Count this task's attempts in a file; the 1st attempt of each task blocks."""
    task_type, index = task()
    path = os.path.join(directory, f"{task_type}-{index}")
    with open(path, "a") as f:
        f.write("x\n")
    with open(path) as f:
        n = len(f.readlines())
    print(f"attempt {n}", flush=True)
    if n == 1:
        blocked_in_known_function()
    return n


def fails_first(directory: str) -> int:
    """Count attempts in a file; the first raises."""
    path = os.path.join(directory, "count")
    with open(path, "a") as f:
        f.write("x\n")
    with open(path) as f:
        n = len(f.readlines())
    if n == 1:
        raise ValueError("first attempt fails")
    return n


def always_fails() -> None:
    print("Running", flush=True)
    raise ValueError("fails every time")


def chief_waits_for_worker_failures(fifo: str) -> None:
    """The chief returns once a worker failed twice; the worker always fails."""
    if task_type() == "chief":
        # read-write: no EOF between two worker attempts
        with os.fdopen(os.open(fifo, os.O_RDWR), "r") as f:
            for _ in range(2):
                f.readline()
        return
    with open(fifo, "w") as f:  # blocks once the chief is gone: the chief stops it
        f.write("failing\n")
    raise ValueError("worker fails")


def worker_errors_other_blocks() -> None:
    if task()[1] == 1:
        blocked_in_known_function()
    raise ValueError("Worker 0 errored")


def with_barrier() -> str:
    from aioproc import cluster

    cluster.barrier()
    cluster.barrier()  # reusable
    return task_type()


def barrier_unless(index: int) -> str:
    """Task ``index`` returns at once; the others wait at the barrier."""
    from aioproc import cluster

    if task()[1] == index and task_type() == "worker":
        return "left"
    cluster.barrier()
    return "passed"


def barrier_rank(rank: int) -> int:
    """For aioproc.run: every rank meets at the barrier."""
    from aioproc import cluster

    cluster.barrier()
    return rank


def barrier_then_die() -> str:
    """worker-1 is SIGKILLed before the barrier; the others report what the barrier did."""
    from aioproc import cluster

    if task() == ("worker", 1):
        os.kill(os.getpid(), 9)
    try:
        cluster.barrier()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "passed"


def barrier_rank_leaves(rank: int) -> int:
    """For aioproc.run: rank 1 returns without reaching the barrier."""
    from aioproc import cluster

    if rank != 1:
        cluster.barrier()
    return rank


def cuda_visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def getpid() -> int:
    return os.getpid()


def sets_global(value: int) -> int | None:
    global V
    old, V = V, value
    return old


V: int | None = None


def nested_pool() -> list[int]:
    """Runs a pool of its own inside a pool worker."""
    import asyncio

    import aioproc

    async def main() -> list[int]:
        async with aioproc.open_pool({"worker": 2}) as pool:
            return await pool.run(os.getpid)  # type: ignore[no-any-return]

    return asyncio.run(main())


def kwargs_rank(rank: int, *, scale: int = 1, tag: str = "") -> tuple[int, str]:
    return rank * scale, tag


def with_barrier_unless_chief() -> str:
    """The workers meet at the barrier; the chief (run in the test process) does not."""
    if task_type() == "chief":
        return "chief"
    return with_barrier()


def threads_then_barrier(*_: Any) -> int:
    """The worker's thread count, then the barrier (which must still work)."""
    from aioproc import cluster

    threads = len(os.listdir("/proc/self/task"))
    cluster.barrier()
    return threads
