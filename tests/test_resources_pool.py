"""Limits, the process budget, usage and metrics of persistent workers and pools; CPU placement.

``test_resources`` covers groups; here ``open_worker`` and ``open_pool`` get
the same pieces (each worker a placement of its own, one slot of a
``Capacity`` per live worker), and ``cpus=`` pins the workers of a group, a
pool or a persistent worker.  A test that needs a cgroup skips, saying why,
where this process cannot make one; one that needs two CPUs skips where
only one is allowed.  Every async test runs on asyncio and on uvloop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import cgroup_host, need_cgroup, release_fifo

import aioproc
import aioproc.metrics
from aioproc import BrokenWorkerError, Capacity, DefaultLogsSpecs, Limits, Usage
from aioproc._group import resources
from aioproc._limits import affinity
from aioproc._metrics import hooks

MiB = 1 << 20
OOM_TEXT = "killed by the kernel's OOM killer: memory limit 64 MiB reached"
ALLOWED = sorted(os.sched_getaffinity(0))
NO_LOGS = DefaultLogsSpecs(log_dir=os.devnull)


def need_cpus(n: int = 2) -> None:
    if len(ALLOWED) < n:
        pytest.skip(f"this process may run on {len(ALLOWED)} CPU(s) {ALLOWED}; the test needs {n}")


@pytest.fixture(autouse=True)
def _metrics_restored() -> Iterator[None]:
    """Every test leaves the process-wide recorder as it found it (off)."""
    before = hooks.current
    yield
    hooks.current = before


# ------------------------------------------------------------------ workers


def allocate(mib: int) -> int:
    data = bytearray(mib << 20)
    data[::4096] = b"x" * len(data[::4096])  # written, so resident
    return mib


def burn(seconds: float) -> float:
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass
    return seconds


def affinity_of() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def note_pid(path: str) -> None:
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")


def wait_fifo(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.read(fd, 1)  # until the test releases this worker: one byte each
    finally:
        os.close(fd)


def fail(text: str) -> None:
    raise ValueError(text)


def raise_timeout() -> None:
    raise TimeoutError("fn's own timeout")


AFFINITY_CODE = (
    "import os, sys\nopen(sys.argv[1], 'w').write(repr(sorted(os.sched_getaffinity(0))))"
)


# -------------------------------------------------------------- limits, OOM


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_a_pool_worker_past_its_memory_limit_is_oom_killed_and_replaced(
    start_method: str,
) -> None:
    need_cgroup("memory")
    async with aioproc.open_pool(2, limits=Limits(memory="64M"), start_method=start_method) as pool:
        first = pool.pids()
        assert await pool.run(allocate, (16,)) == [16, 16]  # within the limit, each worker
        with pytest.raises(BrokenWorkerError) as caught:
            await pool.submit(allocate, 256)
        message = str(caught.value)
        assert OOM_TEXT in message, message
        assert "was killed by the kernel's OOM killer" in message and "during a call" in message
        # the pool replaces it: every worker answers, one of them new
        assert await pool.run(allocate, (16,)) == [16, 16]
        after = pool.pids()
        assert len(set(first) & set(after)) == 1, (first, after)
        assert pool.stats().restarts == 1


async def test_without_cgroups_a_worker_memory_limit_is_an_rlimit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(resources, "BACKENDS", ("rlimit",))
    async with aioproc.open_pool(1, limits=Limits(memory="64M")) as pool:
        (pid,) = pool.pids()
        with pytest.raises(MemoryError):
            await pool.submit(allocate, 256)
        # an rlimit never kills: the same worker goes on
        assert await pool.submit(allocate, 8) == 8
        assert pool.pids() == [pid]
    async with aioproc.open_worker(limits=Limits(memory="64M")) as worker:
        with pytest.raises(MemoryError):
            await worker.call(allocate, 256)
        assert await worker.call(allocate, 8) == 8


async def test_a_pool_says_how_its_limits_are_enforced_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its workers share their limits: one INFO line and one WARNING for the pool,
    the rest (replacements too) at DEBUG."""
    monkeypatch.setattr(resources, "BACKENDS", ("rlimit",))  # no CPU quota: a WARNING
    caplog.set_level(logging.DEBUG, logger="aioproc")
    async with aioproc.open_pool(3, limits=Limits(memory="1G", cpus=1)) as pool:
        first = set(pool.pids())
        with pytest.raises(BrokenWorkerError):
            await pool.submit(os._exit, 3)
        assert len(set(await pool.run(os.getpid)) - first) == 1  # one replaced
        assert pool.stats().restarts == 1

    def lines(level: int, text: str) -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.levelno == level and r.getMessage().startswith(text)
        ]

    (info,) = lines(logging.INFO, "limits for ")
    assert "memory 1 GiB: " in info and "RLIMIT" in info, info
    (warning,) = lines(logging.WARNING, "limits for ")
    assert "not enforced here: cpus 1: " in warning, warning
    # the two other first workers and the replacement, each its pair of lines
    assert len(lines(logging.DEBUG, "limits for ")) == 6


