"""Limits, usage, the process budget and metrics, wired into ``start_processes`` and ``run``.

The mechanisms themselves are tested on their own in ``test_limits``,
``test_capacity`` and ``test_metrics``; here a group of real workers
(function and binary) uses them end to end.  A test that needs a cgroup
skips, saying why, where this process cannot make one.  Every async test
runs on asyncio and on uvloop (``conftest.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import random
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import cgroup_host, need_cgroup, parent_of
from proc_utils import Fifo

import aioproc
import aioproc.metrics
from aioproc import (
    Capacity,
    ChildFailedError,
    DefaultLogsSpecs,
    FileSink,
    ForcedKillWarning,
    Limits,
    Std,
    Usage,
)
from aioproc._group import resources
from aioproc._limits import affinity, placement
from aioproc._metrics import hooks

MiB = 1 << 20
NO_LOGS = DefaultLogsSpecs(log_dir=os.devnull)  # a failure leaves no error file behind
OOM_TEXT = "killed by the kernel's OOM killer: memory limit 64 MiB reached"
KINDS = pytest.mark.parametrize("kind", ["function", "binary"])


@pytest.fixture(autouse=True)
def _metrics_restored() -> Iterator[None]:
    """Every test leaves the process-wide recorder as it found it (off)."""
    before = hooks.current
    yield
    hooks.current = before


# ------------------------------------------------------------------ workers

ALLOCATE = "data = bytearray({mib} << 20)\ndata[::4096] = b'x' * len(data[::4096])\n"
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}:\n    pass\n"
FORK_BOMB = (Path(__file__).parent / "children" / "fork_bomb.py").read_text()


def allocate(mib: int) -> int:
    exec(ALLOCATE.format(mib=mib))
    return mib


def burn(seconds: float, fail: bool = False) -> None:
    exec(BURN.format(s=seconds))
    if fail:
        raise RuntimeError("burnt, then failed")


def fork_bomb() -> tuple[int, int | None]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(FORK_BOMB)
    forked, error = out.getvalue().split()
    return int(forked), None if error == "None" else int(error)


def entry(kind: str, fn: str, *args: Any) -> tuple[Any, tuple[Any, ...]]:
    """``(entrypoint, args)`` running ``fn``'s code as a function or a binary worker."""
    if kind == "function":
        return globals()[fn], args
    code = {
        "allocate": lambda mib: ALLOCATE.format(mib=mib),
        "burn": lambda s, fail=False: BURN.format(s=s) + ("raise SystemExit(3)\n" if fail else ""),
        "fork_bomb": lambda: FORK_BOMB,
    }[fn](*args)
    return sys.executable, ("-c", code)


async def start_and_wait(
    kind: str, fn: str, *args: Any, nprocs: int = 1, **kw: Any
) -> tuple[aioproc.RunProcsResult, list[aioproc.WorkerEvent]]:
    events: list[aioproc.WorkerEvent] = []
    entrypoint, argv = entry(kind, fn, *args)
    kw.setdefault("logs_specs", DefaultLogsSpecs(log_dir=os.devnull))
    async with aioproc.start_processes(
        kind,
        entrypoint,
        {r: argv for r in range(nprocs)},
        {r: {} for r in range(nprocs)},
        on_event=events.append,
        sinks=[],
        **kw,
    ) as pc:
        result = await pc.wait()
    assert result is not None
    return result, events


def exited(events: list[aioproc.WorkerEvent]) -> dict[int, aioproc.WorkerEvent]:
    return {e.local_rank: e for e in events if e.kind == "exited"}


# ------------------------------------------------------------------ checks


@pytest.mark.parametrize(
    ("limits", "capacity", "error", "match"),
    [
        ("1G", None, TypeError, r"limits must be an aioproc.Limits .*got '1G'"),
        ({5: Limits()}, None, ValueError, r"local rank 5 is not in the group \(ranks 0..1\)"),
        ({"0": Limits()}, None, TypeError, r"keys must be local ranks \(ints\), got '0'"),
        ({0: "64M"}, None, TypeError, r"limits\[0\] must be an aioproc.Limits, got '64M'"),
        (None, 16, TypeError, r"capacity must be an aioproc.Capacity, got 16"),
        (None, Capacity(1), ValueError, r"a group of 2 workers never fits in <Capacity 0/1"),
    ],
)
async def test_bad_limits_and_capacity_raise_before_anything_starts(
    limits: Any, capacity: Any, error: type[Exception], match: str
) -> None:
    events: list[aioproc.WorkerEvent] = []
    with pytest.raises(error, match=match):
        aioproc.start_processes(
            "bad",
            "true",
            {0: (), 1: ()},
            {0: {}, 1: {}},
            limits=limits,
            capacity=capacity,
            on_event=events.append,
        )
    with pytest.raises(error, match=match):
        await aioproc.run("true", 2, limits=limits, capacity=capacity)
    assert events == []


# ------------------------------------------------------------------ limits


