"""Helpers for the body of a test run on several ranks (``@pytest.mark.aioproc``).

They read the environment the plugin gives every rank, so they also work in
any worker started with torch's variables (``aioproc run``, an agent).
"""

from __future__ import annotations

import json
import os

__all__ = ["abarrier", "barrier", "rank", "task", "world_size"]


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(
            f"${name} is not set: aioproc.testing works inside a rank of a test marked "
            "@pytest.mark.aioproc (or a worker with torch's environment)"
        )
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"${name} must be an integer, got {value!r}") from None


def rank() -> int:
    """This process's rank, ``0 .. world_size() - 1`` (``$RANK``).

    Raises:
        RuntimeError: not inside a rank.
    """
    return _env_int("RANK")


def world_size() -> int:
    """How many ranks run the test (``$WORLD_SIZE``).

    Raises:
        RuntimeError: not inside a rank.
    """
    return _env_int("WORLD_SIZE")


def task() -> tuple[str, int]:
    """This rank's ``(task_type, task_index)`` in a cluster test (``$TF_CONFIG``).

    Raises:
        RuntimeError: not inside a rank of a test marked with ``cluster=``.
    """
    raw = os.environ.get("TF_CONFIG")
    if raw is None:
        raise RuntimeError(
            "$TF_CONFIG is not set: aioproc.testing.task() works inside a rank of a test "
            "marked @pytest.mark.aioproc(cluster=...)"
        )
    spec = json.loads(raw)["task"]
    return str(spec["type"]), int(spec["index"])


def barrier() -> None:
    """Block until every rank of the test reached its ``barrier()`` call.

    The n-th call of each rank meets the n-th call of the others.  It is
    :func:`aioproc.cluster.barrier`, carried over each rank's control channel
    to the plugin's supervisor; it blocks the calling thread.  An async body
    awaits :func:`abarrier` instead: ``barrier()`` on the rank's running
    event loop is an error (it would block the loop, the rank's stop with it).

    Raises:
        RuntimeError: not inside a rank (or another function worker of
            aioproc), or called on a running event loop.
        threading.BrokenBarrierError: a rank ended, passing or failing,
            without reaching the barrier; the message names it.
    """
    # the worker's bootstrap is loaded already: this costs no import
    from ._child.boot import barrier_wait

    barrier_wait()


async def abarrier() -> None:
    """``barrier()`` for an ``async def`` body: the rank's event loop keeps running.

    The same barrier as :func:`barrier` (the n-th call of each rank, sync or
    async, meets the n-th call of the others), awaited.

    Raises:
        RuntimeError: not inside a rank (or another function worker of aioproc).
        threading.BrokenBarrierError: a rank ended, passing or failing,
            without reaching the barrier; the message names it.
    """
    from ._child.boot import abarrier_wait

    await abarrier_wait()
