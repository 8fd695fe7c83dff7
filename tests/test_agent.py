"""LocalElasticAgent: torchrun's env, restarts with backoff, attempts' logs, events."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import logging
import os
import signal
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import pid_gone
from proc_utils import Fifo

import aioproc
import aioproc.metrics
from aioproc import Std
from aioproc._limits.cgroups import discover
from aioproc._metrics import hooks
from aioproc.agent import (
    AgentEvent,
    LocalElasticAgent,
    RestartPolicy,
    WorkerSpec,
    WorkerState,
    open_agent,
)
from aioproc.agent.events import EventHub
from aioproc.rendezvous import RendezvousParameters
from aioproc.rendezvous.static import StaticRendezvousHandler

FLAKY = str(Path(__file__).parent / "children" / "agent_flaky.py")


def flaky_spec(fail_on: str, n: int = 2, **kw: object) -> WorkerSpec:
    return WorkerSpec(
        role="trainer",
        local_world_size=n,
        entrypoint=sys.executable,
        args=(FLAKY, fail_on, "rank=${local_rank}"),
        redirects=Std.ALL,
        **kw,  # type: ignore[arg-type]
    )


def run_dir(log_dir: Path) -> Path:
    (only,) = list(log_dir.iterdir())
    return only


def reports(log_dir: Path, attempt: int, n: int) -> list[dict]:
    out = []
    for rank in range(n):
        text = (run_dir(log_dir) / f"attempt_{attempt}" / str(rank) / "stdout.log").read_text()
        out.append(json.loads(text))
    return out


async def test_torch_positional_order_template_and_worker_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # torch >= 2.2: LocalElasticAgent(spec, logs_specs, start_method,
    # exit_barrier_timeout, log_line_prefix_template)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # a parent value passes
    monkeypatch.delenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", raising=False)
    spec = flaky_spec("", n=2, master_port=29541)
    spec.redirects, spec.tee = Std.NONE, Std.ALL
    logs = aioproc.DefaultLogsSpecs(log_dir=str(tmp_path), tee=Std.ALL)
    agent = LocalElasticAgent(spec, logs, "spawn", 30, "<${role_name}:${rank}> ")
    before = dict(os.environ)
    group = agent.get_worker_group()
    assert group.state == WorkerState.INIT and group.spec is spec
    assert [(w.local_rank, w.global_rank, w.id) for w in group.workers] == [
        (0, -1, None),
        (1, -1, None),
    ]
    assert (group.group_rank, group.group_world_size, group.master_port) == (None, None, None)
    seen: list[tuple[WorkerState, list[int | None]]] = []

    def on_event(event: AgentEvent) -> None:
        if event.kind == "worker_started" and event.local_rank == 1:
            g = agent.get_worker_group()
            seen.append((g.state, [w.id for w in g.workers]))

    agent.add_event_handler(on_event)
    result = await agent.run()
    assert result.state == WorkerState.SUCCEEDED
    assert dict(os.environ) == before  # the template never went through os.environ
    lines = capfd.readouterr().out.splitlines()
    for rank in (0, 1):
        (line,) = [x for x in lines if x.startswith(f"<trainer:{rank}> ")]
        env = json.loads(line.split(" ", 1)[1])["env"]
        assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] is None
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert agent.get_worker_group() is group
    assert group.state == WorkerState.SUCCEEDED
    assert (group.group_rank, group.group_world_size) == (0, 1)
    assert (group.master_addr, group.master_port) == ("127.0.0.1", 29541)
    assert [
        (w.local_rank, w.global_rank, w.role_rank, w.world_size, w.role_world_size)
        for w in group.workers
    ] == [(0, 0, 0, 2, 2), (1, 1, 1, 2, 2)]
    ((state, ids),) = seen
    assert state == WorkerState.HEALTHY
    assert ids == [agent.pids()[0], agent.pids()[1]] and all(ids)


def test_old_positional_order_and_bad_template_are_clear_errors(tmp_path: Path) -> None:
    spec = flaky_spec("", n=1)
    with pytest.raises(TypeError) as info:
        LocalElasticAgent(spec, "spawn")  # type: ignore[arg-type]
    assert str(info.value) == (
        "logs_specs must be a LogsSpecs (the second argument, as in torch >= 2.2), got 'spawn'"
    )
    with pytest.raises(TypeError, match=r"^log_line_prefix_template must be a str, got 3$"):
        LocalElasticAgent(spec, None, "spawn", 300, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^give log_dir='x' or logs_specs, not both"):
        LocalElasticAgent(spec, aioproc.DefaultLogsSpecs(log_dir=str(tmp_path)), log_dir="x")
    with pytest.raises(TypeError):
        LocalElasticAgent(spec, None, "spawn", 300, None, str(tmp_path))  # type: ignore[misc]


async def test_workers_get_torchruns_environment(tmp_path: Path) -> None:
    agent = LocalElasticAgent(
        flaky_spec("", n=3, master_port=29533), log_dir=str(tmp_path), run_id="job7"
    )
    result = await agent.run()
    assert result.state == WorkerState.SUCCEEDED
    assert not result.is_failed()
    assert result.return_values == {0: None, 1: None, 2: None}
    for rank, rep in enumerate(reports(tmp_path, 0, 3)):
        env = rep["env"]
        error_file = run_dir(tmp_path) / "attempt_0" / str(rank) / "error.json"
        expected_omp = os.environ.get("OMP_NUM_THREADS", "1")
        assert env == {
            "LOCAL_RANK": str(rank),
            "RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_NAME": "trainer",
            "LOCAL_WORLD_SIZE": "3",
            "WORLD_SIZE": "3",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29533",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "3",
            "TORCHELASTIC_RUN_ID": "job7",
            "TORCHELASTIC_ERROR_FILE": str(error_file),
            "OMP_NUM_THREADS": expected_omp,
            "TORCHELASTIC_USE_AGENT_STORE": "False",  # no agent store to connect to
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
            ),
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": None,
        }
        assert rep["argv"] == [f"rank={rank}"]
    assert run_dir(tmp_path).name.startswith("job7_")


async def test_free_master_port_when_not_given(tmp_path: Path) -> None:
    result = await LocalElasticAgent(flaky_spec("", n=1), log_dir=str(tmp_path)).run()
    assert result.state == WorkerState.SUCCEEDED
    port = int(reports(tmp_path, 0, 1)[0]["env"]["MASTER_PORT"])
    assert 0 < port < 65536


async def test_fails_twice_then_succeeds_with_two_restarts(tmp_path: Path) -> None:
    events: list[AgentEvent] = []
    agent = LocalElasticAgent(
        flaky_spec("0,1", max_restarts=2), log_dir=str(tmp_path), on_event=events.append
    )
    result = await agent.run()
    assert result.state == WorkerState.SUCCEEDED
    assert agent.restart_count == 2
    attempts = sorted(p.name for p in run_dir(tmp_path).iterdir())
    assert attempts == ["attempt_0", "attempt_1", "attempt_2"]
    for attempt in (0, 1):
        err = run_dir(tmp_path) / f"attempt_{attempt}" / "0" / "stderr.log"
        assert err.read_text() == f"failing on attempt {attempt}\n"
    kinds = [e.kind for e in events]
    assert kinds.count("restart_scheduled") == 2
    assert kinds.count("attempt_failed") == 2
    assert kinds[-1] == "group_succeeded"
    assert kinds.count("worker_started") == 6
    failed = [e for e in events if e.kind == "attempt_failed"]
    assert [e.exitcode for e in failed] == [3, 3]


async def test_the_root_cause_leads_the_failures_before_the_ranks_it_stopped() -> None:
    """torch's ChildFailedError takes the first failure of the earliest second
    as the root cause: rank 1's exit must come before rank 0, stopped for it."""
    code = "import sys, time\nif sys.argv[1] == '1': sys.exit(3)\ntime.sleep(60)"
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        entrypoint=sys.executable,
        args=("-c", code, "${local_rank}"),
    )
    result = await LocalElasticAgent(spec, log_dir=os.devnull).run()
    assert result.state == WorkerState.FAILED
    assert [(r, f.exitcode) for r, f in result.failures.items()] == [
        (1, 3),
        (0, -signal.SIGTERM),
    ]