async def test_bad_worker_limits_and_capacity_raise_at_the_call() -> None:
    with pytest.raises(TypeError, match=r"limits must be an aioproc.Limits .*got '64M'"):
        aioproc.open_pool(2, limits="64M")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"limits must be an aioproc.Limits .*got \{0: "):
        aioproc.open_worker(limits={0: Limits()})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"capacity must be an aioproc.Capacity, got 3"):
        aioproc.open_pool(2, capacity=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"a group of 3 workers never fits in <Capacity 0/2"):
        aioproc.open_pool(3, capacity=Capacity(2))


# ------------------------------------------------------------------ capacity


async def test_a_capacity_shared_by_a_pool_and_a_group_never_holds_more_workers(
    tmp_path: Path,
) -> None:
    capacity = Capacity(3)
    pids_file = tmp_path / "pool-pids"
    pids_file.touch()
    group_live = 0
    seen: list[int] = []  # live workers, counted each time one starts
    both_started = asyncio.Event()

    def pool_live() -> int:
        # a worker not reaped yet still holds its slot: /proc keeps its entry
        pids = pids_file.read_text().split()
        return sum(os.path.exists(f"/proc/{pid}") for pid in pids)

    def on_event(event: aioproc.WorkerEvent) -> None:
        nonlocal group_live
        if event.kind == "started":
            group_live += 1
            seen.append(group_live + pool_live())
            if group_live == 2:
                both_started.set()
        elif event.kind == "exited":
            group_live -= 1

    async def group(fifo: str) -> None:
        async with aioproc.start_processes(
            "group",
            wait_fifo,
            {0: (fifo,), 1: (fifo,)},
            {0: {}, 1: {}},
            NO_LOGS,
            capacity=capacity,
            on_event=on_event,
            sinks=[],
        ) as pc:
            result = await pc.wait()
        assert result is not None and not result.is_failed()

    async def until(condition: Any) -> None:
        while not condition():
            await asyncio.sleep(0)  # loop turns, until a start joins the queue

    fifo = str(tmp_path / "release")
    with release_fifo(fifo) as release:
        async with aioproc.open_pool(
            2, initializer=note_pid, initargs=(str(pids_file),), capacity=capacity
        ) as pool:
            assert (capacity.in_use, pool_live()) == (2, 2)
            running = asyncio.create_task(group(fifo))
            await until(lambda: capacity.waiting == 1)  # 2 slots wanted, 1 free
            assert group_live == 0
            # a worker dies: once reaped, its slot lets the group start
            with pytest.raises(BrokenWorkerError):
                await pool.submit(os._exit, 3)
            await asyncio.wait_for(both_started.wait(), 20)
            assert capacity.in_use == 3
            # the dead worker's replacement waits for a slot, behind nobody
            replacing = asyncio.create_task(pool.run(os.getpid))
            await until(lambda: capacity.waiting == 1)
            assert pool.stats().starting == 1
            assert (group_live, pool_live(), capacity.in_use) == (2, 1, 3)
            release(2)  # the group ends, gives its slots back once reaped
            pids = await asyncio.wait_for(replacing, 20)
            await running
            assert len(set(pids)) == 2 and (group_live, pool_live()) == (0, 2)
            seen.append(group_live + pool_live())
    assert max(seen) <= 3, seen
    assert (capacity.in_use, capacity.waiting) == (0, 0)


