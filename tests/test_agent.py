"""LocalElasticAgent: torchrun's env, restarts with backoff, attempts' logs, events."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
from pathlib import Path

import pytest

import aioproc
from aioproc import Std
from aioproc.agent import AgentEvent, LocalElasticAgent, RestartPolicy, WorkerSpec, WorkerState

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
    import asyncio

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
    import asyncio

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
        LocalElasticAgent(WorkerSpec(role="r", local_world_size=1, entrypoint="true"), "fork")