async def test_fails_with_too_few_restarts_and_keeps_both_attempts_logs(tmp_path: Path) -> None:
    agent = LocalElasticAgent(flaky_spec("0,1", max_restarts=1), log_dir=str(tmp_path))
    result = await agent.run()
    assert result.state == WorkerState.FAILED
    assert result.is_failed()
    codes = {rank: f.exitcode for rank, f in result.failures.items()}
    assert 3 in codes.values()
    for attempt in (0, 1):
        # rank 0 always reports before failing (rank 1 may be stopped before it prints)
        log = run_dir(tmp_path) / f"attempt_{attempt}" / "0" / "stdout.log"
        assert json.loads(log.read_text())["env"]["TORCHELASTIC_RESTART_COUNT"] == str(attempt)
        assert (run_dir(tmp_path) / f"attempt_{attempt}" / "1" / "stdout.log").exists()
    assert not (run_dir(tmp_path) / "attempt_2").exists()


async def test_backoff_delays_between_attempts_follow_the_policy(tmp_path: Path) -> None:
    policy = RestartPolicy(initial_delay=0.2, factor=2.0, max_delay=0.5)
    events: list[AgentEvent] = []
    agent = LocalElasticAgent(
        flaky_spec("0,1,2", n=1, max_restarts=3, restart_policy=policy),
        log_dir=str(tmp_path),
        on_event=events.append,
    )
    result = await agent.run()
    assert result.state == WorkerState.SUCCEEDED
    scheduled = [e.delay for e in events if e.kind == "restart_scheduled"]
    assert scheduled == [0.2, 0.4, 0.5]
    starts = [reports(tmp_path, a, 1)[0]["t"] for a in range(4)]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    for gap, delay in zip(gaps, scheduled, strict=True):
        # the gap is the delay plus one interpreter start; never shorter than the delay
        assert delay <= gap < delay + 2.0, (gaps, scheduled)


def test_restart_policy_delays() -> None:
    p = RestartPolicy(initial_delay=1, factor=3, max_delay=20, jitter=0.5)
    assert [p.delay(n, rng=lambda a, b: 1.0) for n in range(4)] == [1, 3, 9, 20]
    assert p.delay(0, rng=lambda a, b: a) == 0.5
    assert p.delay(0, rng=lambda a, b: b) == 1.5
    with pytest.raises(ValueError, match="factor"):
        RestartPolicy(factor=0.5)
    with pytest.raises(ValueError, match="jitter"):
        RestartPolicy(jitter=2)


async def test_expected_exit_code_ends_the_run_without_restart(tmp_path: Path) -> None:
    policy = RestartPolicy(expected_exit_codes=frozenset({3}))
    agent = LocalElasticAgent(
        flaky_spec("0", n=1, max_restarts=3, restart_policy=policy), log_dir=str(tmp_path)
    )
    result = await agent.run()
    assert result.state == WorkerState.SUCCEEDED
    assert result.failures[0].exitcode == 3
    assert agent.restart_count == 0


