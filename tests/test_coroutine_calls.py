"""Coroutine calls in persistent workers and pools: concurrency, cancellation, loops.

``WorkerProcess.call(async_fn)`` and ``WorkerPool.submit(async_fn)`` run the
coroutine on the worker's own event loop; calls in flight on one worker run
concurrently there (``max_concurrency``), and cancelling a call (or its
timeout) cancels its coroutine in the worker.  The functions the workers run
live in ``children/coro_funcs.py``; a call that must be in the middle of its
coroutine writes a line to a FIFO the test reads before it acts.  Timings are
only ever asserted as generous bounds; overlap is shown by the times the
worker itself stamps.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import random
import signal
import sys
import textwrap
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest
from helpers import child_pids, import_child, pid_gone, python, state
from proc_utils import Fifo, still_alive_after

from aioproc import BrokenWorkerError, ForcedKillWarning, open_pool, open_worker
from aioproc._worker.dispatch import Dispatch
from aioproc.errors import RemoteTraceback

LOOPS = ("asyncio", "uvloop")


@pytest.fixture
def cf(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The coroutine-function module, importable here and (by path) in workers."""
    return import_child(monkeypatch, "coro_funcs")


@pytest.fixture(params=LOOPS)
def worker_loop(request: pytest.FixtureRequest) -> str:
    """The event loop the worker runs coroutine calls on."""
    return str(request.param)


def max_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """The most intervals ``(begin, end)`` running at one moment."""
    spans = list(intervals)
    events = sorted([(b, 1) for b, _ in spans] + [(e, -1) for _, e in spans])
    most = now = 0
    for _, step in events:  # an end sorts before a begin at the same time
        now += step
        most = max(most, now)
    return most


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# ------------------------------------------------------------ concurrency


async def test_twenty_half_second_sleeps_overlap_in_one_worker(
    cf: ModuleType, worker_loop: str
) -> None:
    async with open_worker(worker_loop=worker_loop) as w:
        await w.call(cf.async_noop)  # the worker's loop exists from here on
        began = time.monotonic()
        results = await asyncio.gather(*(w.call(cf.stamped_sleep, 0.5) for _ in range(20)))
        elapsed = time.monotonic() - began
        assert elapsed < 5, f"20 x 0.5 s took {elapsed:.2f} s: not concurrent"
        assert {pid for _, _, pid in results} == {w.pid}
        # every one of the 20 was asleep in the worker at one and the same moment
        assert max(b for b, _, _ in results) < min(e for _, e, _ in results)
        assert max_overlap((b, e) for b, e, _ in results) == 20
        assert repr(w) == f"<WorkerProcess {w.name} pid={w.pid} idle>"


async def test_a_sync_call_holds_the_loop_only_while_it_runs(
    cf: ModuleType, fifo: Fifo, worker_loop: str
) -> None:
    async with open_worker(worker_loop=worker_loop) as w:
        ticking = asyncio.ensure_future(w.call(cf.ticks_announced, fifo.path, 12, 0.05))
        await fifo.lines(1)  # the coroutine call runs
        other = asyncio.ensure_future(w.call(cf.stamped_sleep, 0.2))
        began, ended = await w.call(cf.sync_block, 0.3)
        assert not ticking.done()  # the sync call did not wait for the coroutine calls
        stamps = await ticking
        _, other_end, _ = await other
        # no tick inside the sync call: it held the loop; ticks before and after it
        assert [t for t in stamps if began < t < ended] == []
        assert any(t <= began for t in stamps) and any(t >= ended for t in stamps)
        assert other_end >= ended  # the other sleep could not end while the loop was held
        assert stamps == sorted(stamps) and len(stamps) == 12


async def test_max_concurrency_bounds_the_calls_in_flight(cf: ModuleType) -> None:
    async with open_worker(max_concurrency=3) as w:
        assert w.max_concurrency == 3
        results = await asyncio.gather(*(w.call(cf.stamped_sleep, 0.2) for _ in range(9)))
        assert max_overlap((b, e) for b, e, _ in results) == 3