@pytest.mark.parametrize("kind", ["function", "forked", "binary"])
async def test_a_rank_past_its_memory_limit_is_reported_oom_killed(kind: str) -> None:
    need_cgroup("memory")
    events: list[aioproc.WorkerEvent] = []
    # a forked worker is joined while it waits at its template's gate
    method = "forkserver" if kind == "forked" else "spawn"
    entrypoint, argv = entry("function" if kind == "forked" else kind, "allocate", 256)
    async with aioproc.start_processes(
        "oom",
        entrypoint,
        {0: argv},
        {0: {}},
        start_method=method,
        limits=Limits(memory="64M"),
        on_event=events.append,
        sinks=[],
    ) as pc:
        result = await pc.wait()
    assert result is not None and result.is_failed()
    failure = result.failures[0]
    assert (failure.exitcode, failure.oom) == (-signal.SIGKILL, OOM_TEXT)
    assert failure.message == f"Signal 9 (SIGKILL) received by PID {failure.pid}"  # torch's
    summary = str(ChildFailedError("oom", result.failures))
    assert f"  oom       : {OOM_TEXT}\n" in summary
    assert exited(events)[0].oom == OOM_TEXT
    # killed on its way to 256 MiB; its ru_maxrss cannot show it, since Linux
    # carries the launcher's own peak into a process it execs
    assert result.usage[0].tree_max_memory is not None
    assert result.usage[0].tree_max_memory <= 64 * MiB
    with pytest.raises(ChildFailedError, match="killed by the kernel's OOM killer"):
        await aioproc.run(
            entrypoint,
            1,
            argv,
            limits=Limits(memory="64M"),
            sinks=[],
            logs_specs=NO_LOGS,
            start_method=method,
        )


DEAF = (
    "import signal, sys\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "open(sys.argv[1], 'w').write('ready\\n')\n"
    "signal.pause()\n"
)
HOG_ON_SIGTERM = (
    "import signal, sys\n"
    "def hog(*_):\n"
    "    " + ALLOCATE.format(mib=256).replace("\n", "\n    ") + "\n"
    "signal.signal(signal.SIGTERM, hog)\n"
    "open(sys.argv[1], 'w').write('ready\\n')\n"
    "signal.pause()\n"
)


async def test_a_sigkill_aioproc_sent_is_never_taken_for_the_oom_kill_beside_it(
    tmp_path: Path,
) -> None:
    """A close stops two ranks sharing a 64 MiB cgroup: rank 0 ignores SIGTERM
    and is SIGKILLed when the grace period ends; rank 1 answers SIGTERM by
    allocating past the limit and is killed by the OOM killer.  Both die of
    SIGKILL and are recorded in one pass, rank 0 first, with one OOM kill
    counted: it is rank 1's, not the first SIGKILL recorded."""
    need_cgroup("memory")
    events: list[aioproc.WorkerEvent] = []
    async with Fifo(tmp_path / "fifo") as fifo:
        pc = await aioproc.start_processes(
            "deaf",
            sys.executable,
            {0: ("-c", DEAF, fifo.path), 1: ("-c", HOG_ON_SIGTERM, fifo.path)},
            {0: {}, 1: {}},
            limits=Limits(memory="64M"),
            on_event=events.append,
            logs_specs=NO_LOGS,
            sinks=[],
        )
        try:
            await fifo.lines(2)
            with pytest.warns(ForcedKillWarning, match=r"deaf/0 \(pid"):
                await pc.close(timeout=2)
        finally:
            await pc.close(signal.SIGKILL)
    result = pc.poll()
    assert result is not None
    assert {r: (f.exitcode, f.oom) for r, f in result.failures.items()} == {
        0: (-signal.SIGKILL, ""),
        1: (-signal.SIGKILL, OOM_TEXT),
    }
    summary = str(ChildFailedError("deaf", result.failures))
    assert summary.count("  oom       :") == 1
    assert {r: e.oom for r, e in exited(events).items()} == {0: None, 1: OOM_TEXT}


INSIDE_TEXT = (
    "a process in its cgroup was killed by the kernel's OOM killer: memory limit 64 MiB reached"
)
# a child allocating past the rank's limit; the rank goes on and exits 3
OOM_CHILD = (
    "import subprocess, sys\n"
    f"code = subprocess.run([sys.executable, '-c', {ALLOCATE.format(mib=256)!r}]).returncode\n"
    "print('child', code, flush=True)\n"
)


def oom_child(limited: bool = True) -> None:
    if not limited:
        return  # the rank beside it, without a limit: it succeeds and blames no one
    exec(OOM_CHILD)
    raise RuntimeError("my child was killed")