async def test_reset_after_restores_the_restart_budget(tmp_path: Path) -> None:
    # every attempt "stays up" longer than reset_after=1e-6 s: the budget of 1 restart is
    # restored each time, so three failures in a row are survived
    policy = RestartPolicy(reset_after=1e-6)
    agent = LocalElasticAgent(
        flaky_spec("0,1,2", n=1, max_restarts=1, restart_policy=policy), log_dir=str(tmp_path)
    )
    result = await agent.run()
    assert result.state == WorkerState.SUCCEEDED
    assert agent.restart_count == 3


async def test_events_async_iterator_sees_the_whole_run(tmp_path: Path) -> None:
    agent = LocalElasticAgent(flaky_spec("", n=2), log_dir=str(tmp_path))
    stream = agent.events()

    async def collect() -> list[str]:
        return [e.kind async for e in stream]

    collector = asyncio.create_task(collect())
    result = await agent.run()
    kinds = await asyncio.wait_for(collector, 5)
    assert result.state == WorkerState.SUCCEEDED
    assert kinds[0] == "attempt_started"
    assert kinds.count("worker_started") == 2
    assert kinds.count("worker_exited") == 2
    assert kinds[-1] == "group_succeeded"


def add(a: int, b: int) -> int:
    return a + b + int(os.environ["LOCAL_RANK"])


async def test_function_workers_return_values_by_rank() -> None:
    spec = WorkerSpec(role="fn", local_world_size=3, entrypoint=add, args=(1, 2))
    result = await LocalElasticAgent(spec).run()
    assert result.return_values == {0: 3, 1: 4, 2: 5}


async def test_signal_stops_workers_and_raises(tmp_path: Path) -> None:
    spec = WorkerSpec(role="s", local_world_size=2, entrypoint="sleep", args=("1000",))
    agent = LocalElasticAgent(spec, log_dir=str(tmp_path), grace_period=5)
    with pytest.raises(aioproc.SignalException) as info:
        async with aioproc.translate_signals((signal.SIGTERM,)):
            loop = asyncio.get_running_loop()
            started = 0

            def on_event(e: AgentEvent) -> None:
                nonlocal started
                if e.kind == "worker_started":
                    started += 1
                    if started == 2:
                        loop.call_soon(os.kill, os.getpid(), signal.SIGTERM)

            agent.add_event_handler(on_event)
            await agent.run()
    assert info.value.sigval == signal.SIGTERM
    assert agent.state == WorkerState.STOPPED
    exits = [e for e in agent.event_history if e.kind == "worker_exited"]
    assert sorted(e.exitcode for e in exits) == [-15, -15]
    kinds = [e.kind for e in agent.event_history]
    # announced before the workers are stopped with it, and only once
    assert kinds.count("signal_received") == 1
    assert kinds.index("signal_received") < kinds.index("worker_exited")
    signalled = next(e for e in agent.event_history if e.kind == "signal_received")
    assert signalled.signal == "SIGTERM"


def test_bad_specs_are_rejected() -> None:
    with pytest.raises(ValueError, match="local_world_size"):
        WorkerSpec(role="r", local_world_size=0, entrypoint="true")
    with pytest.raises(ValueError, match="max_restarts"):
        WorkerSpec(role="r", local_world_size=1, entrypoint="true", max_restarts=-1)
    with pytest.raises(TypeError, match="entrypoint"):
        WorkerSpec(role="r", local_world_size=1, entrypoint=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="master_port"):
        WorkerSpec(role="r", local_world_size=1, entrypoint="true", master_port=70000)
    with pytest.raises(ValueError, match="start_method"):
        LocalElasticAgent(
            WorkerSpec(role="r", local_world_size=1, entrypoint="true"), start_method="fork"
        )


# ------------------------------------------------------------------ stop()
#
# torchelastic treats a stop as the end of the run: stop() never costs a
# restart or starts an attempt, and run() returns a STOPPED RunResult.

# each worker writes "<pid>\n" to the FIFO argv[1], then sleeps until stopped
ANNOUNCE_AND_SLEEP = (
    "import os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_WRONLY)\n"
    "os.write(fd, f'{os.getpid()}\\n'.encode())\n"
    "os.close(fd)\n"
    "time.sleep(60)\n"
)


def announcing_spec(fifo: Fifo, n: int = 2, **kw: object) -> WorkerSpec:
    return WorkerSpec(
        role="st",
        local_world_size=n,
        entrypoint=sys.executable,
        args=("-c", ANNOUNCE_AND_SLEEP, fifo.path),
        max_restarts=3,
        **kw,  # type: ignore[arg-type]
    )


async def test_stop_ends_the_run_with_the_given_signal_and_no_restart(
    tmp_path: Path, fifo: Fifo
) -> None:
    events: list[AgentEvent] = []
    logs = tmp_path / "logs"  # tmp_path also holds the FIFO
    agent = LocalElasticAgent(
        announcing_spec(fifo), log_dir=str(logs), grace_period=30, on_event=events.append
    )
    running = asyncio.ensure_future(agent.run())
    try:
        pids = [int(line) for line in await fifo.lines(2)]  # both workers are up
        # the old keyword still works, and says it is deprecated
        with pytest.warns(DeprecationWarning, match=r"stop\(timeout=\.\.\.\) is deprecated"):
            await asyncio.wait_for(agent.stop(signal.SIGUSR1, timeout=5), 20)
        assert running.done()  # stop() returns once run() has ended
        result = await running
    finally:
        await agent.stop()
        await asyncio.gather(running, return_exceptions=True)
    assert result.state == WorkerState.STOPPED
    assert not result.is_failed()
    assert agent.state == WorkerState.STOPPED
    assert agent.restart_count == 0
    assert {r: f.exitcode for r, f in result.failures.items()} == {
        0: -signal.SIGUSR1,
        1: -signal.SIGUSR1,
    }
    kinds = [e.kind for e in events]
    assert kinds.count("attempt_started") == 1
    assert kinds.count("worker_started") == 2
    assert "restart_scheduled" not in kinds and "attempt_failed" not in kinds
    assert kinds[-1] == "group_stopped"
    assert events[-1].message == "stopped by stop() with SIGUSR1, grace 5 s"
    exits = [e for e in events if e.kind == "worker_exited"]
    assert sorted(e.pid for e in exits if e.pid is not None) == sorted(pids)
    assert {e.signal for e in exits} == {"SIGUSR1"}
    assert all(pid_gone(p) for p in pids)
    assert not (run_dir(logs) / "attempt_1").exists()
    await agent.stop()  # no run going on: returns at once


