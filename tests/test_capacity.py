"""``aioproc.Capacity``: a shared process budget, first come first served, cancellation-safe.

Every async test runs on asyncio and on uvloop (``conftest.py``).
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest

import aioproc
import aioproc.metrics
from aioproc import Capacity


async def settle(rounds: int = 5) -> None:
    """Let every task that can run, run (the woken ones resume a step later)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def test_reserve_holds_and_releases() -> None:
    capacity = aioproc.Capacity(16)
    assert (capacity.total, capacity.in_use, capacity.waiting) == (16, 0, 0)
    async with capacity.reserve(5):
        assert capacity.in_use == 5
        assert repr(capacity) == "<Capacity 5/16 in use, 0 waiting>"
        await capacity.acquire(11)
        assert capacity.in_use == 16
        capacity.release(11)
    assert capacity.in_use == 0


async def test_a_block_that_raises_still_releases() -> None:
    capacity = Capacity(2)
    with pytest.raises(KeyError):
        async with capacity.reserve(2):
            raise KeyError("boom")
    assert capacity.in_use == 0


async def test_more_than_the_total_is_refused_naming_both() -> None:
    capacity = Capacity(16)
    with pytest.raises(ValueError, match="cannot reserve 17 slots from a Capacity of 16"):
        await capacity.acquire(17)
    assert (capacity.in_use, capacity.waiting) == (0, 0)


@pytest.mark.parametrize(
    ("k", "error"), [(0, ValueError), (-1, ValueError), (True, TypeError), (1.5, TypeError)]
)
async def test_bad_sizes_are_refused(k: object, error: type[Exception]) -> None:
    capacity = Capacity(4)
    with pytest.raises(error, match=repr(k).replace(".", r"\.")):
        await capacity.acquire(k)  # type: ignore[arg-type]
    with pytest.raises(error, match=repr(k).replace(".", r"\.")):
        capacity.release(k)  # type: ignore[arg-type]


@pytest.mark.parametrize(("total", "error"), [(0, ValueError), ("3", TypeError), (None, TypeError)])
def test_bad_totals_are_refused(total: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="Capacity\\(total\\)"):
        Capacity(total)  # type: ignore[arg-type]


async def test_releasing_more_than_is_held_is_an_error() -> None:
    capacity = Capacity(4)
    await capacity.acquire(2)
    with pytest.raises(RuntimeError, match="cannot release 3 slots: only 2 are in use"):
        capacity.release(3)
    capacity.release(2)


async def test_a_big_request_at_the_head_holds_back_small_ones() -> None:
    capacity = Capacity(4)
    await capacity.acquire(3)
    order: list[str] = []

    async def take(name: str, k: int) -> None:
        async with capacity.reserve(k):
            order.append(name)
            await hold.wait()

    hold = asyncio.Event()
    big = asyncio.create_task(take("big", 4))
    await settle()
    small = asyncio.create_task(take("small", 1))  # would fit now, but comes second
    await settle()
    assert (order, capacity.waiting) == ([], 2)
    capacity.release(3)
    await settle()
    assert order == ["big"] and capacity.in_use == 4
    hold.set()
    await asyncio.gather(big, small)
    assert order == ["big", "small"] and capacity.in_use == 0


async def test_200_random_reservations_never_exceed_the_total_and_go_in_order() -> None:
    rng = random.Random(2024)
    capacity = Capacity(16)
    requested: list[int] = []
    granted: list[int] = []
    peak = 0

    async def job(i: int, k: int, holds: int) -> None:
        nonlocal peak
        requested.append(i)
        async with capacity.reserve(k):
            granted.append(i)
            peak = max(peak, capacity.in_use)
            assert capacity.in_use <= capacity.total
            for _ in range(holds):
                await asyncio.sleep(0)
                assert capacity.in_use <= capacity.total

    tasks = [
        asyncio.create_task(job(i, rng.randint(1, 16), rng.randint(0, 20))) for i in range(200)
    ]
    await asyncio.gather(*tasks)
    assert requested == list(range(200))
    assert granted == requested  # first come, first served
    assert 8 < peak <= 16
    assert (capacity.in_use, capacity.waiting) == (0, 0)


async def test_a_cancelled_waiter_takes_nothing_and_wakes_the_next() -> None:
    capacity = Capacity(4)
    await capacity.acquire(3)
    big = asyncio.create_task(capacity.acquire(4))
    await settle()
    small = asyncio.create_task(capacity.acquire(1))
    await settle()
    assert capacity.waiting == 2
    big.cancel()
    await settle()
    assert small.done() and big.cancelled()
    assert (capacity.in_use, capacity.waiting) == (4, 0)
    capacity.release(4)