@KINDS
async def test_an_oom_kill_inside_a_rank_is_named_in_its_failure(kind: str) -> None:
    """The rank's child dies of the OOM killer in the rank's cgroup; the rank itself
    fails otherwise (exit 3, or an exception): its failure names the OOM kill."""
    need_cgroup("memory")
    events: list[aioproc.WorkerEvent] = []
    if kind == "function":
        entrypoint: Any = oom_child
        argv: tuple[Any, ...] = ()
    else:
        entrypoint, argv = sys.executable, ("-c", OOM_CHILD + "raise SystemExit(3)\n")
    async with aioproc.start_processes(
        "inside",
        entrypoint,
        {0: argv, 1: ("-c", "pass") if kind == "binary" else (False,)},
        {0: {}, 1: {}},
        limits={0: Limits(memory="64M")},
        on_event=events.append,
        logs_specs=NO_LOGS,
        sinks=[],
    ) as pc:
        result = await pc.wait()
    assert result is not None and result.is_failed()
    failure = result.failures[0]
    assert (failure.exitcode, failure.oom) == (3 if kind == "binary" else 1, INSIDE_TEXT)
    assert f"  oom       : {INSIDE_TEXT}\n" in str(ChildFailedError("inside", result.failures))
    assert exited(events)[0].oom == INSIDE_TEXT


DEAF_AFTER_OOM = OOM_CHILD + DEAF.replace("import signal, sys\n", "import signal\n")


async def test_a_rank_aioproc_killed_names_the_oom_kill_of_its_child_not_its_own(
    tmp_path: Path,
) -> None:
    """A rank whose child the OOM killer took, then SIGKILLed by aioproc at the end
    of the grace period: its failure names the child's OOM kill, never its own
    death as one; a rank that ends without any OOM kill names none."""
    need_cgroup("memory")
    events: list[aioproc.WorkerEvent] = []
    async with Fifo(tmp_path / "fifo") as fifo:
        pc = await aioproc.start_processes(
            "deaf",
            sys.executable,
            {0: ("-c", DEAF_AFTER_OOM, fifo.path), 1: ("-c", DEAF, fifo.path)},
            {0: {}, 1: {}},
            limits=Limits(memory="64M"),
            on_event=events.append,
            logs_specs=NO_LOGS,
            sinks=[],
        )
        try:
            await fifo.lines(2)
            with pytest.warns(ForcedKillWarning, match=r"deaf/0 \(pid"):
                await pc.close(timeout=1)
        finally:
            await pc.close(signal.SIGKILL)
    result = pc.poll()
    assert result is not None
    assert {r: (f.exitcode, f.oom) for r, f in result.failures.items()} == {
        0: (-signal.SIGKILL, INSIDE_TEXT),
        1: (-signal.SIGKILL, ""),
    }
    assert {r: e.oom for r, e in exited(events).items()} == {0: INSIDE_TEXT, 1: None}


async def test_one_limits_is_each_ranks_own() -> None:
    """``Limits(memory="64M")`` is every rank's, as ``--memory-limit`` is: two ranks
    of 24 MiB both fit, each in a cgroup of its own; a rank past it is OOM-killed
    and named, and the rank beside it is not blamed.  (An interpreter with aioproc
    loaded peaks near 22 MiB, page cache included, so 24 MiB more leaves a margin.)"""
    need_cgroup("memory")
    result = await aioproc.run(allocate, 2, (24,), limits=Limits(memory="64M"), sinks=[])
    assert result.return_values == {0: 24, 1: 24}
    trees = {r: u.tree_max_memory for r, u in result.usage.items()}
    assert all(t is not None and 24 * MiB <= t <= 64 * MiB for t in trees.values()), trees
    async with aioproc.start_processes(
        "over",
        allocate,
        {0: (16,), 1: (256,)},
        {0: {}, 1: {}},
        limits=Limits(memory="64M"),
        logs_specs=NO_LOGS,
        sinks=[],
    ) as pc:
        over = await pc.wait()
    assert over is not None
    assert (over.failures[1].exitcode, over.failures[1].oom) == (-signal.SIGKILL, OOM_TEXT)
    # rank 0 returned, or was stopped by rank 1's failure: never an OOM kill of its own
    assert 0 not in over.failures or over.failures[0].oom == ""