async def test_a_second_stop_cuts_the_grace_period_short(tmp_path: Path, fifo: Fifo) -> None:
    """Workers ignoring SIGTERM, a 600 s grace period: stop(SIGKILL) ends it now."""
    # says its pid, then "term" on each SIGTERM, which it survives
    stubborn = (
        "import os, signal, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY)\n"
        "signal.signal(signal.SIGTERM, lambda *_: os.write(fd, b'term\\n'))\n"
        "os.write(fd, f'{os.getpid()}\\n'.encode())\n"
        "time.sleep(600)\n"
    )
    spec = WorkerSpec(
        role="st", local_world_size=2, entrypoint=sys.executable, args=("-c", stubborn, fifo.path)
    )
    events: list[AgentEvent] = []
    agent = LocalElasticAgent(
        spec, log_dir=str(tmp_path / "logs"), grace_period=600, on_event=events.append
    )
    running = asyncio.ensure_future(agent.run())
    graceful: asyncio.Future[None] | None = None
    try:
        pids = [int(line) for line in await fifo.lines(2)]
        graceful = asyncio.ensure_future(agent.stop())  # SIGTERM, survived; 600 s to go
        assert await fifo.lines(2) == ["term", "term"]
        assert not running.done() and all(not pid_gone(p) for p in pids)
        with pytest.warns(aioproc.ForcedKillWarning, match=r"2 worker\(s\) did not exit"):
            # bounded far below the grace period: only the second stop can end it
            await asyncio.wait_for(agent.stop(signal.SIGKILL, 0), 20)
            result = await running
        await graceful
    finally:
        await agent.stop(signal.SIGKILL, 0)
        await asyncio.gather(running, *([graceful] if graceful else []), return_exceptions=True)
    assert result.state == WorkerState.STOPPED
    # the stop under way kept its signal; SIGKILL came early
    assert {f.exitcode for f in result.failures.values()} == {-signal.SIGKILL}
    assert events[-1].message == "stopped by stop() with SIGTERM, grace 600 s"
    assert all(pid_gone(p) for p in pids)


async def test_stop_during_the_restart_backoff_starts_no_new_attempt(tmp_path: Path) -> None:
    backoff = asyncio.Event()
    events: list[AgentEvent] = []

    def on_event(e: AgentEvent) -> None:
        events.append(e)
        if e.kind == "restart_scheduled":
            backoff.set()

    policy = RestartPolicy(initial_delay=3600)  # only stop() can end this backoff
    agent = LocalElasticAgent(
        flaky_spec("0", n=1, max_restarts=3, restart_policy=policy),
        log_dir=str(tmp_path),
        on_event=on_event,
    )
    running = asyncio.ensure_future(agent.run())
    try:
        await asyncio.wait_for(backoff.wait(), 20)
        await asyncio.wait_for(agent.stop(), 20)
        result = await running
    finally:
        await agent.stop()
        await asyncio.gather(running, return_exceptions=True)
    assert result.state == WorkerState.STOPPED
    assert result.failures[0].exitcode == 3  # how the last attempt ended
    assert agent.restart_count == 0  # the scheduled restart never happened
    kinds = [e.kind for e in events]
    assert kinds.count("attempt_started") == 1
    assert kinds[-1] == "group_stopped"
    assert not (run_dir(tmp_path) / "attempt_1").exists()


async def test_stop_while_the_group_starts_stops_it_once_started(tmp_path: Path) -> None:
    # tee'd: each launch awaits its pipes, so the stop task runs between two launches
    spec = WorkerSpec(
        role="early", local_world_size=4, entrypoint="sleep", args=("60",), tee=Std.ALL
    )
    agent = LocalElasticAgent(spec, log_dir=str(tmp_path), grace_period=5)
    stopping: list[asyncio.Task[None]] = []
    pids: list[int] = []

    def on_event(e: AgentEvent) -> None:
        if e.kind == "worker_started" and e.pid is not None:
            pids.append(e.pid)
            if not stopping:  # the first rank is up, the others are being launched
                stopping.append(asyncio.ensure_future(agent.stop(signal.SIGTERM)))

    agent.add_event_handler(on_event)
    try:
        result = await asyncio.wait_for(agent.run(), 30)
    finally:
        await agent.stop()
        for task in stopping:
            await task
    assert result.state == WorkerState.STOPPED
    assert len(pids) == 4
    assert {f.exitcode for f in result.failures.values()} == {-signal.SIGTERM}
    assert all(pid_gone(p) for p in pids)
    kinds = [e.kind for e in agent.event_history]
    assert kinds.count("attempt_started") == 1
    assert kinds[-1] == "group_stopped"


