"""aioproc.pool: pools of persistent workers (``open_pool``), end to end.

TensorFlow's ``MultiProcessPoolRunner`` semantics: workers keep their pids
across calls, an initializer's effects are visible to later calls, a worker
that dies is replaced.  Worker functions live in ``children/pw_funcs.py``
(see tests/test_worker.py); workers that must be inside a call announce
their pid on a FIFO the test reads first.  Nothing synchronises on a sleep.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import os
import random
import re
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import ModuleType

import anyio
import pytest
from helpers import child_pids, open_fds, pid_gone, release_fifo
from proc_utils import Fifo, still_alive_after

import aioproc
from aioproc import BrokenWorkerError, ForcedKillWarning, WorkerPool, WorkerProcess, open_pool
from aioproc.errors import RemoteTraceback


class Dropped:
    """Safety net for tests that make the pool replace a worker.

    The pool reaps a replaced worker itself (``test_replaced_worker_is_reaped``);
    tests that replace workers also record them (``keep``) and close them at
    teardown, so a regression shows up in that one test instead of as leaks
    everywhere.  ``aclose`` is idempotent, so normally this does nothing.
    """

    def __init__(self) -> None:
        self.workers: list[WorkerProcess] = []

    def keep(self, pool: WorkerPool) -> None:
        self.workers += [w for w in pool._workers if w is not None]


@pytest.fixture
async def dropped() -> AsyncIterator[Dropped]:
    d = Dropped()
    yield d
    for w in d.workers:
        await w.aclose()


def live_pids(pool: WorkerPool) -> list[int]:
    pids = pool.pids()
    assert all(isinstance(p, int) for p in pids), pids
    return [p for p in pids if p is not None]


# ------------------------------------------------------------ basics


async def test_pids_are_the_same_across_four_runs(pw: ModuleType) -> None:
    async with open_pool(3) as pool:
        assert pool.size == 3
        first = live_pids(pool)
        assert len(set(first)) == 3 and os.getpid() not in first
        for _ in range(4):
            assert await pool.run(os.getpid) == first
        assert [ppid for _, ppid in await pool.run(pw.pids)] == [os.getpid()] * 3
        assert pool.pids() == first
    for pid in first:
        assert pid_gone(pid)
    with pytest.raises(RuntimeError, match="closed"):
        await pool.run(os.getpid)
    with pytest.raises(RuntimeError, match="closed"):
        await pool.submit(os.getpid)


async def test_await_form_and_run_arguments(pw: ModuleType) -> None:
    pool = await open_pool(2, name="calc")
    try:
        assert await pool.run(pw.add, (2,), {"b": 5}) == [7, 7]
        assert await pool.submit(pw.add, 1, b=2) == 3
        assert repr(pool) == "<WorkerPool size=2 live=2 busy=0>"
    finally:
        await pool.aclose()
    await pool.aclose()  # idempotent
    assert pool.pids() == [None, None]


async def test_exception_in_fn_leaves_the_pids_unchanged(pw: ModuleType) -> None:
    async with open_pool(2) as pool:
        pids = live_pids(pool)
        with pytest.raises(pw.CallFailed, match=r"^broadcast failed$") as info:
            await pool.run(pw.raise_call_failed, ("broadcast failed",))
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        assert "raise CallFailed(message)" in str(cause)
        with pytest.raises(pw.CallFailed, match=r"^one failed$"):
            await pool.submit(pw.raise_call_failed, "one failed")
        assert pool.pids() == pids
        assert await pool.run(os.getpid) == pids


async def test_initializer_state_is_visible_to_later_calls(pw: ModuleType) -> None:
    async with open_pool(2, initializer=pw.set_counter, initargs=(1,)) as pool:
        assert await pool.run(pw.get_counter) == [1, 1]  # TensorFlow's [1, 1]
        assert await pool.run(pw.bump_counter) == [2, 2]  # module state persists
        assert await pool.run(pw.get_counter) == [2, 2]
    async with open_pool(2, initializer=pw.pid_state) as pool:
        states = await pool.run(pw.read_state)  # aioproc.worker_state()
        assert states == [{"init_pid": pid} for pid in pool.pids()]


async def test_bad_arguments_raise_builtin_errors(pw: ModuleType) -> None:
    with pytest.raises(ValueError, match="pool size must be positive, got 0"):
        open_pool(0)
    with pytest.raises(TypeError, match="got True"):
        open_pool(True)
    with pytest.raises(ValueError, match="max_calls_per_worker must be a positive int, got 0"):
        open_pool(1, max_calls_per_worker=0)
    with pytest.raises(ValueError, match="idle_timeout must be > 0"):
        open_pool(1, idle_timeout=0)
    with pytest.raises(ValueError, match=r"idle_timeout must be a finite number .* got nan"):
        open_pool(1, idle_timeout=float("nan"))
    with pytest.raises(ValueError, match="max_calls_per_worker must be a positive int, got True"):
        open_pool(1, max_calls_per_worker=True)
    with pytest.raises(
        ValueError, match="init_timeout must be a finite number of seconds, got nan"
    ):
        open_pool(1, init_timeout=float("nan"))
    with pytest.raises(ValueError, match="shutdown_timeout must be a number >= 0, got -1"):
        open_pool(1, shutdown_timeout=-1)
    with pytest.raises(TypeError, match="initializer must be callable"):
        open_pool(1, initializer="setup")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'ps'"):
        open_pool({"worker": 1, "ps": 0})


# ------------------------------------------------------------ init failures


async def test_initializer_failure_fails_the_pool_start_and_leaves_nothing(
    pw: ModuleType,
) -> None:
    before = child_pids()
    with pytest.raises(pw.InitFailed, match="init failed in task worker:1") as info:
        async with open_pool({"worker": 3}, initializer=pw.fail_on_task, initargs=(1,)):
            pytest.fail("the block must not run")  # pragma: no cover
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert child_pids() == before


async def test_initializer_timeout_fails_the_pool_start_and_leaves_nothing(
    pw: ModuleType,
) -> None:
    before = child_pids()
    with pytest.raises(TimeoutError, match=r"init_timeout=0\.3\b"):
        await open_pool(2, initializer=pw.slow_init, initargs=(30,), init_timeout=0.3)
    assert child_pids() == before


# ------------------------------------------------------------- SIGKILL


async def test_sigkilled_worker_fails_its_call_and_is_replaced(
    pw: ModuleType, fifo: Fifo, dropped: Dropped
) -> None:
    async with open_pool(2, name="pk") as pool:
        dropped.keep(pool)
        pids = live_pids(pool)
        call = asyncio.ensure_future(pool.submit(pw.announce_pid_then_block, fifo.path))
        (line,) = await fifo.lines(1)
        victim = int(line)
        pos = pids.index(victim)
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(BrokenWorkerError) as info:
            await asyncio.wait_for(call, 1.0)
        msg = str(info.value)
        assert f"worker pk/{pos} (pid {victim}) was killed by SIGKILL" in msg
        assert "about to block" in msg
        # the next calls work; the position got a new worker, the other kept its pid
        assert await pool.submit(pw.add, 1, 2) == 3
        after = await pool.run(os.getpid)
        assert after == pool.pids()
        assert after[pos] not in (None, victim)
        assert after[1 - pos] == pids[1 - pos]
        assert pid_gone(victim)


async def test_worker_dying_during_run_is_replaced(pw: ModuleType, dropped: Dropped) -> None:
    async with open_pool(2) as pool:
        dropped.keep(pool)
        old = live_pids(pool)
        with pytest.raises(BrokenWorkerError, match="exited with code 4"):
            await asyncio.wait_for(pool.run(sys.exit, (4,)), 10)
        new = await pool.run(os.getpid)
        assert set(new).isdisjoint(old) and len(set(new)) == 2
        assert all(pid_gone(p) for p in old)


async def test_replaced_worker_is_reaped(pw: ModuleType, dropped: Dropped) -> None:
    # uvloop opens /dev/null once per loop on its first read pipe: do that first
    async with open_pool(1) as warm:
        await warm.submit(pw.add, 0, 0)
    children, fds = child_pids(), open_fds()
    async with open_pool(1) as pool:
        dropped.keep(pool)  # closed at teardown, after the checks below
        with pytest.raises(BrokenWorkerError, match="exited with code 5"):
            await asyncio.wait_for(pool.submit(sys.exit, 5), 10)
        assert await pool.submit(pw.add, 1, 1) == 2  # replaced
    assert child_pids() == children
    assert open_fds() == fds


# ---------------------------------------------------------------- shutdown


async def test_worker_ignoring_terminate_is_killed_after_its_grace_period(
    pw: ModuleType,
) -> None:
    pool = await open_pool(2, name="stub", grace_period=0.5)
    try:
        pids = live_pids(pool)
        stubborn = await pool.submit(pw.refuse_to_exit)
        polite = next(p for p in pids if p != stubborn)
        t0 = time.monotonic()
        with pytest.warns(ForcedKillWarning, match=rf"stub/\d \(pid {stubborn}\)") as record:
            await pool.aclose()
        elapsed = time.monotonic() - t0
    finally:
        await pool.aclose()
    assert all(str(polite) not in str(w.message) for w in record)
    assert 0.5 <= elapsed < 5
    assert pid_gone(stubborn) and pid_gone(polite)


async def test_aclose_is_idempotent_and_shutdown_is_tfs_alias(pw: ModuleType) -> None:
    assert WorkerPool.shutdown is WorkerPool.aclose
    pool = await open_pool(2, name="twice", grace_period=0.5)
    try:
        pids = live_pids(pool)
        stubborn = await pool.submit(pw.refuse_to_exit)
        with pytest.warns(ForcedKillWarning, match=rf"twice/\d \(pid {stubborn}\)"):
            first = asyncio.ensure_future(pool.aclose())
            await asyncio.sleep(0)
            await pool.shutdown()  # waits for the first close
            assert all(pid_gone(pid) for pid in pids)
            await first
    finally:
        await pool.aclose()
    await pool.aclose()
    assert repr(pool) == "<WorkerPool size=2 live=0 busy=0 closed>"


async def test_shutdown_timeout_still_works_and_warns(pw: ModuleType) -> None:
    with pytest.warns(DeprecationWarning, match=r"open_pool\(shutdown_timeout=\.\.\.\)") as old:
        opening = open_pool(1, name="old", shutdown_timeout=0.5)
    assert old[0].filename == __file__  # it points at the caller's line
    pool = await opening
    try:
        stubborn = await pool.submit(pw.refuse_to_exit)
        t0 = time.monotonic()
        with pytest.warns(ForcedKillWarning, match=r"within 0.5 s of the terminate request"):
            await pool.aclose()
        elapsed = time.monotonic() - t0
    finally:
        await pool.aclose()
    assert 0.5 <= elapsed < 5
    assert pid_gone(stubborn)
    with pytest.raises(TypeError, match=r"open_pool\(\) got both grace_period=1 and shutdown_"):
        open_pool(1, grace_period=1, shutdown_timeout=2)
    with pytest.raises(TypeError, match=r"open_pool\(\): name must be a str, got None"):
        open_pool(1, name=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"takes from 1 to 3 positional arguments but 4"):
        open_pool(1, None, (), 30)  # type: ignore[misc]


async def test_closing_a_busy_pool_fails_waiting_and_running_calls(
    pw: ModuleType, fifo: Fifo
) -> None:
    pool = await open_pool(1, name="busy", grace_period=0.2)
    try:
        running = asyncio.ensure_future(pool.submit(pw.announce_pid_then_block, fifo.path))
        queued = asyncio.ensure_future(pool.submit(os.getpid))
        (line,) = await fifo.lines(1)
        with pytest.warns(ForcedKillWarning, match=rf"busy/0 \(pid {int(line)}\)"):
            await asyncio.wait_for(pool.aclose(), 10)
    finally:
        await pool.aclose()
    with pytest.raises(RuntimeError, match="was closed"):
        await queued
    with pytest.raises(BrokenWorkerError, match="SIGKILL"):
        await running
    assert pid_gone(int(line))


# ------------------------------------------------------------------ load


async def test_1000_submits_over_4_workers(pw: ModuleType) -> None:
    async with open_pool(4) as pool:
        pids = live_pids(pool)
        assert len(set(pids)) == 4
        squares = await asyncio.gather(*(pool.submit(pow, i, 2) for i in range(1000)))
        assert squares == [i * i for i in range(1000)]

        during: list[list[int | None]] = []

        async def one(i: int) -> tuple[int, int]:
            result: tuple[int, int] = await pool.submit(pw.square, i)
            if i % 100 == 0:
                during.append(pool.pids())  # while the other calls are in flight
            return result

        results = await asyncio.gather(*(one(i) for i in range(1000)))
        assert [r[0] for r in results] == [i * i for i in range(1000)]
        assert len(during) == 10 and all(d == pids for d in during)
        # the first four submits find four idle workers: every worker served
        assert {pid for _, pid in results} == set(pids)
        assert pool.pids() == pids  # nobody was replaced
    assert all(pid_gone(p) for p in pids)


# ------------------------------------------------------------ cancellation


async def test_cancelling_a_submit_replaces_its_worker(
    pw: ModuleType, fifo: Fifo, dropped: Dropped
) -> None:
    async with open_pool(2) as pool:
        dropped.keep(pool)
        pids = live_pids(pool)
        call = asyncio.ensure_future(pool.submit(pw.announce_pid_then_block, fifo.path))
        (line,) = await fifo.lines(1)
        victim = int(line)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 5)
        assert await still_alive_after([victim], 5) == set()
        # every later call works, on both positions
        for _ in range(4):
            assert await asyncio.wait_for(pool.submit(pw.add, 2, 2), 10) == 4
        after = await asyncio.wait_for(pool.run(os.getpid), 10)
        assert victim not in after
        assert len(set(after) & set(pids)) == 1


async def test_next_submit_after_a_cancelled_one_works_at_once(
    pw: ModuleType, fifo: Fifo, dropped: Dropped
) -> None:
    """A submit made right after cancelling one, before the killed worker's exit is seen.

    Deterministic: the cancelled call kills its worker and releases it in the
    same event-loop iteration in which the next submit picks a worker, so no
    exit notification can come in between.
    """
    async with open_pool(1) as pool:
        dropped.keep(pool)
        call = asyncio.ensure_future(pool.submit(pw.announce_pid_then_block, fifo.path))
        (line,) = await fifo.lines(1)
        call.cancel()
        after = asyncio.ensure_future(pool.submit(os.getpid))
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await asyncio.wait_for(after, 10) not in (None, int(line))


async def test_cancelling_a_queued_submit_kills_nobody(
    pw: ModuleType, fifo: Fifo, dropped: Dropped
) -> None:
    async with open_pool(1) as pool:
        dropped.keep(pool)
        (pid,) = live_pids(pool)
        running = asyncio.ensure_future(pool.submit(pw.announce_pid_then_block, fifo.path, 60))
        queued = asyncio.ensure_future(pool.submit(os.getpid))
        (line,) = await fifo.lines(1)
        assert int(line) == pid
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert not running.done()
        assert pool.pids() == [pid]
        running.cancel()  # ends the blocked call (and its worker)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(running, 5)


async def test_cancelling_run_replaces_the_workers(
    pw: ModuleType, fifo: Fifo, dropped: Dropped
) -> None:
    async with open_pool(2) as pool:
        dropped.keep(pool)
        old = live_pids(pool)
        call = asyncio.ensure_future(pool.run(pw.announce_pid_then_block, (fifo.path,)))
        assert sorted(int(x) for x in await fifo.lines(2)) == sorted(old)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 5)
        assert await still_alive_after(old, 5) == set()
        new = await asyncio.wait_for(pool.run(os.getpid), 10)
        assert set(new).isdisjoint(old)


# ------------------------------------------------------ recycling, idle


async def test_max_calls_per_worker_recycles_after_two_submits(pw: ModuleType) -> None:
    async with open_pool(1, max_calls_per_worker=2) as pool:
        (first,) = live_pids(pool)
        assert await pool.submit(os.getpid) == first
        assert await pool.submit(os.getpid) == first
        second = await pool.submit(os.getpid)
        assert second != first
        assert await pool.submit(os.getpid) == second
        third = await pool.submit(os.getpid)
        assert third not in (first, second)
        assert await still_alive_after([first, second], 5) == set()


async def test_max_calls_per_worker_recycles_after_two_runs(pw: ModuleType) -> None:
    async with open_pool(2, max_calls_per_worker=2) as pool:
        first = live_pids(pool)
        assert await pool.run(os.getpid) == first
        assert await pool.run(os.getpid) == first
        third = await pool.run(os.getpid)
        assert set(third).isdisjoint(first)


async def test_idle_worker_is_retired_and_restarted_on_demand(pw: ModuleType) -> None:
    async with open_pool(1, idle_timeout=0.2) as pool:
        first = await pool.submit(os.getpid)
        assert await still_alive_after([first], 10) == set()  # retired when idle
        second = await pool.submit(os.getpid)
        assert second != first
        assert pool.pids() == [second]


# ------------------------------------------------------------- cluster spec


async def test_cluster_spec_gives_one_worker_per_task_with_tf_config(pw: ModuleType) -> None:
    async with open_pool({"worker": 2, "ps": 1}) as pool:
        assert pool.size == 3
        configs = await pool.run(pw.read_tf_config)
        assert [c["task"] for c in configs] == [
            {"type": "worker", "index": 0},
            {"type": "worker", "index": 1},
            {"type": "ps", "index": 0},
        ]
        clusters = [c["cluster"] for c in configs]
        assert all(c == clusters[0] for c in clusters)
        assert {k: len(v) for k, v in clusters[0].items()} == {"worker": 2, "ps": 1}
        assert len({c["pid"] for c in configs}) == 3
    assert "TF_CONFIG" not in os.environ


async def test_cluster_spec_with_addresses_is_passed_through(pw: ModuleType) -> None:
    spec = {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]}
    async with open_pool(spec, env={"PW_TEST_VAR": "x"}) as pool:
        configs = await pool.run(pw.read_tf_config)
        assert all(c["cluster"] == spec for c in configs)
        assert [(c["task"]["type"], c["task"]["index"]) for c in configs] == [
            ("chief", 0),
            ("worker", 0),
            ("worker", 1),
        ]
        assert await pool.run(pw.getenv, ("PW_TEST_VAR",)) == ["x"] * 3


async def test_counted_cluster_spec_has_distinct_task_addresses(pw: ModuleType) -> None:
    async with open_pool({"worker": 2, "ps": 1}) as pool:
        (config, *_) = await pool.run(pw.read_tf_config)
        addresses = [a for tasks in config["cluster"].values() for a in tasks]
        assert len(set(addresses)) == 3  # like TF's create_cluster_spec: a port per task
        assert all(not a.endswith(":0") for a in addresses)


def test_tf_config_json_is_valid_for_every_slot() -> None:
    from aioproc._cluster.tfconfig import worker_slots

    for name, env in worker_slots({"worker": 2}, "p", {}):
        assert json.loads(env["TF_CONFIG"])["task"]["type"] == "worker"
        assert name.startswith("worker:")


# ------------------------------------------- ownership: nothing ever leaks
#
# The pool owns every start and retirement; these tests attack that at the
# edges: a cancelled open, a close while a replacement boots, a close racing
# a stream of submits.  Each checks, the moment the call returns, that no
# interpreter and no guardian shell of the pool is left (``child_pids()``
# lists running and zombie children alike).

CANCEL_ROUNDS = 30


async def start_time_of_a_pool(size: int) -> float:
    """Seconds one ``open_pool(size)`` takes here, now: the range to cancel in."""
    t0 = time.monotonic()
    pool = await open_pool(size)
    elapsed = time.monotonic() - t0
    await pool.aclose()
    return elapsed


def cancel_delays(start_time: float, seed: int) -> list[float]:
    """Delays spread from 0 (before anything ran) to past a whole start."""
    rng = random.Random(seed)
    top = 1.3 * start_time
    return [top * (k + rng.random()) / CANCEL_ROUNDS for k in range(CANCEL_ROUNDS)]


async def test_cancelling_await_open_pool_at_random_points_leaves_nothing() -> None:
    before = child_pids()
    delays = cancel_delays(await start_time_of_a_pool(2), seed=8)
    cancelled = 0
    for delay in delays:
        pool: WorkerPool | None = None
        try:
            pool = await asyncio.wait_for(open_pool(2), delay)
        except asyncio.TimeoutError:
            cancelled += 1
            # the cancellation has propagated: nothing of the pool may be left
            assert child_pids() == before, f"cancelled after {delay:.4f} s"
        if pool is not None:
            assert all(isinstance(p, int) for p in pool.pids())
            await pool.aclose()
            assert child_pids() == before
    assert cancelled > 0


async def test_cancelling_async_with_open_pool_at_random_points_leaves_nothing() -> None:
    before = child_pids()
    delays = cancel_delays(await start_time_of_a_pool(2), seed=9)
    entered = 0
    for delay in delays:
        with anyio.move_on_after(delay) as scope:
            async with open_pool(2) as pool:
                entered += 1
                assert all(isinstance(p, int) for p in pool.pids())
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert child_pids() == before, f"cancelled after {delay:.4f} s"
    assert entered < len(delays)  # some were cancelled while their workers started


@pytest.fixture
async def gate(tmp_path: Path, pw: ModuleType) -> AsyncIterator[tuple[tuple[str, str, str], Fifo]]:
    """``initargs`` for ``pool_gate.hold_replacements`` and the FIFO it announces on."""
    release = str(tmp_path / "release")
    async with Fifo(tmp_path / "announce") as announce:
        with release_fifo(release):
            yield (str(tmp_path / "first"), announce.path, release), announce


async def test_close_while_a_recycled_worker_is_replaced_leaves_nothing(
    gate: tuple[tuple[str, str, str], Fifo],
) -> None:
    import pool_gate

    initargs, announce = gate
    before = child_pids()
    pool = await open_pool(
        1, initializer=pool_gate.hold_replacements, initargs=initargs, max_calls_per_worker=1
    )
    try:
        first = await pool.submit(os.getpid)  # recycled after this call
        waiting = asyncio.ensure_future(pool.submit(os.getpid))
        (line,) = await announce.lines(1)  # the replacement is inside its initializer
        replacement = int(line)
        assert replacement != first
        await asyncio.wait_for(pool.aclose(), 10)
        assert child_pids() == before  # nothing left the moment aclose() returns
        with pytest.raises(RuntimeError, match=r"was closed while worker pool/0 started"):
            await waiting
    finally:
        await pool.aclose()
    assert pid_gone(first) and pid_gone(replacement)


async def test_close_while_an_idle_retired_worker_restarts_leaves_nothing(
    gate: tuple[tuple[str, str, str], Fifo],
) -> None:
    import pool_gate

    initargs, announce = gate
    before = child_pids()
    pool = await open_pool(
        1, initializer=pool_gate.hold_replacements, initargs=initargs, idle_timeout=0.1
    )
    try:
        (first,) = live_pids(pool)  # read at once: no await since the open returned
        assert await still_alive_after([first], 10) == set()  # retired when idle
        waiting = asyncio.ensure_future(pool.submit(os.getpid))
        (line,) = await announce.lines(1)  # restarting on demand, inside its initializer
        assert int(line) != first
        await asyncio.wait_for(pool.aclose(), 10)
        assert child_pids() == before
        with pytest.raises(RuntimeError, match="was closed while worker pool/0 started"):
            await waiting
    finally:
        await pool.aclose()


async def test_a_cancelled_submit_leaves_its_starting_worker_to_the_pool(
    gate: tuple[tuple[str, str, str], Fifo],
) -> None:
    import pool_gate

    (marker, announce_path, release), announce = gate
    before = child_pids()
    pool = await open_pool(
        1,
        initializer=pool_gate.hold_replacements,
        initargs=(marker, announce_path, release),
        max_calls_per_worker=1,
    )
    try:
        await pool.submit(os.getpid)  # recycled after this call
        cancelled = asyncio.ensure_future(pool.submit(os.getpid))
        (line,) = await announce.lines(1)
        replacement = int(line)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        # the start went on without its caller: the next call gets that very worker
        later = asyncio.ensure_future(pool.submit(os.getpid))
        fd = os.open(release, os.O_WRONLY)
        try:
            os.write(fd, b"x")  # let the replacement's initializer finish
        finally:
            os.close(fd)
        assert await asyncio.wait_for(later, 10) == replacement
    finally:
        await pool.aclose()
    assert child_pids() == before
    assert pid_gone(replacement)


async def test_close_racing_a_stream_of_submits_and_restarts_leaves_nothing(
    pw: ModuleType,
) -> None:
    before = child_pids()
    # every call recycles its worker: starts and retirements never stop
    pool = await open_pool(2, name="churn", max_calls_per_worker=1)
    try:
        calls = [asyncio.ensure_future(pool.submit(os.getpid)) for _ in range(20)]
        for done, call in enumerate(asyncio.as_completed(calls), 1):
            await call
            if done == 3:
                break
        first = asyncio.ensure_future(pool.aclose())
        await asyncio.wait_for(pool.aclose(), 20)  # a second close waits for the first
        assert child_pids() == before
        await first
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    finally:
        await pool.aclose()
    pids = [o for o in outcomes if isinstance(o, int)]
    errors = [o for o in outcomes if not isinstance(o, int)]
    assert len(pids) >= 3 and len(set(pids)) == len(pids)  # a fresh worker per call
    assert errors, "the close came after every call had finished"
    for e in errors:
        assert isinstance(e, (RuntimeError, BrokenWorkerError)), repr(e)
        assert "closed" in str(e) or "SIGKILL" in str(e) or "exited" in str(e), str(e)
    with pytest.raises(RuntimeError, match="closed"):
        await pool.submit(os.getpid)
    assert repr(pool) == "<WorkerPool size=2 live=0 busy=0 closed>"


# ------------------------------------------- services: timeouts, idle deaths, stats
#
# ``submit(..., timeout=)`` kills a call that overruns (its worker is replaced)
# and drops one still waiting; a worker found dead before it read a request
# hands the request to a fresh worker, once; ``stats()`` counts all of it.
# Calls that must be running announce their pid on a FIFO; calls that must
# wait block on a release FIFO: no test synchronises on a sleep.


def recorded(path: Path) -> list[int]:
    """The pids that ran ``pw.record_*`` with this path, one per run."""
    return [int(line) for line in path.read_text().split()] if path.exists() else []


@pytest.fixture
async def gates(tmp_path: Path) -> AsyncIterator[tuple[Fifo, str, Callable[[int], None]]]:
    """A FIFO running calls announce on, and a release FIFO they wait on."""
    release = str(tmp_path / "go")
    async with Fifo(tmp_path / "running") as announce:
        with release_fifo(release) as let_go:
            yield announce, release, let_go


async def test_a_timed_out_call_kills_its_worker_and_the_pool_keeps_serving(
    pw: ModuleType, fifo: Fifo, dropped: Dropped
) -> None:
    async with open_pool(2, name="svc") as pool:
        dropped.keep(pool)
        pids = live_pids(pool)
        with pytest.raises(TimeoutError) as info:
            await pool.submit(pw.announce_pid_then_block, fifo.path, timeout=0.5)
        # the first idle position takes the call
        assert str(info.value) == (
            "pool call pw_funcs.announce_pid_then_block timed out after timeout=0.5 s; "
            f"worker svc/0 (pid {pids[0]}) running it was killed and is replaced"
        )
        assert await still_alive_after([pids[0]], 5) == set()
        assert await pool.submit(pw.add, 1, 2, timeout=10) == 3
        after = await pool.run(os.getpid)
        assert after[0] not in (None, pids[0]) and after[1] == pids[1]
        stats = pool.stats()
        assert (stats.restarts, stats.failed, stats.completed) == (1, 1, 1 + 2)
        assert pool.stats() == aioproc.PoolStats(
            size=2, busy=0, idle=2, starting=0, queued=0, restarts=1, completed=3, failed=1
        )
    assert pid_gone(pids[0]) and pid_gone(pids[1])


async def test_a_call_still_queued_when_its_timeout_passes_never_runs(
    pw: ModuleType, tmp_path: Path, gates: tuple[Fifo, str, Callable[[int], None]]
) -> None:
    announce, release, let_go = gates
    ran = tmp_path / "ran"
    async with open_pool(1, name="q") as pool:
        (pid,) = live_pids(pool)
        running = asyncio.ensure_future(
            pool.submit(pw.announce_then_wait, announce.path, release, "a")
        )
        assert await announce.lines(1) == [str(pid)]
        with pytest.raises(TimeoutError) as info:
            await pool.submit(pw.record_call, str(ran), timeout=0.3)
        assert str(info.value) == (
            "pool call pw_funcs.record_call timed out after timeout=0.3 s "
            "waiting for a free worker (all 1 busy); it never ran"
        )
        assert pool.stats().queued == 0  # the expired call left the queue
        let_go(1)
        assert await running == "a"
        # had the expired call been handed the worker, it would have run before this one
        assert await pool.submit(pw.record_call, str(tmp_path / "later")) == pid
        assert recorded(ran) == []
        assert pool.pids() == [pid]  # nobody was killed
        assert pool.stats().failed == 1 and pool.stats().restarts == 0


async def test_a_call_whose_worker_is_starting_times_out_and_the_start_goes_on(
    gate: tuple[tuple[str, str, str], Fifo],
) -> None:
    import pool_gate

    (marker, announce_path, release), announce = gate
    async with open_pool(
        1,
        initializer=pool_gate.hold_replacements,
        initargs=(marker, announce_path, release),
        max_calls_per_worker=1,
    ) as pool:
        first = await pool.submit(os.getpid)  # recycled after this call
        late = asyncio.ensure_future(pool.submit(os.getpid, timeout=0.5))
        (line,) = await announce.lines(1)  # the replacement is inside its initializer
        replacement = int(line)
        assert pool.stats() == aioproc.PoolStats(
            size=1, busy=0, idle=0, starting=1, queued=0, restarts=1, completed=1, failed=0
        )
        with pytest.raises(TimeoutError) as info:
            await late
        assert str(info.value) == (
            "pool call posix.getpid timed out after timeout=0.5 s "
            "while worker pool/0 was starting; it never ran"
        )
        after = asyncio.ensure_future(pool.submit(os.getpid))
        fd = os.open(release, os.O_WRONLY)
        try:
            os.write(fd, b"x")  # let the replacement's initializer finish
        finally:
            os.close(fd)
        assert await asyncio.wait_for(after, 10) == replacement != first
        assert pool.stats().restarts == 1  # the timed-out call cost no extra start


async def test_timeout_is_the_pools_and_partial_passes_one_to_fn(pw: ModuleType) -> None:
    async with open_pool(1) as pool:
        assert await pool.submit(pw.takes_timeout, 1, timeout=5) == (1, None)
        bound = functools.partial(pw.takes_timeout, timeout=7)
        assert await pool.submit(bound, 2) == (2, 7)
        assert await pool.submit(bound, 3, timeout=5) == (3, 7)
        for bad, error, message in [
            (0, ValueError, r"submit\(timeout=\.\.\.\) must be > 0 seconds, got 0$"),
            (-1, ValueError, r"submit\(timeout=\.\.\.\) must be > 0 seconds, got -1$"),
            (float("nan"), ValueError, r"submit\(timeout=\.\.\.\).* got nan"),
            ("5", TypeError, r"submit\(timeout=\.\.\.\).* got '5'"),
        ]:
            with pytest.raises(error, match=message):
                await pool.submit(os.getpid, timeout=bad)
        assert pool.stats().completed == 3 and pool.stats().failed == 0  # nothing ran


async def test_a_timeout_on_a_stuck_partial_names_the_function(
    pw: ModuleType, fifo: Fifo, dropped: Dropped
) -> None:
    async with open_pool(1, name="p") as pool:
        dropped.keep(pool)
        (pid,) = live_pids(pool)
        stuck = functools.partial(pw.announce_pid_then_block, fifo.path)
        with pytest.raises(TimeoutError, match=r"^pool call functools\.partial\(pw_funcs\."):
            await pool.submit(stuck, timeout=0.3)
        assert await still_alive_after([pid], 5) == set()


@pytest.mark.parametrize("wait_for_death", [False, True], ids=["submit-at-once", "after-exit"])
async def test_a_worker_that_died_idle_runs_the_call_on_a_fresh_worker_once(
    pw: ModuleType, tmp_path: Path, dropped: Dropped, wait_for_death: bool
) -> None:
    """SIGKILL an idle worker, then submit: the call runs once, on a new worker.

    At once, the request usually reaches the dying worker's socket before it
    is gone (the kernel reports it unread); after its exit, the request finds
    the socket closed, or the pool has already noticed the death.  Either way
    the call is not failed with "died during a call".
    """
    async with open_pool(1, name="idle") as pool:
        for round_ in range(1, 4):
            dropped.keep(pool)
            (victim,) = live_pids(pool)
            log = tmp_path / f"calls{round_}"
            os.kill(victim, signal.SIGKILL)
            if wait_for_death:
                assert await still_alive_after([victim], 5) == set()
            fresh = await asyncio.wait_for(pool.submit(pw.record_call, str(log)), 10)
            assert fresh != victim
            assert recorded(log) == [fresh]  # exactly one run
            assert pool.pids() == [fresh]
            assert pool.stats().restarts == round_  # one replacement per death
            assert await still_alive_after([victim], 5) == set()
        assert pool.stats().failed == 0 and pool.stats().completed == 3


async def test_a_worker_that_died_idle_is_replaced_for_run(
    pw: ModuleType, tmp_path: Path, dropped: Dropped
) -> None:
    log = tmp_path / "calls"
    async with open_pool(3) as pool:
        dropped.keep(pool)
        pids = live_pids(pool)
        os.kill(pids[1], signal.SIGKILL)
        after = await asyncio.wait_for(pool.run(pw.record_call, (str(log),)), 10)
        assert after[0] == pids[0] and after[2] == pids[2]
        assert after[1] not in pids
        assert sorted(recorded(log)) == sorted(after)
        assert pool.stats().restarts == 1


async def test_a_single_worker_that_died_idle_says_so(pw: ModuleType) -> None:
    async with aioproc.open_worker(name="lone") as w:
        await w.ping()
        os.kill(w.pid, signal.SIGKILL)
        with pytest.raises(BrokenWorkerError) as info:
            await asyncio.wait_for(w.call(os.getpid), 10)
        assert re.match(
            rf"worker lone \(pid {w.pid}\) was killed by SIGKILL "
            r"before (it read this request|this request \(while idle\)); its stderr was empty$",
            str(info.value),
        ), str(info.value)


async def test_a_worker_dying_after_it_read_the_request_fails_the_call_once(
    pw: ModuleType, tmp_path: Path, dropped: Dropped
) -> None:
    log = tmp_path / "calls"
    async with open_pool(1, name="mid") as pool:
        dropped.keep(pool)
        (victim,) = live_pids(pool)
        for _ in range(3):  # never retried, whatever the timing
            with pytest.raises(BrokenWorkerError, match=r"was killed by SIGKILL during a call"):
                await asyncio.wait_for(pool.submit(pw.record_then_die, str(log)), 10)
            dropped.keep(pool)
        runs = recorded(log)
        assert len(runs) == 3 and runs[0] == victim and len(set(runs)) == 3
        assert pool.stats().failed == 3 and pool.stats().restarts == 2
        assert await pool.submit(os.getpid) not in runs


async def test_stats_under_load(
    pw: ModuleType, tmp_path: Path, gates: tuple[Fifo, str, Callable[[int], None]]
) -> None:
    announce, release, let_go = gates
    with contextlib.ExitStack() as stack:
        # one release FIFO per call: a byte meant for one call is never taken by another
        paths = [str(tmp_path / f"go{i}") for i in range(5)]
        releases = [stack.enter_context(release_fifo(p)) for p in paths]
        async with open_pool(3) as pool:
            assert pool.stats() == aioproc.PoolStats(
                size=3, busy=0, idle=3, starting=0, queued=0, restarts=0, completed=0, failed=0
            )
            calls = [
                asyncio.ensure_future(pool.submit(pw.announce_then_wait, announce.path, p, i))
                for i, p in enumerate(paths)
            ]
            assert sorted(int(p) for p in await announce.lines(3)) == sorted(live_pids(pool))
            assert pool.stats() == aioproc.PoolStats(
                size=3, busy=3, idle=0, starting=0, queued=2, restarts=0, completed=0, failed=0
            )
            for i in range(3):
                releases[i](1)
            assert await asyncio.gather(*calls[:3]) == [0, 1, 2]
            await announce.lines(2)  # the two queued calls got the first two free workers
            assert pool.stats() == aioproc.PoolStats(
                size=3, busy=2, idle=1, starting=0, queued=0, restarts=0, completed=3, failed=0
            )
            with pytest.raises(pw.CallFailed):
                await pool.submit(pw.raise_call_failed, "no")  # on the idle one
            releases[3](1)
            releases[4](1)
            assert await asyncio.gather(*calls) == [0, 1, 2, 3, 4]
            assert pool.stats() == aioproc.PoolStats(
                size=3, busy=0, idle=3, starting=0, queued=0, restarts=0, completed=5, failed=1
            )
            # run() holds every position: each worker waits on the shared release FIFO
            running = asyncio.ensure_future(
                pool.run(pw.announce_then_wait, (announce.path, release, 9))
            )
            await announce.lines(3)
            assert pool.stats() == aioproc.PoolStats(
                size=3, busy=3, idle=0, starting=0, queued=0, restarts=0, completed=5, failed=1
            )
            let_go(3)
            assert await running == [9, 9, 9]
            assert pool.stats().completed == 8


async def test_stats_of_an_idle_retired_worker(pw: ModuleType) -> None:
    async with open_pool(1, idle_timeout=0.2) as pool:
        first = await pool.submit(os.getpid)
        assert await still_alive_after([first], 10) == set()  # retired when idle
        # a position with no worker: neither busy, idle nor starting
        assert pool.stats() == aioproc.PoolStats(
            size=1, busy=0, idle=0, starting=0, queued=0, restarts=0, completed=1, failed=0
        )
        await pool.submit(os.getpid)
        assert pool.stats().restarts == 1


TIMEOUT_ROUNDS = 24


async def test_cancelling_or_timing_out_submits_at_random_points_leaves_nothing_running(
    pw: ModuleType, tmp_path: Path
) -> None:
    """Cancel (or time out) a submit with a timeout anywhere: queued, starting, running.

    A pool of one whose worker is killed by every call that got to run, so
    later rounds also land while its replacement starts; a second call is
    queued behind each.  After each round, every worker that began the call
    is gone, the queued call never ran, and the pool serves the next call.
    """
    before = child_pids()
    span = 1.5 * await start_time_of_a_pool(1)
    rng = random.Random(14)
    outcomes: collections.Counter[str] = collections.Counter()
    pool = await open_pool(1, name="rnd")
    try:
        for k in range(TIMEOUT_ROUNDS):
            log, queued_log = tmp_path / f"r{k}", tmp_path / f"q{k}"
            delay = span * (k + rng.random()) / TIMEOUT_ROUNDS
            by_timeout = k % 2 == 1
            limit = delay if by_timeout else 60
            call = asyncio.ensure_future(
                pool.submit(pw.record_then_sleep, str(log), 60, timeout=limit)
            )
            queued = asyncio.ensure_future(
                pool.submit(pw.record_call, str(queued_log), timeout=limit)
            )
            if by_timeout:
                results = await asyncio.gather(call, queued, return_exceptions=True)
            else:
                await asyncio.sleep(delay)
                call.cancel()
                queued.cancel()
                results = await asyncio.gather(call, queued, return_exceptions=True)
            started = recorded(log)
            assert len(started) <= 1
            assert await still_alive_after(started, 5) == set(), f"round {k}: still running"
            for r in results:
                if by_timeout:
                    assert isinstance(r, (TimeoutError, int)), repr(r)
                else:
                    assert isinstance(r, (asyncio.CancelledError, int)), repr(r)
            if not isinstance(results[1], int):
                assert recorded(queued_log) == []  # timed out or cancelled: never ran
            outcomes["ran" if started else "never ran"] += 1
            assert await asyncio.wait_for(pool.submit(pw.add, k, 1, timeout=20), 20) == k + 1
    finally:
        await pool.aclose()
    assert child_pids() == before
    assert outcomes["ran"] and outcomes["never ran"], outcomes


# --------------------------------------------- functions sent by value, once


def script_function(source: str, name: str) -> Callable[..., object]:
    """A function defined as in a script's ``__main__``: it travels by value."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(textwrap.dedent(source), namespace)
    fn = namespace[name]
    assert callable(fn)
    return fn


