"""Coroutine worker functions for test_coroutine_groups.py (standard library only).

Imported by name in the workers (``helpers.import_child`` puts ``children/``
on the path), so they travel by reference.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from typing import Any

from aioproc import cluster, record


async def describe(x: int, *, add: int = 0) -> dict[str, Any]:
    """What the worker's loop is, with a value computed from the arguments."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(0)
    return {
        "value": 2 * x + add,
        "loop": type(loop).__module__.split(".")[0],
        "current": asyncio.get_event_loop() is loop,
        "pid": os.getpid(),
    }


async def _inner(text: str) -> None:
    await asyncio.sleep(0)
    raise ValueError(text)


async def fail(text: str) -> None:
    """Raise ValueError(text) two frames down, after a turn of the loop."""
    await _inner(text)


@record
async def recorded_fail(text: str) -> None:
    await _inner(text)


def coroutine_of(x: int) -> Any:
    """A sync function returning a coroutine (as ``lambda: describe(x)`` does)."""
    return describe(x, add=1)


class Methods:
    async def method(self, x: int) -> int:
        await asyncio.sleep(0)
        return x + 100


partial_describe = functools.partial(describe, add=5)


async def sleep_then_note(fifo: str, path: str, second: int = 0) -> None:
    """Say "ready <pid>" on ``fifo``, sleep 60 s; when cancelled, note it in ``path``.

    The note is written after an await, so the cleanup really runs on the
    loop; ``second``: a signal the cleanup sends this process first (which
    must neither cut it short nor change the exit status).
    """
    with open(fifo, "w") as f:
        f.write(f"ready {os.getpid()}\n")
    try:
        await asyncio.sleep(60)
    finally:
        if second:
            os.kill(os.getpid(), second)
        await asyncio.sleep(0.05)
        with open(path, "a") as f:
            f.write(f"finally {os.getpid()}\n")


async def ignore_cancellation(fifo: str) -> None:
    """Say "ready <pid>" on ``fifo``, then swallow every cancellation."""
    with open(fifo, "w") as f:
        f.write(f"ready {os.getpid()}\n")
    while True:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            continue


async def meet(path: str, rank: int, world_size: int) -> int:
    """Await the barrier twice while another task of this worker keeps running.

    Returns how many turns the other task took during the waits: more than
    zero only if the waits left the worker's loop free.
    """
    turns = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal turns
        while not stop.is_set():
            turns += 1
            await asyncio.sleep(0.001)

    task = asyncio.get_running_loop().create_task(ticker())
    with open(path, "a") as f:
        f.write(f"before {rank}\n")
    await cluster.abarrier()
    with open(path) as f:
        arrived = f.read().count("before")
    await cluster.abarrier()  # reusable
    stop.set()
    await task
    return turns if arrived == world_size else -1


async def blocking_barrier() -> str:
    """Call the blocking barrier() on the worker's running loop: an error."""
    try:
        cluster.barrier()
    except RuntimeError as e:
        return str(e)
    return "no error"


async def leave_or_wait(rank: int) -> str:
    """Rank 0 returns at once; the others await a barrier rank 0 never reaches."""
    if rank == 0:
        return "left"
    try:
        await cluster.abarrier()
    except threading.BrokenBarrierError as e:
        return f"broken: {e}"
    return "passed"


async def sleep_forever(cleanup: float = 0) -> None:
    """Sleep until stopped; the cleanup then takes ``cleanup`` seconds on the loop."""
    try:
        await asyncio.sleep(3600)
    finally:
        if cleanup:
            await asyncio.sleep(cleanup)


def legacy_loop() -> dict[str, Any]:
    """A sync worker on the loop ``asyncio.get_event_loop()`` gives (the old idiom)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        loop = asyncio.get_event_loop()
    try:
        return loop.run_until_complete(describe(1))
    finally:
        loop.close()


async def task_and_loop() -> tuple[str, int, str]:
    """A cluster task's ``(type, index)`` from ``TF_CONFIG``, and its loop's kind."""
    import json

    await asyncio.sleep(0)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return task["type"], task["index"], type(asyncio.get_running_loop()).__module__.split(".")[0]


async def rank_sum(a: int, b: int) -> tuple[int, str]:
    """An agent worker's value (from its ``LOCAL_RANK``), and its loop's kind."""
    await asyncio.sleep(0)
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    return a + b + int(os.environ["LOCAL_RANK"]), loop


async def subprocess_output(text: str) -> str:
    """Run ``echo text`` with asyncio's subprocess API on the worker's loop."""
    proc = await asyncio.create_subprocess_exec("echo", text, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return f"{out.decode().strip()} {proc.returncode}"


async def cluster_meet() -> str:
    """A cluster task awaiting the runner's barrier twice (its lifeline thread reads
    the channel meanwhile)."""
    await cluster.abarrier()
    await cluster.abarrier()
    return "met"
