"""Worker functions of test_peer_wait.py: ranks that return early, late, or never.

Standard library only.  The early ranks write ``"<rank> <pid>"`` to the FIFO
``fifo`` just before they return; the last rank reads those lines, so it knows
every early rank is about to return.
"""

from __future__ import annotations

import os
import signal
import threading
import time


def _state(pid: int) -> str:
    """The process's state letter in /proc ("Z": exited, unreaped; "gone": reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _early(rank: int, fifo: str) -> None:
    with open(fifo, "w") as f:
        f.write(f"{rank} {os.getpid()}\n")


def _wait_for_early(n: int, fifo: str) -> dict[int, int]:
    """``{rank: pid}`` of the ``n`` early ranks, once each wrote its line."""
    # O_RDWR: never blocks, never sees EOF between the writers
    with os.fdopen(os.open(fifo, os.O_RDWR), "r") as f:
        pids = {}
        for _ in range(n):
            rank, pid = f.readline().split()
            pids[int(rank)] = int(pid)
    return pids


def _barrier_left() -> str:
    """Why the barrier broke: the first early rank returned, so it cannot come."""
    from aioproc import cluster

    try:
        cluster.barrier()
    except threading.BrokenBarrierError as e:
        return str(e)
    raise AssertionError("the barrier passed, but the early ranks never reach it")


def last_returns_after_watching(rank: int, last: int, fifo: str) -> object:
    """Ranks before ``last`` return at once; ``last`` returns what it saw of them.

    It waits until every early rank is returning, and until the barrier
    broke (an early rank has returned: it can never reach the barrier),
    then looks at the early ranks' processes in /proc: it returns their
    states and the time it returns, with the barrier's message.
    """
    if rank != last:
        _early(rank, fifo)
        return rank
    pids = _wait_for_early(last, fifo)
    broken = _barrier_left()
    states = {r: _state(pid) for r, pid in pids.items()}
    return {"broken": broken, "states": states, "pids": pids, "returned_at": time.time()}


def returns_then_peer_fails(rank: int) -> int:
    """Rank 0 returns (ignoring SIGTERM from then on); rank 1 fails once it has."""
    if rank == 0:
        # only the group's word (TERMINATE) ends its wait now, never the stop's SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return 0
    _barrier_left()  # broken: rank 0 has returned
    raise RuntimeError("rank 1 fails after rank 0 returned")


def returns_then_peer_hangs(rank: int, fifo: str) -> int:
    """Rank 0 returns (ignoring SIGTERM from then on); rank 1 then hangs until stopped."""
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return 0
    _barrier_left()  # broken: rank 0 has returned
    _early(rank, fifo)  # tells the test: rank 0 holds, rank 1 hangs
    threading.Event().wait()
    return rank


def gloo_all_reduce(rank: int, world: int, port: int) -> int:
    """A gloo all_reduce that never destroys its process group (torch installed)."""
    import datetime

    import torch
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=30)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return int(total.item())  # no destroy_process_group(): torch's users often forget it