async def test_a_pool_cancelled_while_waiting_for_capacity_holds_nothing() -> None:
    capacity = Capacity(2)
    async with capacity.reserve(1):
        opening = asyncio.create_task(aioproc.open_pool(2, capacity=capacity).__aenter__())
        while not capacity.waiting:
            await asyncio.sleep(0)  # loop turns, until its open joins the queue
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        assert (capacity.in_use, capacity.waiting) == (1, 0)
    async with aioproc.open_pool(2, capacity=capacity) as pool:
        assert capacity.in_use == 2
        assert len(await pool.run(os.getpid)) == 2
    assert capacity.in_use == 0


# --------------------------------------------------------------------- usage


async def test_usage_of_a_worker_after_close() -> None:
    tracked = any("memory" in h.controllers for h in cgroup_host().hierarchies)
    async with aioproc.open_worker(limits=Limits(memory="1G") if tracked else None) as worker:
        assert await worker.call(burn, 0.5) == 0.5
        assert await worker.call(allocate, 100) == 100
        assert worker.usage is None  # running: nothing reaped yet
    usage = worker.usage
    assert isinstance(usage, Usage)
    assert usage.cpu_time >= 0.4, usage
    assert usage.max_rss >= 100 * MiB, usage
    if tracked:  # its own cgroup counted the tree
        assert usage.tree_max_memory is not None and usage.tree_max_memory >= 100 * MiB, usage


async def test_a_replaced_pool_worker_gives_its_usage() -> None:
    async with aioproc.open_pool(1, max_calls_per_worker=1) as pool:
        (old,) = pool._workers
        assert old is not None
        await pool.submit(burn, 0.3)  # then it is recycled: reaped by the pool
        await pool.submit(burn, 0.0)  # on the replacement
        await old.aclose()  # waits for the pool's own close of it
        assert old.usage is not None and old.usage.cpu_time >= 0.25, old.usage


# ------------------------------------------------------------------- metrics


class PoolCalls(hooks.NullRecorder):
    """On, and notes every pool call it is told of."""

    enabled = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float]] = []

    def pool_call(self, pool: str, outcome: str, seconds: float) -> None:
        self.calls.append((pool, outcome, seconds))


async def test_pool_calls_are_counted_by_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = PoolCalls()
    monkeypatch.setattr(hooks, "current", spy)
    async with aioproc.open_pool(2, name="counted") as pool:
        assert await pool.submit(burn, 0.0) == 0.0
        assert len(await pool.run(os.getpid)) == 2
        with pytest.raises(ValueError, match="no"):
            await pool.submit(fail, "no")
        with pytest.raises(TimeoutError, match="fn's own"):
            await pool.submit(raise_timeout)  # fn's TimeoutError: a failure, not a timeout
        with pytest.raises(BrokenWorkerError):
            await pool.submit(os._exit, 1)
        with pytest.raises(TimeoutError, match=r"timed out after timeout=0\.2 s"):
            await pool.submit(time.sleep, 30, timeout=0.2)
        call = asyncio.create_task(pool.submit(time.sleep, 30))
        await asyncio.sleep(0)  # a loop turn: the call has begun
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    outcomes = [outcome for _, outcome, _ in spy.calls]
    assert outcomes == [
        "succeeded",
        "succeeded",
        "succeeded",
        "failed",
        "failed",
        "broken",
        "timeout",
        "cancelled",
    ], spy.calls
    assert {pool for pool, _, _ in spy.calls} == {"counted"}
    assert all(seconds >= 0 for _, _, seconds in spy.calls)
    assert spy.calls[6][2] >= 0.2  # the timeout's latency


async def test_a_timed_out_calls_latency_is_never_shorter_than_its_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The latency is read on the timeout's own clock (uvloop's lags the
    monotonic clock by up to a millisecond: read there, a timeout that fired
    in a busy loop's turn could read shorter than itself)."""

    async def busy_loop() -> None:
        while True:  # a loop that never sleeps in epoll: timers fire on its clock alone
            await asyncio.sleep(0)

    spy = PoolCalls()
    monkeypatch.setattr(hooks, "current", spy)
    async with aioproc.open_pool(1, name="late") as pool:
        busy = asyncio.create_task(pool.submit(time.sleep, 30))  # holds the one worker
        await asyncio.sleep(0)  # a loop turn: the call has taken it
        assert pool.stats().busy == 1
        spinner = asyncio.create_task(busy_loop())
        try:
            for _ in range(40):  # calls that time out waiting for it
                with pytest.raises(TimeoutError, match=r"timed out after timeout=0\.013 s"):
                    await pool.submit(os.getpid, timeout=0.013)
        finally:
            spinner.cancel()
            busy.cancel()
        with pytest.raises(asyncio.CancelledError):
            await busy
    latencies = [seconds for _, outcome, seconds in spy.calls if outcome == "timeout"]
    assert len(latencies) == 40, spy.calls
    assert min(latencies) >= 0.013, sorted(latencies)[:5]


