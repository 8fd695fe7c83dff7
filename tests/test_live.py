"""``aioproc._cli.live.LiveView``: the rows it draws from real agent events.

The view on a real terminal is tested through the command in test_cli.py;
here it is drawn on an in-memory console of a given size.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import sys
import time
from pathlib import Path

import pytest

from aioproc import Usage
from aioproc.agent import AgentEvent, LocalElasticAgent, RestartPolicy, WorkerSpec

pytest.importorskip("rich", reason="rich is not installed: the live view is untested")

from rich.console import Console

from aioproc._cli import live
from aioproc._cli.live import LiveView


def drawn(view: LiveView, lines: int, columns: int = 100) -> list[str]:
    """What the view draws on a terminal of that size, right-stripped."""
    out = io.StringIO()
    console = Console(
        file=out, width=columns, height=lines, color_system=None, legacy_windows=False
    )
    console.print(view)
    return [line.rstrip() for line in out.getvalue().splitlines()]


async def test_a_stop_during_the_backoff_shows_the_group_stopped(tmp_path: Path) -> None:
    view = LiveView("flaky", 2, max_restarts=3, title="job.py")
    backoff = asyncio.Event()

    def on_event(event: AgentEvent) -> None:
        view.on_event(event)
        if event.kind == "restart_scheduled":
            backoff.set()

    spec = WorkerSpec(
        role="flaky",
        local_world_size=2,
        entrypoint=sys.executable,
        args=("-c", "raise SystemExit(3)"),
        max_restarts=3,
        restart_policy=RestartPolicy(initial_delay=3600),  # only stop() ends it
    )
    agent = LocalElasticAgent(spec, log_dir=str(tmp_path), on_event=on_event)
    running = asyncio.ensure_future(agent.run())
    try:
        await asyncio.wait_for(backoff.wait(), 20)
        assert "restarting" in drawn(view, 40)[0]
        await asyncio.wait_for(agent.stop(), 20)
        await running
    finally:
        await agent.stop()
        await asyncio.gather(running, return_exceptions=True)
    screen = drawn(view, 40)
    assert screen[0] == "job.py [flaky x2] stopped  restarts 0/3"  # none happened
    rows = [line.split() for line in screen[2:4]]
    assert [row[0] for row in rows] == ["0", "1"]
    assert all(row[2] == "stopped" for row in rows), screen


def test_more_ranks_than_half_the_terminal_give_one_row_per_state() -> None:
    view = LiveView("w", 24, title="train.py")
    for rank in range(24):
        view.on_event(AgentEvent("worker_started", "w", 0, local_rank=rank, pid=1000 + rank))
    for rank in (4, 9, 10, 11):
        view.on_event(AgentEvent("worker_exited", "w", 0, local_rank=rank, exitcode=0))
    view.on_event(
        AgentEvent("worker_exited", "w", 0, local_rank=23, exitcode=-15, signal="SIGTERM")
    )
    view.lines(7, "stdout", "[w7]:", ["epoch 1 loss 0.5"])
    screen = drawn(view, lines=20)
    assert len(screen) <= 10  # half the terminal: the workers' lines keep the rest
    assert screen[0] == "train.py [w x24] starting  restarts 0/0"
    assert screen[1].split() == [
        "running",
        "19",
        "ranks",
        "0-3,5-8,12-22",
        "[7]",
        "epoch",
        "1",
        "loss",
        "0.5",
    ]
    assert screen[2].split() == ["exited", "0", "4", "ranks", "4,9-11"]
    assert screen[3].split() == ["killed", "by", "SIGTERM", "1", "rank", "23"]
    assert screen[4:] == [""]  # where the cursor waits
    # a terminal tall enough: the whole table, one row per rank
    assert len(drawn(view, lines=60)) == 1 + 1 + 24 + 1


def test_many_states_fit_in_the_room_left() -> None:
    view = LiveView("w", 12, title="t")
    for rank in range(12):
        view.on_event(AgentEvent("worker_started", "w", 0, local_rank=rank, pid=rank + 1))
        view.on_event(AgentEvent("worker_exited", "w", 0, local_rank=rank, exitcode=rank))
    screen = drawn(view, lines=10)
    assert len(screen) <= 5, screen
    assert screen[-2].split()[:5] == ["10", "other", "states", "10", "ranks"], screen


# ------------------------------------------------------------ usage figures


def test_a_running_rank_shows_its_cpu_and_rss(monkeypatch: pytest.MonkeyPatch) -> None:
    view = LiveView("w", 2, title="t")
    for rank in range(2):
        view.on_event(AgentEvent("worker_started", "w", 0, local_rank=rank, pid=4000 + rank))

    def usage(cpu_time: float, rss: int) -> Usage:
        return Usage(cpu_time, cpu_time, 0.0, rss, rss=rss)

    # rank 0 used 97% of a CPU between the two samples, rank 1 a quarter of one
    figures = {4000: [usage(0, 100 << 20), usage(1.94, 212 << 20)], 4001: [usage(0, 3 << 30)]}
    figures[4001].append(usage(0.5, 1536 << 20))
    monkeypatch.setattr(live, "sample", lambda pid: figures[pid].pop(0))
    now = time.monotonic()
    view.sample(now=now + 1)
    view.sample(now=now + 3)
    rows = [line.split() for line in drawn(view, 40, columns=120)[2:4]]
    assert rows[0][:3] == ["0", "4000", "running"], rows
    assert rows[0][5:] == ["cpu", "97%", "rss", "212M"], rows
    assert rows[1][5:] == ["cpu", "25%", "rss", "1.5G"], rows


def test_the_sample_reads_the_kernels_figures_of_a_real_process() -> None:
    view = LiveView("w", 1, title="t")
    view.on_event(AgentEvent("worker_started", "w", 0, local_rank=0, pid=os.getpid()))
    view.sample()
    row = drawn(view, 40, columns=120)[2]
    assert re.search(r" cpu \d+% rss \d+(\.\d)?[KMG]$", row), row


def test_a_rank_that_exited_is_not_sampled(monkeypatch: pytest.MonkeyPatch) -> None:
    view = LiveView("w", 1, title="t")
    view.on_event(AgentEvent("worker_started", "w", 0, local_rank=0, pid=4000))
    view.on_event(AgentEvent("worker_exited", "w", 0, local_rank=0, pid=4000, exitcode=0))

    def never(pid: int) -> None:
        raise AssertionError(f"pid {pid} was read after its exit")

    monkeypatch.setattr(live, "sample", never)
    view.sample()
    assert "cpu" not in drawn(view, 40)[2]


def test_an_oom_killed_rank_shows_oom_and_the_end_shows_each_ranks_usage() -> None:
    view = LiveView("w", 2, title="t")
    for rank in range(2):
        view.on_event(AgentEvent("worker_started", "w", 0, local_rank=rank, pid=4000 + rank))
    oom = "killed by the kernel's OOM killer: memory limit 64 MiB reached"
    view.on_event(
        AgentEvent(
            "worker_exited", "w", 0, local_rank=0, pid=4000, exitcode=-9, signal="SIGKILL", oom=oom
        )
    )
    view.on_event(
        AgentEvent("worker_exited", "w", 0, local_rank=1, pid=4001, exitcode=-15, signal="SIGTERM")
    )
    view.show_usage(
        {
            0: Usage(cpu_time=12.34, user_time=12.0, system_time=0.34, max_rss=64 << 20),
            1: Usage(cpu_time=75.0, user_time=70.0, system_time=5.0, max_rss=3 << 30),
        }
    )
    rows = [line.split() for line in drawn(view, 40, columns=120)[2:4]]
    assert rows[0][:3] == ["0", "4000", "oom"], rows
    assert rows[0][5:] == ["cpu", "12.3s", "max", "rss", "64M"], rows
    assert rows[1][2:5] == ["killed", "by", "SIGTERM"], rows
    assert rows[1][-5:] == ["cpu", "1m15s", "max", "rss", "3.0G"], rows