@pytest.mark.parametrize("kind", LOOPS)
def test_eager_starter_runs_the_first_step_as_the_task_before_what_was_queued(kind: str) -> None:
    """A coroutine that returns at once is done when its task is made (no loop
    iteration), having run as its task, ahead of a callback queued before it;
    on uvloop before 3.12 it starts in the loop's next iteration instead."""
    from aioproc._child import aio

    eager = kind == "asyncio" or sys.version_info >= (3, 12)
    seen: list[object] = []

    async def at_once() -> str:
        seen.append(asyncio.current_task())
        return "done"

    async def waits() -> str:
        seen.append("began")
        await asyncio.sleep(0)
        return "waited"

    def callback() -> None:
        start = aio.eager_starter(loop)
        loop.call_soon(seen.append, "queued before")
        task = start(at_once())
        assert task.done() is eager
        later = start(waits())
        assert not later.done()
        tasks.extend([task, later])

    loop = aio.new_event_loop(kind)
    tasks: list[asyncio.Task[str]] = []
    try:
        loop.call_soon(callback)
        loop.run_until_complete(asyncio.sleep(0.05))
        assert [t.result() for t in tasks] == ["done", "waited"]
        if eager:
            assert seen == [tasks[0], "began", "queued before"]
        else:
            assert seen == ["queued before", tasks[0], "began"]
    finally:
        loop.close()


@pytest.mark.parametrize("kind", LOOPS)
def test_eager_starter_makes_tasks_with_the_loops_task_factory(kind: str) -> None:
    """A task factory set on the worker's loop (after the starter was made)
    makes its tasks; they still run their coroutines to the end."""
    from aioproc._child import aio

    made: list[object] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        made.append(task)
        return task

    async def at_once() -> str:
        return "done"

    def callback() -> None:
        start = aio.eager_starter(loop)
        loop.set_task_factory(factory)
        tasks.append(start(at_once()))

    loop = aio.new_event_loop(kind)
    tasks: list[asyncio.Task[str]] = []
    try:
        loop.call_soon(callback)
        loop.run_until_complete(asyncio.sleep(0.05))
        assert made == tasks and tasks[0].result() == "done"
    finally:
        loop.close()


async def test_asyncio_is_imported_at_the_first_coroutine_call_only(
    pw: ModuleType, cf: ModuleType
) -> None:
    names = ["asyncio", "aioproc._child.aio", "uvloop"]
    async with open_worker(pw.noop, worker_loop="uvloop") as w:
        await w.ping()
        assert await w.call(pw.add, 2, 3) == 5
        assert await w.call(pw.modules_loaded, names) == [False, False, False]
        assert await w.call(cf.loop_type) == "uvloop.Loop"
        assert await w.call(pw.modules_loaded, names) == [True, True, True]
        # sync calls go on working on the loop's thread
        assert await w.call(pw.add, 4, 5) == 9


async def test_a_sync_call_runs_inside_the_running_loop(cf: ModuleType, worker_loop: str) -> None:
    async with open_worker(worker_loop=worker_loop) as w:
        loop = await w.call(cf.loop_type)
        assert await w.call(cf.sync_inside_the_loop) == (
            loop,
            "asyncio.run() cannot be called from a running event loop",
        )


async def test_a_sync_function_returning_a_coroutine_has_it_run(cf: ModuleType) -> None:
    async with open_worker() as w:
        began, ended, pid = await w.call(cf.returns_coroutine, 0.01)
        assert pid == w.pid and ended >= began


async def test_ping_answers_while_coroutine_calls_run(cf: ModuleType, fifo: Fifo) -> None:
    async with open_worker() as w:
        calls = [
            asyncio.ensure_future(w.call(cf.announce_then_sleep, fifo.path, 2)) for _ in range(5)
        ]
        await fifo.lines(5)
        await asyncio.wait_for(w.ping(), 1.5)
        assert not any(c.done() for c in calls)
        assert repr(w) == f"<WorkerProcess {w.name} pid={w.pid} busy>"
        assert await asyncio.gather(*calls) == [w.pid] * 5