async def test_pool_metrics_render_and_cost_nothing_when_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorder = aioproc.metrics.enable()
    try:
        async with aioproc.open_pool(1, name="rendered") as pool:
            await pool.submit(burn, 0.0)
            with pytest.raises(BrokenWorkerError):
                await pool.submit(os._exit, 1)
        text = aioproc.metrics.render(recorder)
    finally:
        aioproc.metrics.disable()
    for line in (
        'aioproc_pool_calls_total{outcome="succeeded",pool="rendered"} 1.0',
        'aioproc_pool_calls_total{outcome="broken",pool="rendered"} 1.0',
        'aioproc_pool_call_seconds_count{pool="rendered"} 2.0',
    ):
        assert line in text, text

    class Spy(hooks.NullRecorder):
        def __init__(self) -> None:
            self.calls: list[str] = []

        def __getattribute__(self, name: str) -> Any:
            if not name.startswith("_") and name not in ("enabled", "calls"):
                object.__getattribute__(self, "calls").append(name)
            return object.__getattribute__(self, name)

    spy = Spy()
    monkeypatch.setattr(hooks, "current", spy)
    async with aioproc.open_pool(1) as pool:
        await pool.submit(burn, 0.0)
        await pool.run(os.getpid)
        with pytest.raises(ValueError, match="x"):
            await pool.submit(fail, "x")
    assert spy.calls == []


# ---------------------------------------------------------------------- cpus


@pytest.mark.parametrize("kind", ["function", "forked", "binary"])
async def test_each_rank_runs_on_the_cpus_asked(kind: str, tmp_path: Path) -> None:
    need_cpus(2)
    asked = {0: [ALLOWED[-1]], 1: ALLOWED[:-1], 2: ALLOWED}
    method = "forkserver" if kind == "forked" else "spawn"
    if kind == "binary":
        files = {r: str(tmp_path / f"rank{r}") for r in asked}
        await aioproc.run(
            sys.executable,
            3,
            {r: ("-c", AFFINITY_CODE, files[r]) for r in asked},
            cpus=asked,
            sinks=[],
        )
        got = {r: eval(Path(files[r]).read_text()) for r in asked}
    else:
        result = await aioproc.run(affinity_of, 3, cpus=asked, start_method=method, sinks=[])
        got = result.return_values
    assert got == asked


@pytest.mark.parametrize("kind", ["function", "binary"])
async def test_round_robin_gives_each_rank_one_allowed_cpu_in_turn(
    kind: str, tmp_path: Path
) -> None:
    need_cpus(2)
    n = len(ALLOWED) + 1  # one more rank than CPUs: the turn wraps
    expected = {r: [ALLOWED[r % len(ALLOWED)]] for r in range(n)}
    if kind == "binary":
        files = {r: str(tmp_path / f"rank{r}") for r in range(n)}
        await aioproc.run(
            sys.executable,
            n,
            {r: ("-c", AFFINITY_CODE, files[r]) for r in range(n)},
            cpus="round-robin",
            sinks=[],
        )
        got = {r: eval(Path(files[r]).read_text()) for r in range(n)}
    else:
        got = (await aioproc.run(affinity_of, n, cpus="round-robin", sinks=[])).return_values
    assert got == expected
    # the same list for the whole group
    one = (await aioproc.run(affinity_of, 2, cpus=[ALLOWED[0]], sinks=[])).return_values
    assert one == {0: [ALLOWED[0]], 1: [ALLOWED[0]]}


def test_numa_nodes_name_their_cpus_or_the_missing_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    node = tmp_path / "node1"
    node.mkdir()
    (node / "cpulist").write_text(f"{ALLOWED[0]}\n")
    monkeypatch.setattr(affinity, "NODE_ROOT", tmp_path)
    assert resources.check_cpus("numa:1", 2) == {0: (ALLOWED[0],), 1: (ALLOWED[0],)}
    with pytest.raises(ValueError, match=rf"{tmp_path}/node0/cpulist does not exist \(nodes "):
        resources.check_cpus("numa:0", 1)
    monkeypatch.setattr(affinity, "NODE_ROOT", tmp_path / "none")
    missing = tmp_path / "none" / "node0" / "cpulist"
    with pytest.raises(ValueError, match=rf"{missing} does not exist \(no NUMA information"):
        aioproc.open_pool(1, cpus="numa:0")
    assert affinity.parse_cpulist("0-2,5,7-8\n") == (0, 1, 2, 5, 7, 8)


