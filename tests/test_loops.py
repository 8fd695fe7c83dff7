"""Clear errors for the common mistakes: a missing await, no asyncio loop, another loop."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
from helpers import child_pids

import aioproc

T = TypeVar("T")


def add(a: int, b: int) -> int:
    return a + b


async def test_forgotten_await_on_start_processes_says_so() -> None:
    pending = aioproc.start_processes("g", "/bin/true", {0: ()}, {0: {}})
    with pytest.raises(AttributeError, match=r"'wait'.*did you forget await\?") as info:
        pending.wait  # noqa: B018 - the attribute access is the mistake under test
    assert "await start_processes(...)" in str(info.value)
    assert child_pids() == set()  # nothing was started by the mistake


@pytest.mark.parametrize(
    ("factory", "attr", "name"),
    [
        (lambda: aioproc.open_pool(1), "submit", "open_pool(...)"),
        (lambda: aioproc.open_worker(), "call", "open_worker(...)"),
    ],
)
def test_forgotten_await_on_pools_and_workers_says_so(
    factory: Callable[[], Any], attr: str, name: str
) -> None:
    with pytest.raises(AttributeError, match="did you forget await") as info:
        getattr(factory(), attr)
    assert f"await {name}" in str(info.value)


def test_awaiting_without_an_asyncio_loop_names_what_is_needed() -> None:
    """A coroutine driven by hand (as another event loop would) gets a clear error."""

    async def main() -> None:
        await aioproc.start_processes("g", "/bin/true", {0: ()}, {0: {}})

    coro = main()
    with pytest.raises(RuntimeError, match=r"needs a running asyncio event loop") as info:
        coro.send(None)
    coro.close()
    assert "start_processes(...)" in str(info.value)
    assert child_pids() == set()


def test_under_trio_the_error_says_trio() -> None:
    pytest.importorskip("trio")
    code = textwrap.dedent(
        """
        import trio, aioproc
        async def main():
            try:
                await aioproc.run("/bin/true", 1)
            except RuntimeError as e:
                print("ERR", e)
        trio.run(main)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    ).stdout
    assert "ERR" in out and "running under trio" in out, out


def _in_other_loop(coro_fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``coro_fn()`` on a fresh asyncio loop in another thread."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro_fn())
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join(30)
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


async def test_a_pool_used_from_another_loop_is_refused_at_once() -> None:
    async with aioproc.open_pool(1) as pool:
        assert await pool.submit(add, 1, 2) == 3
        with pytest.raises(RuntimeError, match="belongs to the event loop it was started on"):
            _in_other_loop(lambda: pool.submit(add, 1, 2))
        with pytest.raises(RuntimeError, match="belongs to the event loop"):
            _in_other_loop(pool.aclose)
        # still usable, and closed normally, on its own loop
        assert await pool.submit(add, 2, 3) == 5


async def test_a_worker_used_from_another_loop_is_refused_at_once() -> None:
    async with aioproc.open_worker() as w:
        with pytest.raises(RuntimeError, match="belongs to the event loop"):
            _in_other_loop(lambda: w.call(add, 1, 2))
        assert await w.call(add, 1, 2) == 3


async def test_a_group_used_from_another_loop_is_refused_at_once() -> None:
    async with aioproc.start_processes("g", "sleep", {0: ("30",)}, {0: {}}) as pc:
        with pytest.raises(RuntimeError, match="belongs to the event loop"):
            _in_other_loop(pc.wait)
        with pytest.raises(RuntimeError, match="belongs to the event loop"):
            _in_other_loop(pc.close)
        await pc.close(timeout=5)
    assert all(not _alive(pid) for pid in pc.pids().values())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False
