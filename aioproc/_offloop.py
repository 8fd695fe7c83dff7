"""One helper thread for the blocking work of starting and stopping groups.

``Popen`` returns only once the child has exec'd (it waits on an error
pipe), which on a busy machine can take a scheduler slice or more per
worker; making a group's log tree (one directory per rank) and pruning it,
and scanning ``/proc`` for what is left in stopped groups, cost milliseconds
per hundred workers.  Run on the loop, each of these held it far longer
than a service embedding aioproc can afford (issue 12's P7: no callback
over 5 ms).  They run here instead, in order, on one thread that exists
only while some start or stop holds it: the supervisor's thread count does
not grow with its workers, and an idle supervisor has no extra thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ._shield import shielded

T = TypeVar("T")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_users = 0


@contextlib.contextmanager
def helper() -> Iterator[ThreadPoolExecutor]:
    """The helper thread, kept while the block runs (nested holds share it).

    A group's launch holds it across all its ranks, so they reuse one
    thread; when the last hold is released the idle thread is joined.
    """
    global _pool, _users
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="aioproc-helper")
        pool = _pool
        _users += 1
    try:
        yield pool
    finally:
        with _lock:
            _users -= 1
            idle = _users == 0 and _pool is pool
            if idle:
                _pool = None
        if idle:
            pool.shutdown(wait=True)  # nothing queued: the thread exits at once


async def run_blocking(fn: Callable[..., T], /, *args: object) -> T:
    """Run ``fn(*args)`` on the helper thread and return its result.

    Cancellation: ``fn`` runs to completion even if the caller is cancelled
    (a half-made log tree or a half-read ``/proc`` helps nobody); the
    cancellation is re-raised once it has returned.
    """
    loop = asyncio.get_running_loop()
    with helper() as pool:
        return await shielded(loop.run_in_executor(pool, fn, *args))


def _after_fork_in_child() -> None:
    # the thread does not exist in a forked child: it starts its own
    global _pool, _users, _lock
    _pool, _users, _lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