async def test_stop_rejects_bad_arguments_before_stopping_anything() -> None:
    agent = LocalElasticAgent(WorkerSpec(role="r", local_world_size=1, entrypoint="true"))
    with pytest.raises(ValueError, match="death_sig must be a signal number, got 999"):
        await agent.stop(999)
    with pytest.raises(ValueError, match="grace_period must be a number >= 0, got nan"):
        await agent.stop(signal.SIGTERM, float("nan"))
    with pytest.raises(ValueError, match="grace_period must be a number >= 0, got -1"):
        await agent.stop(signal.SIGTERM, -1)
    with (
        pytest.warns(DeprecationWarning, match="use stop"),
        pytest.raises(ValueError, match="timeout must be a number >= 0, got -1"),
    ):
        await agent.stop(signal.SIGTERM, timeout=-1)
    with pytest.raises(TypeError, match=r"give grace_period=1 or timeout=2 \(its old name\)"):
        await agent.stop(signal.SIGTERM, 1, timeout=2)


# ----------------------------------------------------- bounded event memory


def test_event_history_keeps_the_last_events_only() -> None:
    spec = WorkerSpec(role="h", local_world_size=1, entrypoint="true")
    agent = LocalElasticAgent(spec, event_history_size=50)
    for i in range(5000):
        agent._publish("worker_started", message=str(i))
    history = agent.event_history
    assert [e.message for e in history] == [str(i) for i in range(4950, 5000)]
    default = LocalElasticAgent(spec)
    for i in range(3000):
        default._publish("worker_started", message=str(i))
    assert len(default.event_history) == 1000
    assert default.event_history[0].message == "2000"
    with pytest.raises(ValueError, match="event_history_size must be a positive int, got 0"):
        LocalElasticAgent(spec, event_history_size=0)
    with pytest.raises(ValueError, match="maxsize must be a positive int, got 0"):
        agent.events(maxsize=0)


async def test_a_stalled_reader_never_slows_the_agent_and_learns_what_it_lost(
    tmp_path: Path,
) -> None:
    # 40 restarts of a worker that fails at once, no backoff: about 200 events
    spec = WorkerSpec(role="fast", local_world_size=1, entrypoint="false", max_restarts=40)
    published: list[AgentEvent] = []
    agent = LocalElasticAgent(
        spec, log_dir=str(tmp_path), on_event=published.append, event_history_size=32
    )
    stream = agent.events(maxsize=8)
    got_first = asyncio.Event()
    resume = asyncio.Event()
    received: list[AgentEvent] = []

    async def stalled_reader() -> None:
        async for event in stream:
            received.append(event)
            if len(received) == 1:
                got_first.set()
                await resume.wait()  # stalls until the run is over

    reader = asyncio.ensure_future(stalled_reader())
    try:
        result = await asyncio.wait_for(agent.run(), 50)
        assert result.state == WorkerState.FAILED
        assert agent.restart_count == 40
        assert len(agent.event_history) == 32
        assert agent.event_history == published[-32:]
        await asyncio.wait_for(got_first.wait(), 5)
        resume.set()
        await asyncio.wait_for(reader, 5)
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    assert len(published) > 200
    lost = len(published) - 1 - 8
    assert stream.dropped == lost
    first, dropped, *kept = received
    assert first == published[0]
    assert dropped.kind == "events_dropped"
    assert dropped.dropped == lost
    assert f"{lost} event(s) dropped here" in dropped.message
    assert kept == published[-8:]  # the newest ones, in order, ending with the verdict
    assert kept[-1].kind == "group_failed"
    assert "events_dropped" not in [e.kind for e in agent.event_history]


def hub_event(i: int) -> AgentEvent:
    return AgentEvent(kind="worker_started", role="r", attempt=0, message=str(i))


async def test_event_stream_drops_its_oldest_events_and_ends_after_the_rest() -> None:
    hub = EventHub(history_size=3)
    stream = hub.subscribe(maxsize=2)
    assert repr(stream) == "<EventStream open buffered=0/2 dropped=0>"
    for i in range(5):
        hub.publish(hub_event(i))
    hub.close()
    got = [e async for e in stream]
    assert [(e.kind, e.dropped) for e in got] == [
        ("events_dropped", 3),
        ("worker_started", None),
        ("worker_started", None),
    ]
    assert [e.message for e in got[1:]] == ["3", "4"]
    assert [e.message for e in hub.history] == ["2", "3", "4"]
    assert repr(stream) == "<EventStream ended buffered=0/2 dropped=3>"
    assert [e async for e in hub.subscribe()] == []  # subscribed after the end


async def test_event_stream_closed_or_abandoned_by_its_reader_gets_nothing_more() -> None:
    hub = EventHub()
    closed = hub.subscribe()
    hub.publish(hub_event(0))
    await closed.aclose()
    hub.publish(hub_event(1))
    assert [e async for e in closed] == []
    abandoned = hub.subscribe()
    ref = weakref.ref(abandoned)
    del abandoned
    gc.collect()
    assert ref() is None  # the hub does not keep an abandoned reader's buffer alive
    hub.close()


async def test_a_reader_made_just_before_run_sees_every_event() -> None:
    """Subscribing is synchronous: nothing published by run() is missed, the first
    attempt_started and worker_started included."""
    agent = LocalElasticAgent(WorkerSpec(role="r", local_world_size=2, entrypoint="/bin/true"))
    stream = agent.events()
    seen: list[str] = []

    async def consume() -> None:
        async for event in stream:
            seen.append(event.kind)

    reader = asyncio.create_task(consume())
    await agent.run()
    await asyncio.wait_for(reader, 10)
    assert seen == [e.kind for e in agent.event_history]
    assert seen[0] == "attempt_started"
    assert seen.count("worker_started") == 2
    assert seen[-1] == "group_succeeded"


