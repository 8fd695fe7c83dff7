"""Coroutine workers: ``async def`` runs on a loop of its own in the worker.

The runner every worker uses (``aioproc._child.aio``) first, in fresh
interpreters where signals are involved; then groups of coroutine workers
through ``run``/``start_processes`` on both start methods, their stop by
SIGTERM/SIGINT/SIGHUP (cancellation, then death by that signal), the
barrier from coroutines, the agent and the cluster runner.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import subprocess
import textwrap
from typing import Any

import pytest
from helpers import python

from aioproc._child import aio

# ------------------------------------------------------------------ the runner


def run_child(code: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (dedented) in a fresh interpreter; its output and status."""
    return subprocess.run(
        python(textwrap.dedent(code)), capture_output=True, text=True, timeout=timeout
    )


async def _coro_fn() -> None: ...


def _sync_fn() -> None: ...


class _Callable:
    async def method(self) -> None: ...

    async def __call__(self) -> None: ...


def test_coroutine_functions_are_told_apart_without_inspect() -> None:
    assert aio.is_coroutine_function(_coro_fn)
    assert aio.is_coroutine_function(functools.partial(functools.partial(_coro_fn)))
    assert aio.is_coroutine_function(_Callable().method)
    assert not aio.is_coroutine_function(_sync_fn)
    assert not aio.is_coroutine_function(functools.partial(_sync_fn))
    assert not aio.is_coroutine_function(len)
    # as inspect says: an object with an async __call__ is told by what it returns
    assert not aio.is_coroutine_function(_Callable())
    coro = _Callable()()
    assert aio.is_coroutine(coro)
    coro.close()
    assert not aio.is_coroutine(asyncio.sleep)


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_run_returns_the_value_on_a_fresh_loop_of_the_kind_asked_and_closes_it(
    kind: str,
) -> None:
    loops: list[asyncio.AbstractEventLoop] = []

    async def main(x: int) -> tuple[int, str]:
        loop = asyncio.get_running_loop()
        loops.append(loop)
        assert asyncio.get_event_loop() is loop
        await asyncio.sleep(0)
        return x * 2, type(loop).__module__

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    value, module = aio.run(main(21), loop=kind)
    assert value == 42
    assert module.split(".")[0] == kind
    assert loops[0].is_closed()
    # the handlers the runner installed are gone: the ones before are back
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_run_raises_what_the_coroutine_raised_with_its_own_frames_first() -> None:
    async def inner() -> None:
        raise KeyError("deep")

    async def main() -> None:
        await inner()

    with pytest.raises(KeyError, match="deep") as info:
        aio.run(main())
    # as the worker's boot code sees it: from the frame that called run() on
    tb = info.value.__traceback__
    assert tb is not None and tb.tb_frame.f_code.co_name.startswith("test_")
    tb = aio.user_traceback(tb.tb_next)
    assert tb is not None
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert names == ["main", "inner"]


def test_run_cancels_what_is_left_and_shuts_down_async_generators() -> None:
    seen: list[str] = []

    async def agen() -> Any:
        try:
            yield 1
            yield 2
        finally:
            seen.append("agen closed")

    async def left() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            seen.append("left cancelled")

    async def main() -> str:
        gen = agen()
        await gen.__anext__()  # left suspended
        asyncio.get_running_loop().create_task(left())
        await asyncio.sleep(0)
        return "done"

    assert aio.run(main()) == "done"
    assert sorted(seen) == ["agen closed", "left cancelled"]


def test_an_invalid_loop_is_a_value_error_naming_it_and_the_coroutine_is_closed() -> None:
    coro = _coro_fn()
    with pytest.raises(
        ValueError, match="worker_loop must be one of 'asyncio', 'uvloop', got 'tokio'"
    ):
        aio.run(coro, loop="tokio")
    assert coro.cr_frame is None  # closed: no "never awaited" warning (warnings are errors)


def test_a_missing_uvloop_is_an_import_error_that_says_what_to_do() -> None:
    proc = run_child(
        """
        import sys
        sys.modules["uvloop"] = None  # not importable
        from aioproc._child import aio
        async def main(): pass
        try:
            aio.run(main(), loop="uvloop")
        except ImportError as e:
            print(e)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "worker_loop='uvloop', but uvloop cannot be imported here" in proc.stdout
    assert "use worker_loop='asyncio'" in proc.stdout


STOPPED_CHILD = """
    import asyncio, os, signal, sys
    from aioproc._child import aio

    async def main():
        print("loop", type(asyncio.get_running_loop()).__module__, flush=True)
        try:
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))
            await asyncio.sleep(60)
        finally:
            # a second signal while unwinding: ignored, the cleanup completes
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(0.05)
            print("finally ran", flush=True)

    try:
        aio.run(main(), loop=sys.argv[2])
    except aio.Stopped as stopped:
        print("stopped by", stopped.signum, "cause", stopped.__cause__, flush=True)
        aio.die_by(stopped.signum)
    print("not reached", flush=True)
"""


@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_stop_signal_cancels_the_coroutine_then_the_process_dies_of_it(
    sig: str, kind: str
) -> None:
    proc = subprocess.run(
        [*python(textwrap.dedent(STOPPED_CHILD)), sig, kind],
        capture_output=True,
        text=True,
        timeout=30,
    )
    signum = getattr(signal, sig)
    assert proc.returncode == -signum, proc.stderr
    assert proc.stdout.splitlines()[1:] == ["finally ran", f"stopped by {signum} cause None"]
    assert proc.stdout.startswith(f"loop {kind}")
    assert proc.stderr == ""


def test_an_exception_raised_while_unwinding_is_the_cause_of_stopped() -> None:
    proc = run_child(
        """
        import asyncio, os, signal
        from aioproc._child import aio

        async def main():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                await asyncio.sleep(60)
            finally:
                raise OSError("cleanup failed")

        try:
            aio.run(main())
        except aio.Stopped as stopped:
            print(repr(stopped.__cause__), stopped, flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "OSError('cleanup failed') stopped by signal 15\n"


def test_a_coroutine_that_swallows_the_cancellation_is_still_stopped() -> None:
    proc = run_child(
        """
        import asyncio, os, signal
        from aioproc._child import aio

        async def main():
            try:
                os.kill(os.getpid(), signal.SIGHUP)
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                return "swallowed"

        try:
            print(aio.run(main()))
        except aio.Stopped as stopped:
            aio.die_by(stopped.signum)
        """
    )
    assert proc.returncode == -signal.SIGHUP
    assert proc.stdout == ""
