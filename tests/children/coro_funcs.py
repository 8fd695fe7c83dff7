"""Coroutine (and a few sync) functions that tests/test_coroutine_calls.py sends to workers.

Standard library only; ``aioproc`` is imported inside the functions that
read the worker state.  The tests put this directory on ``sys.path``, so
the functions travel by reference.  A function that must be in the middle of
its call writes a line to a FIFO the test reads before it acts.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any


def announce(fifo: str, text: str) -> None:
    """One line to the test's FIFO (one small write: atomic on a pipe)."""
    fd = os.open(fifo, os.O_WRONLY)
    try:
        os.write(fd, f"{text}\n".encode())
    finally:
        os.close(fd)


async def stamped_sleep(seconds: float) -> tuple[float, float, int]:
    """Sleep on the worker's loop: when it began and ended (``time.monotonic``), and the pid."""
    began = time.monotonic()
    await asyncio.sleep(seconds)
    return began, time.monotonic(), os.getpid()


async def ticks(n: int, period: float) -> list[float]:
    """``n`` times: the time, then a sleep of ``period`` on the loop."""
    out = []
    for _ in range(n):
        out.append(time.monotonic())
        await asyncio.sleep(period)
    return out


def sync_block(seconds: float) -> tuple[float, float]:
    """Block the worker's thread (and so its loop): when it began and ended."""
    began = time.monotonic()
    time.sleep(seconds)
    return began, time.monotonic()


async def other_tasks() -> int:
    """Tasks on the worker's loop besides this call's own."""
    return len(asyncio.all_tasks()) - 1


async def loop_type() -> str:
    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__qualname__}"


def asyncio_loaded() -> bool:
    return "asyncio" in sys.modules


async def async_noop() -> None:
    return None


def returns_coroutine(seconds: float) -> Any:
    """A sync function whose value is a coroutine: the worker runs it on its loop."""
    return stamped_sleep(seconds)


# ------------------------------------------------------------- state, init


async def async_init(tag: str) -> dict[str, Any]:
    """An ``async def`` initializer: its value is the worker state."""
    await asyncio.sleep(0)
    return {"tag": tag, "loop": await loop_type(), "started": 0, "ended": 0, "events": []}


def dict_init() -> dict[str, Any]:
    return {"started": 0, "ended": 0, "events": []}


async def failing_async_init() -> None:
    await asyncio.sleep(0)
    raise LookupError("async init failed on purpose")


def read_state() -> Any:
    import aioproc

    return aioproc.worker_state()


async def read_state_async() -> Any:
    import aioproc

    await asyncio.sleep(0)
    return aioproc.worker_state()


async def guarded(key: str, seconds: float, fifo: str | None = None) -> str:
    """Sleep ``seconds``, recording in the worker state how it ended.

    ``started``/``ended`` count every call (the ``finally`` block counts the
    end); ``events`` gets ``(key, "cancelled")`` when the sleep was
    cancelled.  With ``fifo``, the pid is announced once the call is inside
    the sleep.
    """
    import aioproc

    state = aioproc.worker_state()
    state["started"] += 1
    try:
        if fifo is not None:
            announce(fifo, str(os.getpid()))
        await asyncio.sleep(seconds)
        return key
    except asyncio.CancelledError:
        state["events"].append((key, "cancelled"))
        raise
    finally:
        state["ended"] += 1


async def guarded_to_file(path: str, fifo: str, seconds: float) -> None:
    """Sleep; write "finally" to ``path`` when the sleep ends however it ends."""
    try:
        announce(fifo, str(os.getpid()))
        await asyncio.sleep(seconds)
    finally:
        with open(path, "a") as f:
            f.write(f"finally {os.getpid()}\n")


async def ignores_cancellation(fifo: str, seconds: float) -> None:
    """Keeps sleeping through every cancellation (a misbehaving coroutine)."""
    announce(fifo, str(os.getpid()))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            await asyncio.sleep(deadline - time.monotonic())
        except asyncio.CancelledError:
            continue


async def announce_then_sleep(fifo: str, seconds: float) -> int:
    announce(fifo, str(os.getpid()))
    await asyncio.sleep(seconds)
    return os.getpid()


async def async_exit(code: int) -> None:
    await asyncio.sleep(0)
    sys.exit(code)


async def returns_unpicklable() -> Any:
    import threading

    await asyncio.sleep(0)
    return threading.Lock()


async def raises_value_error(text: str) -> None:
    await asyncio.sleep(0)
    raise ValueError(text)


async def cancels_itself() -> None:
    """Ends by a cancellation nobody outside the worker asked for."""
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    await asyncio.sleep(1)


async def random_sleep(seed: int) -> int:
    """A short sleep of a length picked by ``seed``: some calls end before their cancel comes."""
    import aioproc

    state = aioproc.worker_state()
    state["started"] += 1
    try:
        await asyncio.sleep((seed % 7) * 0.001)
        return seed
    finally:
        state["ended"] += 1


def announce_then_block(fifo: str, seconds: float) -> int:
    """A sync call that holds its worker: announces the pid, then blocks ``seconds``."""
    announce(fifo, str(os.getpid()))
    time.sleep(seconds)
    return os.getpid()


async def ticks_announced(fifo: str, n: int, period: float) -> list[float]:
    """``ticks``, announcing the pid after the first tick."""
    out = [time.monotonic()]
    announce(fifo, str(os.getpid()))
    for _ in range(n - 1):
        await asyncio.sleep(period)
        out.append(time.monotonic())
    return out


def sync_inside_the_loop() -> tuple[str, str]:
    """A sync call once the worker's loop runs: the loop it finds, what ``asyncio.run`` says."""
    loop = asyncio.get_running_loop()
    coro = asyncio.sleep(0)
    try:
        asyncio.run(coro)
    except RuntimeError as e:
        said = str(e)
    else:
        said = "asyncio.run() ran"
    finally:
        coro.close()
    return f"{type(loop).__module__}.{type(loop).__qualname__}", said