class _ExitBarrierFails(StaticRendezvousHandler):
    """A one-node world whose exit barrier raises what no rendezvous error is."""

    async def exit_barrier(self, timeout: float) -> None:
        raise OSError("the store went away")


async def test_an_exit_barrier_error_after_success_is_logged_and_the_run_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # torch's _exit_barrier logs such an error and the run reports success
    params = RendezvousParameters("static", "127.0.0.1:29400", "job", 1, 1, node_rank=0)
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        entrypoint=abs,
        args=(-3,),
        rdzv_handler=_ExitBarrierFails(params),
    )
    agent = LocalElasticAgent(spec, log_dir=str(tmp_path))
    with caplog.at_level(logging.ERROR, logger="aioproc"):
        result = await agent.run()
    assert result.state == WorkerState.SUCCEEDED
    assert result.return_values == {0: 3, 1: 3}
    assert agent.state == WorkerState.SUCCEEDED
    (record,) = [r for r in caplog.records if "exit barrier" in r.getMessage()]
    assert record.levelno == logging.ERROR
    assert record.getMessage() == (
        "exit barrier failed; this host's workers succeeded all the same"
    )
    assert record.exc_info is not None
    assert repr(record.exc_info[1]) == "OSError('the store went away')"


# ------------------------------------------------- resources, usage and metrics


@pytest.fixture
def recorder() -> Iterator[aioproc.metrics.Recorder]:
    """A fresh process-wide recorder for the test; the one in force before comes back."""
    before = hooks.current
    rec = aioproc.metrics.enable(aioproc.metrics.Recorder())
    yield rec
    hooks.current = before


async def test_restarts_rendezvous_rounds_and_the_run_are_counted_in_the_metrics(
    tmp_path: Path, recorder: aioproc.metrics.Recorder
) -> None:
    params = RendezvousParameters("static", "127.0.0.1:29400", "job", 1, 1, node_rank=0)
    spec = flaky_spec("0", max_restarts=2, rdzv_handler=StaticRendezvousHandler(params))
    result = await LocalElasticAgent(spec, log_dir=str(tmp_path)).run()
    assert result.state == WorkerState.SUCCEEDED
    text = aioproc.metrics.render(recorder)
    ours = 'group="trainer",role="trainer"'
    for sample in [
        f"aioproc_restarts_total{{{ours}}} 1.0",
        f"aioproc_remaining_restarts{{{ours}}} 1.0",
        'aioproc_runs_total{group="trainer",outcome="succeeded",retried="true",role="trainer"} 1.0',
        # one round per attempt
        'aioproc_rendezvous_rounds_total{backend="static",outcome="succeeded",role="trainer"} 2.0',
        'aioproc_rendezvous_seconds_count{backend="static",role="trainer"} 2.0',
    ]:
        assert sample in text.splitlines(), f"{sample} not in:\n{text}"
    # the attempts' groups carry the spec's role too
    assert f"aioproc_groups_started_total{{{ours}}} 2.0" in text.splitlines(), text
    failed = 'aioproc_workers_exited_total{group="trainer",outcome="failed",role="trainer"} 1.0'
    assert failed in text.splitlines(), text


async def test_a_failed_run_and_a_stopped_one_are_counted_by_outcome(
    tmp_path: Path, recorder: aioproc.metrics.Recorder
) -> None:
    failed = await LocalElasticAgent(flaky_spec("0", max_restarts=0), log_dir=str(tmp_path)).run()
    assert failed.state == WorkerState.FAILED
    backoff = asyncio.Event()
    agent = LocalElasticAgent(
        flaky_spec("0,1", max_restarts=1, restart_policy=RestartPolicy(initial_delay=3600)),
        log_dir=str(tmp_path),
        on_event=lambda e: backoff.set() if e.kind == "restart_scheduled" else None,
    )
    running = asyncio.ensure_future(agent.run())
    await asyncio.wait_for(backoff.wait(), 20)
    await asyncio.wait_for(agent.stop(), 20)
    assert (await running).state == WorkerState.STOPPED
    runs = [
        line for line in aioproc.metrics.render(recorder).splitlines() if "_runs_total{" in line
    ]
    assert runs == [
        'aioproc_runs_total{group="trainer",outcome="failed",retried="false",role="trainer"} 1.0',
        'aioproc_runs_total{group="trainer",outcome="stopped",retried="false",role="trainer"} 1.0',
    ]


async def test_the_result_has_every_ranks_usage_keyed_by_global_rank(tmp_path: Path) -> None:
    events: list[AgentEvent] = []
    spec = flaky_spec("", n=2)
    result = await LocalElasticAgent(spec, log_dir=str(tmp_path), on_event=events.append).run()
    assert result.state == WorkerState.SUCCEEDED
    assert sorted(result.usage) == [0, 1]
    for usage in result.usage.values():
        assert isinstance(usage, aioproc.Usage)
        assert usage.max_rss > 1 << 20 and usage.cpu_time > 0
    exits = [e for e in events if e.kind == "worker_exited"]
    assert len(exits) == 2 and all(e.oom is None for e in exits)
    # they exited on their own: their usage is read from the unreaped zombie
    assert all(isinstance(e.usage, aioproc.Usage) and e.usage.cpu_time > 0 for e in exits)