@KINDS
async def test_without_cgroups_memory_is_an_rlimit_and_the_allocation_fails(
    kind: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(resources, "BACKENDS", ("rlimit",))
    caplog.set_level(logging.INFO, "aioproc")
    entrypoint, argv = entry(kind, "allocate", 256)
    with pytest.raises(ChildFailedError) as caught:
        await aioproc.run(
            entrypoint,
            1,
            argv,
            limits=Limits(memory="64M", cpus=1),
            sinks=[],
            logs_specs=NO_LOGS,
        )
    failure = caught.value.failures[0]
    assert failure.oom == ""  # an rlimit never kills
    if kind == "function":
        assert isinstance(caught.value.__cause__, MemoryError)
    else:
        assert failure.exitcode == 1  # python's MemoryError traceback
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(
        m.startswith("limits for ") and "memory 64 MiB: RLIMIT_DATA=67108864" in m for m in infos
    ), infos
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("not enforced here: cpus 1: not enforced" in m for m in warned), warned


@KINDS
async def test_a_pids_limit_stops_a_fork_bomb_in_its_rank_only(kind: str, tmp_path: Path) -> None:
    need_cgroup("pids")
    if kind == "function":
        result = await aioproc.run(fork_bomb, 1, limits=Limits(pids=16), sinks=[])
        forked, error = result.return_values[0]
    else:
        lines: list[str] = []
        await aioproc.run(
            sys.executable,
            1,
            ("-c", FORK_BOMB),
            limits=Limits(pids=16),
            logs_specs=DefaultLogsSpecs(log_dir=tmp_path, tee=Std.ALL),
            sinks=[lambda out: lines.append(out.line)],
        )
        forked_text, error_text = lines[-1].split()
        forked, error = int(forked_text), int(error_text)
    # the worker itself (and a function worker's threads) count among the 16
    assert 0 < forked < 16 and error == errno.EAGAIN, (forked, error)
    # the test process was never limited: it still starts many processes
    procs = [await asyncio.create_subprocess_exec("true") for _ in range(24)]
    assert [await p.wait() for p in procs] == [0] * 24


async def test_a_binary_runs_nothing_outside_its_cgroups_when_the_join_is_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a loaded host the parent's join can land long after the binary's exec: the
    binary enters its cgroups itself first, so its first child is inside them."""
    need_cgroup("pids")
    join = placement.Placement.join

    def late(self: placement.Placement, pid: int) -> None:
        time.sleep(0.5)  # long after the program below has run
        join(self, pid)

    monkeypatch.setattr(placement.Placement, "join", late)
    lines: list[str] = []
    result = await aioproc.run(
        "/bin/sh",
        1,
        ("-c", 'cat /proc/self/cgroup; echo "env:${AIOPROC_CGROUP_PROCS-unset}"'),
        limits=Limits(pids=64),
        logs_specs=DefaultLogsSpecs(log_dir=tmp_path, tee=Std.ALL),
        sinks=[lambda out: lines.append(out.line)],
    )
    assert not result.is_failed(), result
    # the line of the hierarchy that holds the pids controller here
    v1 = any(h.version == 1 and "pids" in h.controllers for h in cgroup_host().hierarchies)
    pids = re.compile(r"\d+:([^:]*,)?pids(,[^:]*)?:" if v1 else "0::")
    (line,) = [line for line in lines if pids.match(line)]
    assert "/aioproc-" in line, lines
    assert lines[-1] == "env:unset"  # the shell's variable does not reach the program


async def test_a_binary_runs_on_its_cpus_from_its_start_when_the_pin_is_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a loaded host the parent's pin can land long after the binary's exec:
    the binary inherits its CPUs at the fork, so what it runs first is on them."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU allowed here: every set is the same")
    pin = affinity.set_affinity

    def late(pid: int, cpus: Any) -> None:
        time.sleep(0.5)  # long after the program below has read its CPUs
        pin(pid, cpus)

    monkeypatch.setattr(affinity, "set_affinity", late)
    lines: list[str] = []
    result = await aioproc.run(
        "/bin/sh",
        2,
        ("-c", "grep Cpus_allowed_list /proc/self/status"),
        cpus={0: [allowed[0]], 1: [allowed[1]]},
        logs_specs=DefaultLogsSpecs(log_dir=tmp_path, tee=Std.ALL),
        sinks=[lambda out: lines.append(f"{out.rank} {out.line}")],
    )
    assert not result.is_failed(), result
    assert sorted(lines) == [
        f"0 Cpus_allowed_list:\t{allowed[0]}",
        f"1 Cpus_allowed_list:\t{allowed[1]}",
    ]
    # the thread that started them (the helper thread) has its own set back
    for tid in os.listdir("/proc/self/task"):
        try:
            cpus = os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            continue  # a thread that ended since the listing
        assert cpus == set(allowed), tid


async def test_limits_per_rank_give_each_rank_its_own_cgroup(
    caplog: pytest.LogCaptureFixture,
) -> None:
    need_cgroup("memory")
    caplog.set_level(logging.INFO, "aioproc")
    result = await aioproc.run(
        allocate, 2, {0: (128,), 1: (16,)}, limits={1: Limits(memory="64M")}, sinks=[]
    )
    assert result.return_values == {0: 128, 1: 16}
    # rank 0 had no limit (128 MiB went through) and no cgroup: no tree figures
    assert result.usage[0].max_rss >= 128 * MiB
    assert result.usage[0].tree_max_memory is None
    # rank 1's own cgroup counted its tree, within its limit
    tree = result.usage[1].tree_max_memory
    assert tree is not None and 16 * MiB <= tree <= 64 * MiB, result.usage[1]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("limits for")]
    assert len(logged) == 1 and logged[0].startswith("limits for allocate: rank 1: memory 64 MiB: ")


# ------------------------------------------------------------------- usage


@KINDS
async def test_usage_of_each_rank_on_success(kind: str) -> None:
    burnt, events = await start_and_wait(kind, "burn", 1.0)
    assert isinstance(burnt.usage[0], Usage)
    assert burnt.usage[0].cpu_time >= 0.8, burnt.usage
    assert burnt.usage[0].cpu_time == pytest.approx(
        burnt.usage[0].user_time + burnt.usage[0].system_time
    )
    grown, _ = await start_and_wait(kind, "allocate", 200, nprocs=2)
    assert sorted(grown.usage) == [0, 1]
    assert all(u.max_rss >= 200 * MiB for u in grown.usage.values()), grown.usage
    # an exit noticed while the group ran: read from the zombie, reaped only at the close
    early = exited(events)[0].usage
    assert early is not None
    assert early.cpu_time == pytest.approx(burnt.usage[0].cpu_time)
    assert early.max_rss == burnt.usage[0].max_rss


@KINDS
async def test_usage_on_failure_and_on_the_exited_event_of_a_stopped_rank(kind: str) -> None:
    result, _ = await start_and_wait(kind, "burn", 0.5, True)
    assert result.is_failed()
    assert result.usage[0].cpu_time >= 0.4, result.usage
    # a rank a close stops is reaped before its "exited" event: it has its usage
    events: list[aioproc.WorkerEvent] = []
    started = asyncio.Event()

    def on_event(event: aioproc.WorkerEvent) -> None:
        events.append(event)
        if event.kind == "started":
            started.set()

    entrypoint, argv = entry(kind, "burn", 60.0)
    async with aioproc.start_processes(
        "stopped", entrypoint, {0: argv}, {0: {}}, on_event=on_event, sinks=[], grace_period=5
    ) as pc:
        await started.wait()
    final = pc.poll()
    assert final is not None and final.failures[0].stopped
    assert exited(events)[0].usage == final.usage[0]
    assert final.usage[0].cpu_time > 0


BIG_SUPERVISOR = """\
import asyncio, os, sys
import aioproc

def allocate(mib):
    data = bytearray(mib << 20)
    data[::4096] = b"x" * len(data[::4096])

async def main(kind):
    entry = allocate if kind == "function" else sys.executable
    code = f"data = bytearray(256 << 20)\\ndata[::4096] = b'x' * len(data[::4096])"
    args = {0: (256,), 1: (1,)} if kind == "function" else {0: ("-c", code), 1: ("-c", "")}
    async with aioproc.start_processes(
        "big", entry, args, {0: {}, 1: {}}, aioproc.DefaultLogsSpecs(log_dir=os.devnull),
        limits={0: aioproc.Limits(memory="64M")}, sinks=[],
    ) as pc:
        result = await pc.wait()
    print(result.failures[0].oom, file=sys.stderr)
    print(result.usage[0].max_rss, result.usage[0].tree_max_memory, result.usage[1].max_rss)

allocate(300)  # this supervisor's own peak, carried into what it execs
asyncio.run(main(sys.argv[1]))
"""


@KINDS
async def test_a_ranks_max_rss_is_its_own_not_its_supervisors_peak(kind: str) -> None:
    """A supervisor whose own peak is 300 MiB starts a rank limited to 64 MiB, which
    the OOM killer ends: the rank's ``max_rss`` is what its cgroup held, not the
    supervisor's peak that Linux carries over the exec into its ``ru_maxrss``; a
    rank without a memory cgroup of its own keeps the kernel's figure."""
    need_cgroup("memory")
    out = await asyncio.create_subprocess_exec(
        sys.executable, "-c", BIG_SUPERVISOR, kind,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(out.communicate(), 60)
    assert out.returncode == 0, stderr.decode()
    assert stderr.decode().strip() == OOM_TEXT
    limited, tree, free = map(int, stdout.split())
    assert limited <= tree <= 64 * MiB, (limited, tree)
    assert free >= 300 * MiB  # no cgroup of its own: the kernel's ru_maxrss, carried over


# ------------------------------------------------------------------ capacity


class OrderedCapacity(Capacity):
    """A ``Capacity`` that notes which task (named by its number) each grant went to."""

    def __init__(self, total: int) -> None:
        super().__init__(total)
        self.granted: list[int] = []
        self.most_held = 0  # slots held at once, at the grants

    async def acquire(self, k: int = 1) -> None:
        await super().acquire(k)
        task = asyncio.current_task()
        assert task is not None
        self.granted.append(int(task.get_name()))
        self.most_held = max(self.most_held, self.in_use)


async def test_groups_through_a_capacity_never_exceed_it_and_start_in_order() -> None:
    capacity = OrderedCapacity(16)
    live = peak = 0

    def on_event(event: aioproc.WorkerEvent) -> None:
        nonlocal live, peak
        live += {"started": 1, "exited": -1}.get(event.kind, 0)
        peak = max(peak, live)

    async def group(size: int) -> None:
        async with aioproc.start_processes(
            "budget",
            "true",
            {r: () for r in range(size)},
            {r: {} for r in range(size)},
            DefaultLogsSpecs(log_dir=os.devnull),
            capacity=capacity,
            on_event=on_event,
            sinks=[],
        ) as pc:
            result = await pc.wait()
        assert result is not None and not result.is_failed()

    rng = random.Random(1234)
    sizes = [rng.randint(1, 8) for _ in range(200)]
    await asyncio.gather(
        *(asyncio.create_task(group(size), name=str(i)) for i, size in enumerate(sizes))
    )
    assert capacity.granted == list(range(200))  # first come, first served
    assert 1 <= peak <= 16, peak  # live workers counted from the events, not the clock
    # groups ran side by side: the first ones are granted before any of them
    # can finish (8 slots or fewer each, so at least 9 of the 16 are taken)
    assert capacity.most_held >= 9, capacity.most_held
    assert (capacity.in_use, capacity.waiting, live) == (0, 0, 0)


async def test_groups_cancelled_while_waiting_for_capacity_hold_nothing() -> None:
    capacity = Capacity(4)
    rng = random.Random(99)
    started: list[int] = []

    async def group(i: int, size: int) -> None:
        await aioproc.run(
            "true",
            size,
            logs_specs=DefaultLogsSpecs(log_dir=os.devnull),
            capacity=capacity,
            sinks=[],
        )
        started.append(i)

    tasks = [asyncio.create_task(group(i, rng.randint(1, 4))) for i in range(40)]
    cancelled = 0
    for task in rng.sample(tasks, 20):
        for _ in range(rng.randint(0, 30)):
            await asyncio.sleep(0)  # a random point in some group's start
        cancelled += task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results), results
    assert cancelled > 0
    assert (capacity.in_use, capacity.waiting) == (0, 0)
    async with capacity.reserve(4):  # every slot can be taken again
        assert capacity.in_use == 4


async def test_a_close_while_waiting_for_capacity_starts_nothing() -> None:
    capacity = Capacity(2)
    events: list[aioproc.WorkerEvent] = []
    pc = aioproc.PContext(
        "waits",
        "true",
        {0: (), 1: ()},
        {0: {}, 1: {}},
        DefaultLogsSpecs(log_dir=os.devnull),
        capacity=capacity,
        on_event=events.append,
        sinks=[],
    )
    async with capacity.reserve(2):
        starting = asyncio.create_task(pc.start())
        while not capacity.waiting:
            await asyncio.sleep(0)  # a few loop turns: until its start joins the queue
        await pc.close()
        await starting
    assert (capacity.in_use, capacity.waiting) == (0, 0)
    assert events == []
    result = pc.poll()
    assert result is not None and sorted(result.failures) == [0, 1]
    assert all(f.pid == -1 for f in result.failures.values())  # never started


# ------------------------------------------------------------------ metrics


@pytest.mark.parametrize("sink", ["lines", "text"])
async def test_metrics_count_groups_workers_and_output(tmp_path: Path, sink: str) -> None:
    """Output lines are counted whether the sinks take lines or runs of them as text."""
    recorder = aioproc.metrics.enable()
    try:
        await aioproc.run(
            sys.executable,
            2,
            ("-c", "print('one'); print('two')"),
            name="counted",
            logs_specs=DefaultLogsSpecs(log_dir=tmp_path / "logs", tee=Std.ALL),
            sinks=[(lambda line: None) if sink == "lines" else FileSink(str(tmp_path / "out"))],
        )
        with pytest.raises(ChildFailedError):
            await aioproc.run(burn, 1, (0.0, True), name="failing", sinks=[], logs_specs=NO_LOGS)
        text = aioproc.metrics.render(recorder)
    finally:
        aioproc.metrics.disable()
    for line in (
        'aioproc_groups_started_total{group="counted",role="default"} 1.0',
        'aioproc_workers_started_total{group="counted",role="default"} 2.0',
        'aioproc_workers_exited_total{group="counted",outcome="succeeded",role="default"} 2.0',
        'aioproc_groups_exited_total{group="counted",outcome="succeeded",role="default"} 1.0',
        'aioproc_workers_exited_total{group="failing",outcome="failed",role="default"} 1.0',
        'aioproc_groups_exited_total{group="failing",outcome="failed",role="default"} 1.0',
        'aioproc_output_lines_total{group="counted",role="default",stream="stdout"} 4.0',
        'aioproc_output_bytes_total{group="counted",role="default",stream="stdout"} 16.0',
        'aioproc_workers_running{group="counted",role="default"} 0.0',
    ):
        assert line in text, text


class SpyRecorder(hooks.NullRecorder):
    """Off, like the default, but notes every hook that is called anyway."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_") and name not in ("enabled", "calls"):
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)


async def test_disabled_metrics_call_no_hook(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spy = SpyRecorder()
    monkeypatch.setattr(hooks, "current", spy)
    await aioproc.run(
        sys.executable,
        2,
        ("-c", "print('quiet')"),
        logs_specs=DefaultLogsSpecs(log_dir=tmp_path, tee=Std.ALL),
        sinks=[lambda line: None],
    )
    with pytest.raises(ChildFailedError):
        await aioproc.run(burn, 1, (0.0, True), sinks=[], logs_specs=NO_LOGS)
    assert spy.calls == []


GROW_THEN_WAIT = (
    "import sys\n"
    "b = bytearray(100 << 20)\n"
    "for i in range(0, len(b), 4096):\n"
    "    b[i] = 1\n"
    "open(sys.argv[1]).read()  # until the test opens and closes the fifo\n"
)


async def test_sample_interval_reports_each_running_workers_live_figures(tmp_path: Path) -> None:
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    grown = asyncio.Event()
    events: list[aioproc.WorkerEvent] = []

    def on_event(event: aioproc.WorkerEvent) -> None:
        events.append(event)
        usage = event.usage
        if event.kind == "sampled" and usage is not None and (usage.rss or 0) >= 100 * MiB:
            grown.set()

    async with aioproc.start_processes(
        "sampled",
        sys.executable,
        {0: ("-c", GROW_THEN_WAIT, str(fifo))},
        {0: {}},
        aioproc.DefaultLogsSpecs(log_dir=os.devnull),
        on_event=on_event,
        sample_interval=0.05,
    ) as pc:
        pid = pc.pids()[0]
        await asyncio.wait_for(grown.wait(), 60)
        with open(fifo, "w"):  # returns once the worker, done allocating, opens it to read
            pass
        result = await pc.wait()
    assert result is not None and not result.is_failed()
    samples = [e for e in events if e.kind == "sampled"]
    assert all(e.local_rank == 0 and e.pid == pid and e.exitcode is None for e in samples)
    # the one that saw it grown (later ones may catch it freeing its memory as it exits)
    seen = next(e.usage for e in samples if e.usage is not None and (e.usage.rss or 0) >= 100 * MiB)
    assert seen is not None and seen.rss is not None
    assert seen.max_rss >= seen.rss >= 100 * MiB
    assert seen.cpu_time == pytest.approx(seen.user_time + seen.system_time)
    assert all(e.usage is not None and e.usage.max_rss >= (e.usage.rss or 0) for e in samples)
    # none after the exit: the sampler ends with the group
    kinds = [e.kind for e in events]
    assert "sampled" not in kinds[kinds.index("exited") :]
    assert result.usage[0].rss is None  # figures taken at exit


@pytest.mark.parametrize(
    ("interval", "error"),
    [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), ("1", TypeError)],
)
async def test_bad_sample_intervals_start_nothing(interval: object, error: type[Exception]) -> None:
    events: list[aioproc.WorkerEvent] = []
    with pytest.raises(error, match="sample_interval"):
        aioproc.start_processes(
            "bad", "true", {0: ()}, {0: {}}, on_event=events.append,
            sample_interval=interval,  # type: ignore[arg-type]
        )  # fmt: skip
    assert events == []


# ------------------------------------------------------------------ a crash

CGROUPED = """\
import asyncio, sys
import aioproc

async def main():
    pc = await aioproc.start_processes(
        "crash", sys.executable, {0: ("-c", "import time; time.sleep(3600)")}, {0: {}},
        limits=aioproc.Limits(memory="256M"),
    )
    paths = [str(p) for p in pc._sup._resources.placement_of(0).cgroups]
    print("ready", pc.pids()[0], *paths, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_sigkilled_supervisors_cgroups_are_removed_by_its_guardian() -> None:
    """Nothing of the supervisor runs to remove them: its guardian does, once the
    worker it killed has left them."""
    need_cgroup("memory")
    from proc_utils import still_alive_after

    sup = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CGROUPED, stdout=asyncio.subprocess.PIPE
    )
    assert sup.stdout is not None
    paths: list[Path] = []
    try:
        line = (await asyncio.wait_for(sup.stdout.readline(), 30)).decode().split()
        assert line[0] == "ready", line
        worker, paths = int(line[1]), [Path(p) for p in line[2:]]
        assert paths and all(p.is_dir() for p in paths)
        assert all(str(worker) in (p / "cgroup.procs").read_text().split() for p in paths)
        guardians = [
            int(p)
            for p in os.listdir("/proc")
            if p.isdigit() and parent_of(int(p)) == sup.pid and _is_guardian(int(p))
        ]
        assert len(guardians) == 1
        sup.kill()
        await sup.wait()
        # the guardian kills the worker, sweeps, removes the cgroups, then exits
        assert await still_alive_after([worker, *guardians], 20) == set()
        assert [p for p in paths if p.exists()] == []
    finally:
        if sup.returncode is None:
            sup.kill()
            await sup.wait()
        for path in paths:  # what a failed run left: emptied by the kill above
            if path.exists():
                path.rmdir()


def _is_guardian(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"aioproc-guardian" in f.read()
    except OSError:
        return False


STARTS = str(Path(__file__).parent / "children" / "cgroup_starts.py")
BACKEND_KINDS = pytest.mark.parametrize("backend", ["cgroup1", "cgroup2"])


def cgroup_parents(backend: str) -> list[Path]:
    """Where ``backend``'s groups with memory and pids limits are made, or skip."""
    version = int(backend[-1])
    hierarchies = [h for h in cgroup_host().hierarchies if h.version == version]
    offered = set().union(*(h.controllers for h in hierarchies))
    if not {"memory", "pids"} <= offered:
        pytest.skip(
            f"this process cannot make {backend} groups with memory and pids "
            f"(notes: {'; '.join(cgroup_host().notes) or 'none'})"
        )
    return sorted({h.parent for h in hierarchies})


def cgroups_of(parents: list[Path], supervisors: list[int]) -> list[Path]:
    """The cgroup directories ``supervisors`` made under ``parents`` that still exist."""
    names = tuple(f"aioproc-{pid}-" for pid in supervisors)
    return sorted(p / n for p in parents for n in os.listdir(p) if n.startswith(names))


def _guardians_in(root: Path) -> set[int]:
    """Guardians working in ``root`` (a guardian keeps its supervisor's directory)."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit() and _is_guardian(int(name)):
            try:
                if os.readlink(f"/proc/{name}/cwd") == str(root):
                    found.add(int(name))
            except OSError:
                continue
    return found


def _workers_of(supervisors: list[int]) -> set[int]:
    """Live processes whose lifeline names one of ``supervisors`` (their workers)."""
    marks = tuple(f"{pid}-".encode() for pid in supervisors)
    found = set()
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for entry in env:
            name_, _, chain = entry.partition(b"=")
            if name_ == b"AIOPROC_LIFELINE" and any(t.startswith(marks) for t in chain.split(b":")):
                found.add(int(name))
    return found


async def _nothing_left(root: Path, parents: list[Path], supervisors: list[int]) -> None:
    """Once every guardian working in ``root`` has finished: no worker, no cgroup left."""
    from helpers import state

    deadline = time.monotonic() + 25  # the guardians sweep ~1.5 s, then rmdir up to 4 s
    while _guardians_in(root) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _guardians_in(root) == set()
    assert {p for p in _workers_of(supervisors) if state(p) not in ("Z", "")} == set()
    left = cgroups_of(parents, supervisors)
    for path in left:  # what a failing run left, for the next test's sake
        with contextlib.suppress(OSError):
            path.rmdir()
    assert left == []


def supervisor_env() -> dict[str, str]:
    env = dict(os.environ)
    if "uvloop" in type(asyncio.get_running_loop()).__module__:
        env["AIOPROC_LOOP"] = "uvloop"
    return env


@BACKEND_KINDS
@pytest.mark.timeout(120)
async def test_a_supervisor_killed_as_its_cgroups_appear_leaves_none(
    backend: str, tmp_path: Path
) -> None:
    """SIGKILLed right after its first cgroup directory appears (the guardian was
    not running yet), after each rank's, after the last of a group's (no worker
    yet) and as the second group makes its own: the guardian removes them all."""
    parents = cgroup_parents(backend)
    sups = [
        await asyncio.create_subprocess_exec(
            sys.executable, STARTS, backend, str(n), cwd=tmp_path, env=supervisor_env(),
            stdout=asyncio.subprocess.DEVNULL,
        )
        for n in (1, 2, 3, 4, 6, 7, 9)
    ]  # fmt: skip
    try:
        codes = [await asyncio.wait_for(sup.wait(), 60) for sup in sups]
        assert codes == [-signal.SIGKILL] * len(sups)
        await _nothing_left(tmp_path, parents, [sup.pid for sup in sups])
    finally:
        for sup in sups:
            if sup.returncode is None:
                sup.kill()
                await sup.wait()


@BACKEND_KINDS
@pytest.mark.timeout(400)
async def test_supervisors_sigkilled_at_random_moments_of_200_starts_leave_no_cgroup(
    backend: str, tmp_path: Path
) -> None:
    """Supervisors that start groups with per-rank limits back to back, each SIGKILLed
    after a random number of starts and a random part of the next one (a start's
    length is measured as they go: the moments follow the machine's load), 200
    starts in all: no cgroup directory of theirs and no worker outlives them."""
    parents = cgroup_parents(backend)
    rng = random.Random(os.getpid())
    starts = 0
    killed: list[int] = []
    lengths = [0.3]  # seconds between two "started" lines, as seen so far

    async def one() -> int:
        sup = await asyncio.create_subprocess_exec(
            sys.executable, STARTS, backend, "0", cwd=tmp_path, env=supervisor_env(),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert sup.stdout is not None
        killed.append(sup.pid)
        done = 0
        try:
            assert await asyncio.wait_for(sup.stdout.readline(), 120) == b"ready\n"
            last = time.monotonic()
            for _ in range(rng.randrange(8)):
                line = await asyncio.wait_for(sup.stdout.readline(), 120)
                assert line.startswith(b"started "), line
                done, now = done + 1, time.monotonic()
                lengths.append(now - last)
                last = now
            # somewhere in the next start (or between two), wherever it is
            await asyncio.sleep(rng.uniform(0, 1.2 * sorted(lengths)[len(lengths) // 2]))
        finally:
            sup.kill()
            await sup.wait()
        return done

    while starts < 200:
        assert len(killed) < 200, f"only {starts} starts by {len(killed)} supervisors"
        starts += sum(await asyncio.gather(*(one() for _ in range(6))))
    await _nothing_left(tmp_path, parents, killed)