# ----------------------------------------------------------- cancellation


async def test_cancelling_a_call_cancels_its_coroutine_in_the_worker(
    cf: ModuleType, fifo: Fifo, worker_loop: str
) -> None:
    async with open_worker(cf.dict_init, worker_loop=worker_loop) as w:
        call = asyncio.ensure_future(w.call(cf.guarded, "a", 60, fifo.path))
        (line,) = await fifo.lines(1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 10)
        # the cancellation completed once the coroutine had ended in the worker
        state = await w.call(cf.read_state)
        assert state == {"started": 1, "ended": 1, "events": [("a", "cancelled")]}
        assert await w.call(cf.other_tasks) == 0
        assert await w.call(pow, 2, 5) == 32
        assert w.pid == int(line) and w.alive
        # an anyio cancel scope, which cancels again at every step, does the same
        with anyio.move_on_after(0.2) as scope:
            await w.call(cf.guarded, "b", 60)
        assert scope.cancelled_caught
        state = await w.call(cf.read_state_async)
        assert state["events"] == [("a", "cancelled"), ("b", "cancelled")]
        assert state["started"] == state["ended"] == 2
        assert await w.call(cf.other_tasks) == 0


async def test_300_random_cancellations_leave_no_task_in_the_worker_and_nothing_here(
    cf: ModuleType, worker_loop: str
) -> None:
    rng = random.Random(4242)
    async with open_worker() as w:
        await w.call(cf.async_noop)  # what the event loop keeps for its life (uvloop: /dev/null)
    tasks_before = len(asyncio.all_tasks())
    fds_before = open_fds()
    loop = asyncio.get_running_loop()
    outcomes: collections.Counter[str] = collections.Counter()
    async with open_worker(cf.dict_init, max_concurrency=6, worker_loop=worker_loop) as w:
        await w.call(cf.async_noop)
        fds_open = open_fds()
        for _ in range(30):
            calls = [
                asyncio.ensure_future(w.call(cf.random_sleep, rng.randrange(1000)))
                for _ in range(10)
            ]
            for call in calls:
                # before it is sent, waiting for a slot, in the coroutine, after it ended;
                # sometimes twice, the second while the first is being carried out
                loop.call_later(rng.uniform(0, 0.012), call.cancel)
                if rng.random() < 0.2:
                    loop.call_later(rng.uniform(0, 0.02), call.cancel)
            for result in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(result, asyncio.CancelledError):
                    outcomes["cancelled"] += 1
                else:
                    assert isinstance(result, int), repr(result)
                    outcomes["returned"] += 1
        assert outcomes["cancelled"] > 30 and outcomes["returned"] > 30, outcomes
        assert await w.call(cf.other_tasks) == 0
        state = await w.call(cf.read_state)
        assert state["started"] == state["ended"] > 0
        assert w.alive and not w.busy and w._replies == {}
        assert open_fds() == fds_open
    assert len(asyncio.all_tasks()) == tasks_before
    assert open_fds() == fds_before


async def test_a_call_timeout_cancels_the_coroutine_in_the_worker(cf: ModuleType) -> None:
    async with open_worker(cf.dict_init, name="timed") as w:
        pid = w.pid
        with pytest.raises(
            TimeoutError,
            match=r"call coro_funcs.guarded on worker timed timed out after timeout=0.3 s; "
            r"its coroutine was cancelled in the worker, which goes on",
        ):
            await w.call(cf.guarded, "t", 60, timeout=0.3)
        state = await w.call(cf.read_state)
        assert state == {"started": 1, "ended": 1, "events": [("t", "cancelled")]}
        assert await w.call(cf.other_tasks) == 0
        assert await w.call(cf.guarded, "quick", 0, timeout=30) == "quick"
        assert w.pid == pid and w.alive
        with pytest.raises(ValueError, match=r"call\(timeout=...\) must be > 0 seconds, got 0"):
            await w.call(cf.guarded, "x", 0, timeout=0)
        with pytest.raises(TypeError, match=r"timeout=...\) must be a number of seconds, got '1'"):
            await w.call(cf.guarded, "x", 0, timeout="1")  # type: ignore[arg-type]