async def test_a_waiter_cancelled_after_its_grant_gives_the_slots_back() -> None:
    capacity = Capacity(2)
    await capacity.acquire(2)
    first = asyncio.create_task(capacity.acquire(2))
    second = asyncio.create_task(capacity.acquire(1))
    await settle()
    capacity.release(2)  # grants ``first``, which has not run yet
    assert capacity.in_use == 2
    first.cancel()  # before it resumes
    await settle()
    assert first.cancelled()
    assert second.done() and capacity.in_use == 1
    capacity.release(1)
    assert (capacity.in_use, capacity.waiting) == (0, 0)


async def test_a_timeout_leaves_nothing_held() -> None:
    capacity = Capacity(3)
    await capacity.acquire(3)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(capacity.acquire(1), 0.01)
    assert (capacity.in_use, capacity.waiting) == (3, 0)
    capacity.release(3)


async def test_cancellation_at_random_points_leaves_nothing_held() -> None:
    rng = random.Random(7)
    capacity = Capacity(8)
    high = 0

    async def job(k: int, holds: int) -> None:
        nonlocal high
        for _ in range(3):
            async with capacity.reserve(k):
                high = max(high, capacity.in_use)
                for _ in range(holds):
                    await asyncio.sleep(0)

    tasks = [asyncio.create_task(job(rng.randint(1, 8), rng.randint(0, 5))) for _ in range(400)]
    cancelled = 0
    while not all(task.done() for task in tasks):
        for _ in range(rng.randint(0, 3)):
            await asyncio.sleep(0)
        victim = rng.choice(tasks)
        if not victim.done() and rng.random() < 0.5:
            victim.cancel()
            cancelled += 1
        assert capacity.in_use <= capacity.total
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert cancelled > 100
    assert sum(isinstance(r, asyncio.CancelledError) for r in results) > 100
    assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results)
    assert high <= 8
    assert (capacity.in_use, capacity.waiting) == (0, 0)


@pytest.mark.parametrize(("name", "error"), [("", ValueError), (3, TypeError)])
def test_bad_names_are_refused(name: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"Capacity\(name\)"):
        Capacity(4, name=name)  # type: ignore[arg-type]


async def test_the_metrics_show_slots_in_use_and_requests_waiting() -> None:
    recorder = aioproc.metrics.enable(aioproc.metrics.Recorder())
    try:
        capacity = Capacity(4, name="gpus")

        def figures() -> list[str]:
            text = aioproc.metrics.render(recorder)
            return [x for x in text.splitlines() if x.startswith("aioproc_capacity_")]

        assert figures() == [
            'aioproc_capacity_slots{capacity="gpus"} 4.0',
            'aioproc_capacity_slots_in_use{capacity="gpus"} 0.0',
            'aioproc_capacity_waiting{capacity="gpus"} 0.0',
        ]
        await capacity.acquire(3)
        waiter = asyncio.ensure_future(capacity.acquire(2))
        await asyncio.sleep(0)  # it queues
        assert figures()[1:] == [
            'aioproc_capacity_slots_in_use{capacity="gpus"} 3.0',
            'aioproc_capacity_waiting{capacity="gpus"} 1.0',
        ]
        capacity.release(3)
        await waiter
        assert figures()[1:] == [
            'aioproc_capacity_slots_in_use{capacity="gpus"} 2.0',
            'aioproc_capacity_waiting{capacity="gpus"} 0.0',
        ]
    finally:
        aioproc.metrics.disable()


async def test_a_persistent_worker_waits_for_its_slot_and_holds_it_until_reaped() -> None:
    capacity = Capacity(1, name="workers")
    async with aioproc.open_worker(capacity=capacity) as first:
        first_pid = await first.call(os.getpid)
        assert (capacity.in_use, capacity.waiting) == (1, 0)
        second = asyncio.ensure_future(aioproc.open_worker(capacity=capacity))
        cancelled = asyncio.ensure_future(aioproc.open_worker(capacity=capacity))
        await settle()
        assert (capacity.in_use, capacity.waiting) == (1, 2)
        assert not second.done()
        cancelled.cancel()
        await settle()
        assert cancelled.cancelled()
        assert (capacity.in_use, capacity.waiting) == (1, 1)
    # the first one is reaped: its slot goes to the second
    with pytest.raises(ProcessLookupError):
        os.kill(first_pid, 0)
    worker = await asyncio.wait_for(second, 30)
    try:
        assert (capacity.in_use, capacity.waiting) == (1, 0)
        assert await worker.call(os.getpid) != first_pid
    finally:
        await worker.aclose()
    assert (capacity.in_use, capacity.waiting) == (0, 0)


@pytest.mark.parametrize(
    ("capacity", "error", "text"),
    [
        ("4", TypeError, "capacity must be an aioproc.Capacity, got '4'"),
        (4, TypeError, "capacity must be an aioproc.Capacity, got 4"),
    ],
)
def test_a_bad_capacity_for_a_worker_is_refused_before_it_starts(
    capacity: object, error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=f"^{text}$"):
        aioproc.open_worker(capacity=capacity)  # type: ignore[arg-type]