async def test_numa_cpus_on_this_machine(tmp_path: Path) -> None:
    listed = Path("/sys/devices/system/node/node0/cpulist")
    if not listed.exists():
        pytest.skip(f"{listed} does not exist: no NUMA information here")
    node0 = [c for c in affinity.parse_cpulist(listed.read_text()) if c in ALLOWED]
    result = await aioproc.run(affinity_of, 2, cpus="numa:0", sinks=[])
    assert result.return_values == {0: node0, 1: node0}


BAD_CPUS = [
    ([], ValueError, r"cpus=\[\] is empty: name at least one CPU"),
    ([max(ALLOWED) + 1000], ValueError, rf"CPU {max(ALLOWED) + 1000} not in this process's"),
    ({5: [ALLOWED[0]]}, ValueError, r"cpus: local rank 5 is not in the group \(ranks 0..1\)"),
    ({0: []}, ValueError, r"cpus\[0\]=\[\] is empty"),
    ({0: "round-robin"}, ValueError, r"round-robin is for the whole group"),
    (["0"], TypeError, r"CPU ids must be ints, got '0'"),
    ([True], TypeError, r"CPU ids must be ints, got True"),
    ("all", ValueError, r"cpus='all': a string must be 'numa:<node>' or 'round-robin'"),
    ("numa:9999", ValueError, r"node9999/cpulist does not exist"),
    (3, TypeError, r"cpus must be a list of CPU ids, 'numa:<node>' or 'round-robin', got 3"),
]


@pytest.mark.parametrize(("cpus", "error", "match"), BAD_CPUS)
async def test_bad_cpus_raise_before_anything_starts(
    cpus: Any, error: type[Exception], match: str
) -> None:
    events: list[aioproc.WorkerEvent] = []
    with pytest.raises(error, match=match):
        aioproc.start_processes(
            "bad", "true", {0: (), 1: ()}, {0: {}, 1: {}}, cpus=cpus, on_event=events.append
        )
    with pytest.raises(error, match=match):
        await aioproc.run("true", 2, cpus=cpus)
    assert events == []
    # a pool takes cpus as a group does, its positions standing for local ranks
    with pytest.raises(error, match=match):
        aioproc.open_pool(2, cpus=cpus)
    if not isinstance(cpus, dict):  # a worker is a group of one: rank 5 is another message
        with pytest.raises(error, match=match):
            aioproc.open_worker(cpus=cpus)


async def test_pool_and_worker_cpus(tmp_path: Path) -> None:
    need_cpus(2)
    async with aioproc.open_pool(2, cpus="round-robin") as pool:
        assert await pool.run(affinity_of) == [[ALLOWED[0]], [ALLOWED[1]]]
        # a replacement runs where the worker it replaces ran
        old = pool.pids()
        os.kill(old[1], signal.SIGKILL)
        assert await pool.run(affinity_of) == [[ALLOWED[0]], [ALLOWED[1]]]
        assert pool.pids()[1] != old[1]
    async with aioproc.open_pool(2, cpus=[ALLOWED[1]], start_method="forkserver") as pool:
        assert await pool.run(affinity_of) == [[ALLOWED[1]], [ALLOWED[1]]]
    async with aioproc.open_pool(2, cpus={1: [ALLOWED[1]]}) as pool:
        # as a group's ranks: the position named runs on its CPUs, the other where we may
        assert await pool.run(affinity_of) == [list(ALLOWED), [ALLOWED[1]]]
    async with aioproc.open_worker(cpus={0: [ALLOWED[1]]}) as worker:
        assert await worker.call(affinity_of) == [ALLOWED[1]]
    async with aioproc.open_worker(cpus="round-robin") as first:
        async with aioproc.open_worker(cpus="round-robin") as second:
            # one CPU each, the next one of the allowed set for each worker opened
            a, b = await first.call(affinity_of), await second.call(affinity_of)
    assert len(a) == len(b) == 1 and a != b and {*a, *b} <= set(ALLOWED)