async def test_the_specs_limits_reach_the_workers_and_an_oom_kill_is_reported(
    tmp_path: Path,
) -> None:
    offered = set().union(*(h.controllers for h in discover().hierarchies))
    if "memory" not in offered:
        pytest.skip("this process cannot make memory cgroups (needs root or a delegated subtree)")
    allocate = "data = bytearray(256 << 20)\ndata[::4096] = b'x' * len(data[::4096])\n"
    events: list[AgentEvent] = []
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        entrypoint=sys.executable,
        args=("-c", allocate),
        max_restarts=0,
        limits={0: aioproc.Limits(memory="64M")},  # rank 1 has no limit
    )
    result = await LocalElasticAgent(spec, log_dir=str(tmp_path), on_event=events.append).run()
    assert result.state == WorkerState.FAILED
    oom = "killed by the kernel's OOM killer: memory limit 64 MiB reached"
    assert result.failures[0].oom == oom
    (killed,) = [e for e in events if e.kind == "worker_exited" and e.local_rank == 0]
    assert killed.oom == oom and killed.signal == "SIGKILL"
    assert result.usage[0].max_rss < 200 << 20


async def test_the_specs_cpus_and_the_agents_capacity_reach_every_attempt(
    tmp_path: Path,
) -> None:
    first = min(os.sched_getaffinity(0))
    capacity = aioproc.Capacity(2)
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        entrypoint=os.sched_getaffinity,
        args=(0,),
        cpus=[first],
    )
    agent = LocalElasticAgent(spec, log_dir=str(tmp_path), capacity=capacity)
    result = await agent.run()
    assert result.return_values == {0: {first}, 1: {first}}
    assert capacity.in_use == 0  # the attempt's slots were given back
    with pytest.raises(ValueError, match="never fits"):
        LocalElasticAgent(spec, capacity=aioproc.Capacity(1))


def test_a_bad_limit_or_cpu_set_fails_when_the_spec_is_made() -> None:
    with pytest.raises(ValueError, match=r"^WorkerSpec\.limits: local rank 2 is not in the group"):
        WorkerSpec("w", 2, sys.executable, limits={2: aioproc.Limits(memory="1G")})
    with pytest.raises(TypeError, match=r"^WorkerSpec\.limits must be an aioproc\.Limits"):
        WorkerSpec("w", 2, sys.executable, limits="1G")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^WorkerSpec\.cpus=\[100000\]: CPU 100000 not in"):
        WorkerSpec("w", 2, sys.executable, cpus=[100000])


# ------------------------------------------------- aclose() and open_agent()
#
# aclose() is the agent's close, as every handle's; stop() stays (with a
# signal and a grace period of its own), and open_agent() opens an agent as
# every handle opens: awaited or with async with, its run in a task of its own.

# says its pid, then ignores SIGTERM: only the SIGKILL after the grace period ends it
STUBBORN = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "fd = os.open(sys.argv[1], os.O_WRONLY)\n"
    "os.write(fd, f'{os.getpid()}\\n'.encode())\n"
    "os.close(fd)\n"
    "time.sleep(600)\n"
)


async def test_aclose_stops_the_run_is_idempotent_and_safe_from_other_tasks(
    tmp_path: Path, fifo: Fifo
) -> None:
    events: list[AgentEvent] = []
    agent = LocalElasticAgent(
        announcing_spec(fifo), log_dir=str(tmp_path / "logs"), on_event=events.append
    )
    running = asyncio.ensure_future(agent.run())
    try:
        pids = [int(line) for line in await fifo.lines(2)]
        # two other tasks close it at once: both return once the run has ended
        await asyncio.wait_for(asyncio.gather(agent.aclose(), agent.aclose()), 20)
        assert running.done()
        result = await running
    finally:
        await agent.aclose()
        await asyncio.gather(running, return_exceptions=True)
    assert result.state == WorkerState.STOPPED
    assert {f.exitcode for f in result.failures.values()} == {-signal.SIGTERM}
    assert agent.restart_count == 0
    assert all(pid_gone(p) for p in pids)
    assert [e.kind for e in events].count("group_stopped") == 1
    assert events[-1].message == "stopped by aclose() with SIGTERM, grace 30 s"
    await agent.aclose()  # no run going on: returns at once


async def test_aclose_honours_the_agents_grace_period(tmp_path: Path, fifo: Fifo) -> None:
    """A worker ignoring SIGTERM is SIGKILLed once the agent's grace period is over."""
    spec = WorkerSpec(
        role="st", local_world_size=1, entrypoint=sys.executable, args=("-c", STUBBORN, fifo.path)
    )
    agent = LocalElasticAgent(spec, log_dir=str(tmp_path / "logs"), grace_period=1)
    running = asyncio.ensure_future(agent.run())
    try:
        [pid] = [int(line) for line in await fifo.lines(1)]
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.warns(aioproc.ForcedKillWarning, match=r"1 worker\(s\) did not exit"):
            await asyncio.wait_for(agent.aclose(), 20)
        took = loop.time() - began
        result = await running
    finally:
        await agent.stop(signal.SIGKILL, 0)
        await asyncio.gather(running, return_exceptions=True)
    assert result.failures[0].exitcode == -signal.SIGKILL
    assert pid_gone(pid)
    assert 0.9 <= took < 15, took  # the grace period, and a generous bound above it


async def test_open_agent_awaited_runs_in_the_background_until_aclose(
    tmp_path: Path, fifo: Fifo
) -> None:
    agent = await open_agent(announcing_spec(fifo), log_dir=str(tmp_path / "logs"))
    try:
        pids = [int(line) for line in await fifo.lines(2)]
        assert agent.state == WorkerState.HEALTHY
        assert sorted(agent.pids().values()) == sorted(pids)
        with pytest.raises(RuntimeError, match="already running"):
            await agent.run()  # one run at a time
    finally:
        await asyncio.wait_for(agent.aclose(), 20)
    result = await agent.wait()
    assert result.state == WorkerState.STOPPED
    assert {f.exitcode for f in result.failures.values()} == {-signal.SIGTERM}
    assert all(pid_gone(p) for p in pids)
    assert await agent.wait() is result  # the same result, every time
    await agent.aclose()


