"""Function workers wait for their local peers after returning, as torch's do.

torch's ``start_processes`` keeps each worker alive, once its function
returned, until the agent has read every local worker's result; a gloo job
that never destroys its process group then never has a rank tear it down
while the others still use it (they would abort).  aioproc's one-shot
function workers do the same: after their result, they wait for the group's
TERMINATE, sent once every rank has an outcome, or as soon as the group is
stopped (before the stop's signal, so a worker that ignores the signal exits
all the same).  Worker functions live in ``children/peer_wait_funcs.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import free_port, import_child, pid_gone
from proc_utils import Fifo

import aioproc
from aioproc.context import WorkerEvent


@pytest.fixture
def pw(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The worker functions, importable here and (by name) in the workers."""
    return import_child(monkeypatch, "peer_wait_funcs")


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_every_rank_lives_until_the_slowest_returned_then_all_exit(
    pw: ModuleType, tmp_path: Path, start_method: str
) -> None:
    fifo = str(tmp_path / "early")
    os.mkfifo(fifo)
    n = 3
    exits: dict[int, WorkerEvent] = {}

    def on_event(event: WorkerEvent) -> None:
        if event.kind == "exited":
            exits[event.local_rank] = event

    async with aioproc.start_processes(
        "peers",
        pw.last_returns_after_watching,
        {r: (r, n - 1, fifo) for r in range(n)},
        {r: {} for r in range(n)},
        logs_specs=aioproc.DefaultLogsSpecs(log_dir=os.devnull),
        start_method=start_method,
        on_event=on_event,
    ) as pc:
        pids = pc.pids()
        result = await pc.wait()
    assert result is not None and not result.is_failed(), result.failures
    watched = result.return_values[n - 1]
    assert result.return_values == {0: 0, 1: 1, n - 1: watched}
    assert watched["pids"] == {r: pids[r] for r in range(n - 1)}
    # an early rank had returned (it left the barrier for good), yet no early
    # rank had exited: each was alive while the slowest rank had not returned
    assert watched["broken"].startswith("barrier broken: peers/")
    assert watched["broken"].endswith(" exited with code 0 without reaching it")
    assert set(watched["states"].values()) <= {"R", "S"}, watched["states"]
    # then all exited, by themselves (code 0), after the slowest returned
    assert sorted(exits) == list(range(n))
    assert {e.exitcode for e in exits.values()} == {0}
    assert min(e.time for e in exits.values()) >= watched["returned_at"]
    assert all(pid_gone(pid) for pid in pids.values())


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_a_rank_that_returns_before_its_launch_is_over_still_breaks_the_barrier(
    pw: ModuleType, tmp_path: Path, start_method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Early ranks whose results arrive while the supervisor is still finishing
    their launches (a loaded machine, a forkserver's replies) have left the
    barrier for good all the same: the rank waiting there is told so, and the
    group ends, instead of waiting for ranks that will never come."""
    from aioproc._group.rank_launcher import RankLauncher
    from aioproc._supervisor.hold import Hold

    launch, hold_returned = RankLauncher.launch, Hold.returned
    n = 3
    early: set[int] = set()
    all_returned = asyncio.Event()

    async def slow_launch(self: RankLauncher, rank: int, *args: Any, **kwargs: Any) -> Any:
        child = await launch(self, rank, *args, **kwargs)
        if rank < n - 1:
            await all_returned.wait()  # every early result is in before its launch is over
        return child

    def result_in(self: Hold, rank: int) -> None:
        hold_returned(self, rank)
        early.add(rank)
        if len(early) == n - 1:
            all_returned.set()

    monkeypatch.setattr(RankLauncher, "launch", slow_launch)
    monkeypatch.setattr(Hold, "returned", result_in)
    fifo = str(tmp_path / "early")
    os.mkfifo(fifo)
    async with aioproc.start_processes(
        "peers",
        pw.last_returns_after_watching,
        {r: (r, n - 1, fifo) for r in range(n)},
        {r: {} for r in range(n)},
        logs_specs=aioproc.DefaultLogsSpecs(log_dir=os.devnull),
        start_method=start_method,
    ) as pc:
        result = await asyncio.wait_for(pc.wait(), 30)  # a hang fails here, not at the timeout
    assert result is not None and not result.is_failed(), result.failures
    assert result.return_values[n - 1]["broken"].startswith("barrier broken: peers/")


async def test_a_held_rank_exits_at_once_when_a_peer_fails(pw: ModuleType) -> None:
    # rank 0 returned and ignores SIGTERM: only the group's TERMINATE ends its
    # wait; a SIGKILL after the grace period would warn (ForcedKillWarning: an error)
    began = time.monotonic()
    with pytest.raises(aioproc.ChildFailedError) as info:
        await aioproc.run(
            pw.returns_then_peer_fails,
            2,
            args={r: (r,) for r in range(2)},
            logs_specs=aioproc.DefaultLogsSpecs(log_dir=os.devnull),
            grace_period=30,
        )
    assert time.monotonic() - began < 10  # not the grace period
    assert str(info.value.__cause__) == "rank 1 fails after rank 0 returned"
    assert sorted(info.value.failures) == [1]


async def test_a_group_stopped_with_a_hung_rank_lets_its_held_ranks_go(
    pw: ModuleType, tmp_path: Path
) -> None:
    async with Fifo(tmp_path / "hung") as fifo:
        async with aioproc.start_processes(
            "hung",
            pw.returns_then_peer_hangs,
            {r: (r, fifo.path) for r in range(2)},
            {r: {} for r in range(2)},
            logs_specs=aioproc.DefaultLogsSpecs(log_dir=os.devnull),
        ) as pc:
            pids = pc.pids()
            assert await fifo.lines(1) == [f"1 {pids[1]}"]  # rank 0 returned, rank 1 hangs
            began = time.monotonic()
            await pc.close(signal.SIGTERM, 30)
            stopped_in = time.monotonic() - began
            result = pc.poll()
    assert stopped_in < 10  # the held rank did not wait for the grace period
    assert result is not None
    assert result.return_values == {0: 0}  # it had returned: its value stands
    assert sorted(result.failures) == [1]
    assert result.failures[1].exitcode == -signal.SIGTERM
    assert all(pid_gone(pid) for pid in pids.values())


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
@pytest.mark.loops("asyncio", reason="the supervisor's loop plays no part in gloo's teardown")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", range(8))  # 8 runs, each its own test: xdist spreads them
async def test_gloo_without_destroy_process_group_never_aborts(pw: ModuleType, run: int) -> None:
    # Without the wait, a rank exiting while the others still tore down their
    # gloo pairs made one of them abort ("terminate called without an active
    # exception", SIGABRT): 5 of 10 such runs on a 2-core machine.  8 runs
    # miss that with a chance of 1 in 256.
    world = 4
    port = free_port()
    result = await aioproc.run(
        pw.gloo_all_reduce,
        world,
        args={r: (r, world, port) for r in range(world)},
        logs_specs=aioproc.DefaultLogsSpecs(log_dir=os.devnull),
    )
    assert result.return_values == {r: world * (world + 1) // 2 for r in range(world)}