async def test_a_sync_call_timeout_still_kills_its_worker(cf: ModuleType) -> None:
    async with open_worker(name="stuck") as w:
        with pytest.raises(TimeoutError, match=r"worker \(pid \d+\) running it was killed"):
            await w.call(cf.sync_block, 60, timeout=0.3)
        assert await still_alive_after([w.pid], 10) == set()
        with pytest.raises(BrokenWorkerError, match="SIGKILL"):
            await w.call(pow, 2, 2)


async def test_a_cancelled_sync_call_still_kills_its_worker_and_its_coroutine_calls(
    cf: ModuleType, fifo: Fifo
) -> None:
    async with open_worker(name="mixed") as w:
        running = asyncio.ensure_future(w.call(cf.announce_then_sleep, fifo.path, 60))
        await fifo.lines(1)  # the loop runs a coroutine call
        sync = asyncio.ensure_future(w.call(cf.announce_then_block, fifo.path, 60))
        await fifo.lines(1)  # the sync call holds the loop
        sync.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(sync, 10)
        with pytest.raises(BrokenWorkerError, match="was killed by SIGKILL during a call"):
            await asyncio.wait_for(running, 10)
        assert await still_alive_after([w.pid], 10) == set()


async def test_a_coroutine_ignoring_its_cancellation_gets_the_worker_killed_after_grace(
    cf: ModuleType, fifo: Fifo
) -> None:
    async with open_worker(grace_period=0.5, name="stubborn") as w:
        other = asyncio.ensure_future(w.call(cf.announce_then_sleep, fifo.path, 60))
        stubborn = asyncio.ensure_future(w.call(cf.ignores_cancellation, fifo.path, 60))
        await fifo.lines(2)
        stubborn.cancel()
        with pytest.warns(
            ForcedKillWarning,
            match=r"worker stubborn \(pid \d+\): a cancelled coroutine call did not end within "
            r"grace_period=0.5 s; the worker was killed with SIGKILL",
        ):
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(stubborn, 10)
        with pytest.raises(BrokenWorkerError, match="was killed by SIGKILL during a call"):
            await asyncio.wait_for(other, 10)
        assert not w.alive


async def test_a_coroutine_cancelled_inside_the_worker_is_no_cancellation_here(
    cf: ModuleType,
) -> None:
    async with open_worker(name="selfish") as w:
        with pytest.raises(
            RuntimeError, match=r"call coro_funcs.cancels_itself was cancelled inside worker "
        ):
            await w.call(cf.cancels_itself)
        task = asyncio.current_task()
        assert task is not None and not task.cancelled()
        assert await w.call(pow, 3, 2) == 9


# ------------------------------------------------------- failures, crashes


async def test_errors_and_unpicklable_values_of_coroutines_leave_the_worker_usable(
    cf: ModuleType,
) -> None:
    async with open_worker() as w:
        with pytest.raises(ValueError, match="no good") as info:
            await w.call(cf.raises_value_error, "no good")
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        # the worker's traceback starts in the coroutine, not in aioproc's loop
        assert str(cause).splitlines()[1].endswith("in raises_value_error")
        with pytest.raises(TypeError, match="lock"):
            await w.call(cf.returns_unpicklable)
        assert await w.call(cf.other_tasks) == 0