async def test_open_agent_with_async_with_waits_for_the_result_and_closes(tmp_path: Path) -> None:
    spec = flaky_spec("0", n=2, max_restarts=1)  # rank 0 fails once, then all succeed
    async with open_agent(spec, log_dir=str(tmp_path), grace_period=5) as agent:
        result = await asyncio.wait_for(agent.wait(), 30)
    assert result.state == WorkerState.SUCCEEDED
    assert agent.restart_count == 1
    kinds = [e.kind for e in agent.event_history]
    assert kinds.count("attempt_started") == 2 and kinds[-1] == "group_succeeded"


async def test_leaving_open_agents_block_early_stops_the_workers(
    tmp_path: Path, fifo: Fifo
) -> None:
    pids: list[int] = []
    with pytest.raises(LookupError, match="the block's own error"):
        async with open_agent(announcing_spec(fifo), log_dir=str(tmp_path / "logs")) as agent:
            pids = [int(line) for line in await fifo.lines(2)]
            raise LookupError("the block's own error")
    assert all(pid_gone(p) for p in pids)
    assert (await agent.wait()).state == WorkerState.STOPPED


async def test_a_signal_ending_open_agents_block_stops_the_workers_with_it(
    tmp_path: Path, fifo: Fifo
) -> None:
    pids: list[int] = []
    with pytest.raises(aioproc.SignalException) as info:
        async with aioproc.translate_signals((signal.SIGUSR1,)):
            async with open_agent(announcing_spec(fifo), log_dir=str(tmp_path / "logs")) as agent:
                pids = [int(line) for line in await fifo.lines(2)]
                os.kill(os.getpid(), signal.SIGUSR1)
                await asyncio.sleep(30)  # the signal ends this wait
    assert info.value.sigval == signal.SIGUSR1
    result = await agent.wait()
    assert result.state == WorkerState.STOPPED
    assert {f.exitcode for f in result.failures.values()} == {-signal.SIGUSR1}
    assert all(pid_gone(p) for p in pids)
    assert agent.event_history[-1].message == "stopped by aclose() with SIGUSR1, grace 30 s"


async def test_cancelled_while_open_agent_opens_leaves_no_run_behind(
    tmp_path: Path, fifo: Fifo
) -> None:
    """Cancelled at successive points of the open: a run it began has ended (its
    workers gone) by the time the cancellation reaches the caller."""
    spec = announcing_spec(fifo, n=1)
    began = 0
    for turns in range(8):
        events: list[AgentEvent] = []
        opening = asyncio.ensure_future(
            open_agent(spec, log_dir=str(tmp_path / f"l{turns}"), on_event=events.append)
        )
        for _ in range(turns):
            await asyncio.sleep(0)
        opening.cancel()
        try:
            agent = await opening
        except asyncio.CancelledError:
            agent = None
        if agent is not None:
            await agent.aclose()  # opened before the cancellation landed: ours to close
        if events:
            began += 1
            assert events[-1].kind == "group_stopped", events[-1]
        for e in events:
            if e.kind == "worker_started" and e.pid is not None:
                assert pid_gone(e.pid)
    assert began >= 1  # the cancellation also landed after the run began


async def test_the_agent_is_still_its_own_context_manager(tmp_path: Path, fifo: Fifo) -> None:
    """The old form: ``async with LocalElasticAgent(...)``, ``run()`` in the
    block; leaving the block ends the run (``aclose()``)."""
    async with LocalElasticAgent(announcing_spec(fifo), log_dir=str(tmp_path / "l")) as agent:
        running = asyncio.ensure_future(agent.run())
        pids = [int(line) for line in await fifo.lines(2)]
    assert running.done()
    assert (await running).state == WorkerState.STOPPED
    assert all(pid_gone(p) for p in pids)
    assert agent.event_history[-1].message == "stopped by aclose() with SIGTERM, grace 30 s"


async def test_a_cancelled_aclose_still_ends_the_run_before_it_propagates(
    tmp_path: Path, fifo: Fifo
) -> None:
    """``aclose()`` cancelled at successive points once it began: when the
    cancellation reaches the caller the run has ended and its workers are gone."""
    for turns in range(1, 7):
        agent = await open_agent(announcing_spec(fifo), log_dir=str(tmp_path / f"l{turns}"))
        try:
            pids = [int(line) for line in await fifo.lines(2)]
            closing = asyncio.ensure_future(agent.aclose())
            for _ in range(turns):  # the first turn starts it
                await asyncio.sleep(0)
            closing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await closing
            assert all(pid_gone(p) for p in pids), turns
            assert (await agent.wait()).state == WorkerState.STOPPED
        finally:
            await agent.aclose()


async def test_wait_is_for_opened_agents_and_open_agent_checks_at_the_call() -> None:
    spec = WorkerSpec(role="r", local_world_size=1, entrypoint="true")
    with pytest.raises(RuntimeError, match=r"was not opened with open_agent\(\)"):
        await LocalElasticAgent(spec).wait()
    with pytest.raises(TypeError, match="spec must be a WorkerSpec"):
        open_agent("trainer")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grace_period"):
        open_agent(spec, grace_period=-1)
    with pytest.raises(TypeError, match="positional"):
        open_agent(spec, None)  # type: ignore[misc]
    agent = await open_agent(spec)
    assert (await agent.wait()).state == WorkerState.SUCCEEDED
    await agent.aclose()