async def test_replacement_workers_are_sent_the_functions_they_never_saw(
    dropped: Dropped,
) -> None:
    # every call on a fresh worker (recycled after each call, or one killed
    # while idle): an id the worker never saw would fail the call
    square = script_function("def square(x):\n    return x * x\n", "square")
    async with open_pool(2, name="defs", max_calls_per_worker=1) as pool:
        dropped.keep(pool)
        for round_ in range(2):
            assert await asyncio.gather(*(pool.submit(square, i) for i in range(6))) == [
                i * i for i in range(6)
            ], round_
            assert sorted(await pool.run(square, (3,))) == [9, 9]
        assert pool.stats().restarts >= 12
    async with open_pool(2, name="defs2") as pool:
        dropped.keep(pool)
        assert await pool.run(square, (2,)) == [4, 4]
        pids = live_pids(pool)
        os.kill(pids[0], signal.SIGKILL)  # dies idle: its call goes to a replacement
        assert await asyncio.wait_for(pool.run(square, (5,)), 10) == [25, 25]
        assert pool.pids()[0] not in (None, pids[0])


async def test_script_function_calls_see_the_scripts_globals_as_they_are_now() -> None:
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec("LIMIT = 1\ndef clip(x):\n    return min(x, LIMIT)\n", namespace)
    clip = namespace["clip"]
    assert callable(clip)
    async with open_pool(2) as pool:
        assert await asyncio.gather(*(pool.submit(clip, 5) for _ in range(4))) == [1] * 4
        namespace["LIMIT"] = 3
        assert await asyncio.gather(*(pool.submit(clip, 5) for _ in range(4))) == [3] * 4