async def test_sigkill_with_10_calls_in_flight_fails_each_with_broken_worker_error(
    cf: ModuleType, fifo: Fifo, worker_loop: str
) -> None:
    async with open_worker(worker_loop=worker_loop, name="victim") as w:
        calls = [
            asyncio.ensure_future(w.call(cf.announce_then_sleep, fifo.path, 60)) for _ in range(10)
        ]
        assert {int(line) for line in await fifo.lines(10)} == {w.pid}
        os.kill(w.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
        for result in results:
            assert isinstance(result, BrokenWorkerError), repr(result)
            assert f"worker victim (pid {w.pid}) was killed by SIGKILL during a call" in str(result)


async def test_sys_exit_in_a_coroutine_ends_the_worker_and_every_call_in_flight(
    cf: ModuleType, fifo: Fifo, tmp_path: Path
) -> None:
    ended = tmp_path / "ended"
    async with open_worker(name="quitter") as w:
        calls = [
            asyncio.ensure_future(w.call(cf.guarded_to_file, str(ended), fifo.path, 60))
            for _ in range(3)
        ]
        await fifo.lines(3)
        with pytest.raises(BrokenWorkerError, match=r"exited with code 3 during a call"):
            await w.call(cf.async_exit, 3)
        for result in await asyncio.gather(*calls, return_exceptions=True):
            assert isinstance(result, BrokenWorkerError), repr(result)
    # the loop was closed as asyncio.run closes it: the other coroutines unwound
    assert ended.read_text().splitlines() == [f"finally {w.pid}"] * 3


async def stop(pid: int) -> None:
    """SIGSTOP ``pid`` (a debugger, a suspended job) and wait until it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    with anyio.fail_after(10):
        while state(pid) != "T":
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
async def test_aclose_cancels_the_coroutine_calls_in_flight(
    cf: ModuleType, fifo: Fifo, tmp_path: Path, stopped: bool
) -> None:
    """Their ``finally`` blocks run and the worker exits 0, well within its 30 s
    grace period; also a worker stopped (SIGSTOP) while they run, which gets
    SIGCONT with the terminate request, as a group's workers do, not a SIGKILL
    at the end of the grace period."""
    ended = tmp_path / "ended"
    w = await open_worker(grace_period=30, name="closing")
    try:
        calls = [
            asyncio.ensure_future(w.call(cf.guarded_to_file, str(ended), fifo.path, 60))
            for _ in range(3)
        ]
        await fifo.lines(3)
        if stopped:
            await stop(w.pid)
        began = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ForcedKillWarning)
            await w.aclose()
        assert time.monotonic() - began < 10  # well within the grace period
    finally:
        await w.aclose()
    assert w.returncode == 0 and pid_gone(w.pid)
    for result in await asyncio.gather(*calls, return_exceptions=True):
        assert isinstance(result, RuntimeError), repr(result)
        assert "was closed while call coro_funcs.guarded_to_file ran" in str(result)
    assert ended.read_text().splitlines() == [f"finally {w.pid}"] * 3


async def test_a_pool_with_a_stopped_worker_closes_without_its_grace_period(
    cf: ModuleType,
) -> None:
    """Closing a pool continues its stopped worker too: none is SIGKILLed (no
    ``ForcedKillWarning``), all are gone well within the grace period."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForcedKillWarning)
        async with open_pool(2, grace_period=30) as pool:
            await asyncio.gather(*(pool.submit(cf.loop_type) for _ in range(4)))
            pids = pool.pids()
            assert len(pids) == 2 and None not in pids
            await stop(pids[0])  # type: ignore[arg-type]
            began = time.monotonic()
        assert time.monotonic() - began < 10  # not the 30 s grace period
    assert all(pid_gone(pid) for pid in pids)  # type: ignore[arg-type]


async def test_a_sigkilled_supervisor_leaves_no_worker_running_coroutines(
    tmp_path: Path, worker_loop: str
) -> None:
    code = textwrap.dedent(
        f"""
        import asyncio, sys
        sys.path.insert(0, {os.path.dirname(__file__) + "/children"!r})
        import aioproc, coro_funcs

        async def main():
            w = await aioproc.open_worker(worker_loop={worker_loop!r})
            calls = [asyncio.ensure_future(w.call(coro_funcs.stamped_sleep, 60)) for _ in range(5)]
            await w.call(coro_funcs.async_noop)
            print(w.pid, flush=True)
            await asyncio.gather(*calls)

        asyncio.run(main())
        """
    )
    supervisor = await asyncio.create_subprocess_exec(
        *python(code), stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL
    )
    try:
        assert supervisor.stdout is not None
        line = await asyncio.wait_for(supervisor.stdout.readline(), 30)
        pid = int(line)
        assert await still_alive_after([pid], 0.2) == {pid}
        supervisor.kill()
        await supervisor.wait()
        assert await still_alive_after([pid], 10) == set()
    finally:
        if supervisor.returncode is None:
            supervisor.kill()
            await supervisor.wait()


# ------------------------------------------------------------ init, loops


async def test_an_async_init_runs_on_the_workers_loop_and_gives_the_state(
    cf: ModuleType,
) -> None:
    async with open_worker(cf.async_init, ("x",)) as w:
        state = await w.call(cf.read_state)
        assert state["tag"] == "x" and state["loop"].startswith("asyncio.")
        assert await w.call(cf.read_state_async) == state
    async with open_pool(2, initializer=cf.async_init, initargs=("p",)) as pool:
        assert [s["tag"] for s in await pool.run(cf.read_state_async)] == ["p", "p"]


async def test_a_failing_async_init_fails_the_start_and_leaves_nothing(cf: ModuleType) -> None:
    children = child_pids()
    with pytest.raises(LookupError, match="async init failed on purpose"):
        await open_worker(cf.failing_async_init)
    assert child_pids() == children


@pytest.mark.parametrize("loop", LOOPS)
async def test_worker_loop_gives_the_call_that_loop(cf: ModuleType, loop: str) -> None:
    expected = "uvloop.Loop" if loop == "uvloop" else "asyncio.unix_events._UnixSelectorEventLoop"
    async with open_worker(worker_loop=loop) as w:
        assert await w.call(cf.loop_type) == expected
    async with open_pool(1, worker_loop=loop) as pool:
        assert await pool.submit(cf.loop_type) == expected


def test_bad_max_concurrency_and_worker_loop_raise_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    children = child_pids()
    for factory in (open_worker, lambda **kw: open_pool(2, **kw)):
        with pytest.raises(
            ValueError, match=r"worker_loop must be 'asyncio' or 'uvloop', got 'trio'"
        ):
            factory(worker_loop="trio")
        with pytest.raises(ValueError, match=r"max_concurrency must be >= 1 .*got 0"):
            factory(max_concurrency=0)
        with pytest.raises(TypeError, match=r"max_concurrency must be a positive int, got 2.0"):
            factory(max_concurrency=2.0)
        with pytest.raises(TypeError, match=r"max_concurrency must be a positive int, got True"):
            factory(max_concurrency=True)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if it were not installed
    with pytest.raises(ValueError, match=r"worker_loop='uvloop' but uvloop is not installed"):
        open_worker(worker_loop="uvloop")
    assert child_pids() == children


# ------------------------------------------------------------------ pools


async def test_a_pool_runs_size_times_max_concurrency_coroutine_calls_at_once(
    cf: ModuleType,
) -> None:
    async with open_pool(2, max_concurrency=5) as pool:
        pids = set(pool.pids())
        results = await asyncio.gather(*(pool.submit(cf.stamped_sleep, 0.3) for _ in range(20)))
        assert {pid for _, _, pid in results} == pids
        assert max_overlap((b, e) for b, e, _ in results) == 10
        for pid in pids:
            assert max_overlap((b, e) for b, e, p in results if p == pid) == 5
        assert pool.stats().busy == 0


async def test_a_sync_call_in_a_pool_has_its_worker_to_itself(cf: ModuleType, fifo: Fifo) -> None:
    async with open_pool(2, max_concurrency=10) as pool:
        sync = asyncio.ensure_future(pool.submit(cf.announce_then_block, fifo.path, 1.0))
        (line,) = await fifo.lines(1)
        busy = int(line)
        (other,) = set(pool.pids()) - {busy}
        # while the sync call holds its worker, every coroutine call goes to the other
        results = await asyncio.gather(*(pool.submit(cf.stamped_sleep, 0) for _ in range(15)))
        assert {pid for _, _, pid in results} == {other}
        assert not sync.done()
        assert await sync == busy


async def test_cancelling_or_timing_out_a_coroutine_submit_keeps_its_worker(
    cf: ModuleType, fifo: Fifo
) -> None:
    async with open_pool(1, initializer=cf.dict_init, name="keep") as pool:
        pids = pool.pids()
        call = asyncio.ensure_future(pool.submit(cf.guarded, "c", 60, fifo.path))
        await fifo.lines(1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 10)
        with pytest.raises(
            TimeoutError,
            match=r"pool call coro_funcs.guarded timed out after timeout=0.3 s; its coroutine "
            r"was cancelled in worker keep/0 \(pid \d+\), which keeps serving",
        ):
            await pool.submit(cf.guarded, "t", 60, timeout=0.3)
        (state,) = await pool.run(cf.read_state)
        assert state["events"] == [("c", "cancelled"), ("t", "cancelled")]
        assert state["started"] == state["ended"] == 2
        assert pool.pids() == pids and pool.stats().restarts == 0


async def test_max_calls_per_worker_counts_concurrent_coroutine_calls(cf: ModuleType) -> None:
    async with open_pool(1, max_calls_per_worker=3, max_concurrency=10) as pool:
        results = await asyncio.gather(*(pool.submit(cf.stamped_sleep, 0.2) for _ in range(7)))
        per_worker = collections.Counter(pid for _, _, pid in results)
        # 3, 3 and 1 calls: a worker handed its third takes no more and is
        # replaced only once its calls are back (never while they run)
        assert sorted(per_worker.values()) == [1, 3, 3]
        spans = {pid: [(b, e) for b, e, p in results if p == pid] for pid in per_worker}
        for first, second in itertools.pairwise(sorted(spans.values())):
            assert max(e for _, e in first) < min(b for b, _ in second)
        assert pool.stats().restarts == 2


# --------------------------------------------------------------- dispatch


async def test_dispatch_least_busy_first_and_a_sync_call_waits_for_an_idle_position() -> None:
    d = Dispatch(None, 3)
    d.free([0, 1])
    assert [await d.take(True) for _ in range(4)] == [0, 1, 0, 1]
    sync = asyncio.ensure_future(d.take(False))
    later = asyncio.ensure_future(d.take(True))  # behind the sync call: first come first served
    await asyncio.sleep(0)
    assert not sync.done() and not later.done() and d.queued() == 2
    assert not d.give_back(0, True)
    await asyncio.sleep(0)
    assert not sync.done() and not later.done()  # position 0 still has a call
    d.give_back(0, True)
    assert await sync == 0  # idle now: the sync call holds it whole
    assert await later == 1
    assert (d.load(0), d.load(1)) == (1, 3)
    third = asyncio.ensure_future(d.take(True))
    await asyncio.sleep(0)
    assert not third.done()  # 0 is held whole, 1 is full
    d.give_back(0, False)
    assert await third == 0


async def test_dispatch_retires_a_worker_handed_its_last_call_once_they_are_back() -> None:
    d = Dispatch(None, 5, max_calls=2)
    d.free([0])
    assert [await d.take(True), await d.take(True)] == [0, 0]
    waiting = asyncio.ensure_future(d.take(True))
    await asyncio.sleep(0)
    assert not waiting.done()  # its worker was handed its last call
    assert d.give_back(0, True) is False
    assert d.give_back(0, True) is True  # spent: the caller retires it
    assert await waiting == 0  # the next worker at 0 counts afresh
    assert await d.take(True) == 0
    cancelled = asyncio.ensure_future(d.take(True))
    await asyncio.sleep(0)
    cancelled.cancel()  # a waiter that leaves takes nothing with it
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert d.queued() == 0 and d.load(0) == 2


async def test_cancelling_run_of_a_coroutine_function_keeps_every_worker(
    cf: ModuleType, fifo: Fifo
) -> None:
    async with open_pool(2, initializer=cf.dict_init) as pool:
        pids = pool.pids()
        call = asyncio.ensure_future(pool.run(cf.guarded, ("r", 60, fifo.path)))
        assert sorted(int(line) for line in await fifo.lines(2)) == sorted(pids)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 10)
        states = await pool.run(cf.read_state)
        assert [s["events"] for s in states] == [[("r", "cancelled")]] * 2
        assert pool.pids() == pids and pool.stats().restarts == 0
