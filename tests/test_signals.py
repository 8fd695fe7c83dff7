"""translate_signals / SignalException / pending_signal, on asyncio and uvloop.

Signals are sent to this very process with ``os.kill(os.getpid(), ...)`` from
inside the guarded body, right before it awaits, so no test waits on a timer.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
from helpers import cancelling, forever, kill_self, run_on_new_loop, spin

from aioproc.signals import SignalException, pending_signal, translate_signals

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

needs_uncancel = pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.uncancel is 3.11+")

LIMIT = 5  # seconds: how long any single wait in these tests may take


# libuv opens a process-wide pipe (its signal lock) with the first loop and
# never closes it; open it now, before any per-test fd leak check runs.
# Belongs in conftest.py (a suite-wide concern); kept here until it is there.
if uvloop is not None:
    uvloop.new_event_loop().close()


async def interrupted(sig: int) -> None:
    """Send ``sig`` inside ``translate_signals((sig,))`` and await forever."""
    async with translate_signals((sig,)):
        kill_self(sig)
        await forever()


@pytest.fixture
def usr1_calls() -> Iterator[list[int]]:
    """A custom Python-level SIGUSR1 handler that records its calls."""
    calls: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        yield calls
    finally:
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT])
async def test_signal_interrupts_await(sig: signal.Signals) -> None:
    with pytest.raises(SignalException) as info:
        await interrupted(sig)
    assert info.value.sigval is sig
    assert isinstance(info.value.sigval, signal.Signals)
    assert str(info.value) == f"Process {os.getpid()} got signal: {sig}"
    # The traceback points at the await the signal interrupted.
    assert any(entry.name == "forever" for entry in info.traceback)


async def test_default_signals() -> None:
    assert translate_signals().signals == (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
    )

    async def body() -> None:
        async with translate_signals():
            kill_self(signal.SIGHUP)
            await forever()

    with pytest.raises(SignalException) as info:
        await body()
    assert info.value.sigval is signal.SIGHUP


async def test_no_signal_body_runs_normally() -> None:
    before = {sig: signal.getsignal(sig) for sig in translate_signals().signals}
    async with translate_signals() as ts:
        await spin()
    assert ts.received is None
    assert {sig: signal.getsignal(sig) for sig in ts.signals} == before
    assert cancelling() == 0


async def test_other_exceptions_pass_through() -> None:
    async def raises_keyerror() -> None:
        async with translate_signals((signal.SIGUSR1,)):
            raise KeyError("boom")

    async def times_out() -> None:
        async with translate_signals((signal.SIGUSR1,)):
            await asyncio.wait_for(forever(), 0)

    with pytest.raises(KeyError):
        await raises_keyerror()
    with pytest.raises(asyncio.TimeoutError):  # TimeoutError itself on 3.11+
        await times_out()


async def test_cancellation_names_the_signal_and_pending_signal() -> None:
    seen: list[Any] = []
    ts = translate_signals((signal.SIGUSR1,))

    async def body() -> None:
        async with ts:
            seen.append(pending_signal())
            try:
                kill_self(signal.SIGUSR1)
                await forever()
            except asyncio.CancelledError as exc:
                seen.append(exc.args)
                seen.append(pending_signal())
                seen.append(pending_signal(asyncio.current_task()))
                seen.append(ts.received)
                raise

    assert pending_signal() is None
    with pytest.raises(SignalException):
        await body()
    assert seen == [
        None,
        ("got signal SIGUSR1",),
        signal.SIGUSR1,
        signal.SIGUSR1,
        signal.SIGUSR1,
    ]
    assert pending_signal() is None
    assert "got SIGUSR1" in repr(ts)


async def test_on_signal_hears_every_signal_and_the_task_is_cancelled_once() -> None:
    heard: list[tuple[signal.Signals, int]] = []
    second = asyncio.Event()
    cancels: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        heard.append((sig, threading.get_ident()))
        if len(heard) == 2:
            second.set()

    async def body() -> None:
        async with translate_signals((signal.SIGUSR1, signal.SIGUSR2), on_signal=on_signal):
            kill_self(signal.SIGUSR1)
            try:
                await forever()
            except asyncio.CancelledError as exc:
                cancels.append(str(exc.args[0]))
                # cleanup the first signal started; a second one does not interrupt it
                kill_self(signal.SIGUSR2)
                await asyncio.wait_for(second.wait(), LIMIT)
                raise

    with pytest.raises(SignalException) as info:
        await body()
    assert info.value.sigval is signal.SIGUSR1
    assert cancels == ["got signal SIGUSR1"]
    main = threading.get_ident()  # a plain callback on the loop, not the signal handler
    assert heard == [(signal.SIGUSR1, main), (signal.SIGUSR2, main)]


async def test_on_signal_must_be_callable() -> None:
    with pytest.raises(TypeError, match="on_signal must be callable, got 'nope'"):
        translate_signals(on_signal="nope")  # type: ignore[arg-type]


async def test_pending_signal_is_per_task() -> None:
    other_saw: list[Any] = []
    main_task = asyncio.current_task()
    assert main_task is not None

    async def other() -> None:
        other_saw.append(pending_signal())
        other_saw.append(pending_signal(main_task))

    async def body() -> None:
        async with translate_signals((signal.SIGUSR1,)):
            try:
                kill_self(signal.SIGUSR1)
                await forever()
            finally:
                # Cleanup may await; the cancellation is not repeated.
                await asyncio.shield(asyncio.create_task(other()))

    with pytest.raises(SignalException):
        await body()
    assert other_saw == [None, signal.SIGUSR1]
    assert pending_signal(main_task) is None


def test_pending_signal_outside_a_loop() -> None:
    assert pending_signal() is None


async def test_handlers_restored(usr1_calls: list[int]) -> None:
    handler = signal.getsignal(signal.SIGUSR1)
    int_handler = signal.getsignal(signal.SIGINT)
    inside: list[Any] = []

    async def body() -> None:
        async with translate_signals((signal.SIGUSR1, signal.SIGINT)):
            inside.append(signal.getsignal(signal.SIGUSR1))
            kill_self(signal.SIGUSR1)
            await forever()

    with pytest.raises(SignalException):
        await body()
    assert inside[0] is not handler
    assert signal.getsignal(signal.SIGUSR1) is handler
    assert signal.getsignal(signal.SIGINT) == int_handler
    assert usr1_calls == [signal.SIGUSR1]  # the host's handler ran too
    kill_self(signal.SIGUSR1)  # now it reaches the custom handler alone
    assert usr1_calls == [signal.SIGUSR1, signal.SIGUSR1]
    assert cancelling() == 0


@needs_uncancel
async def test_uncancel_keeps_the_count() -> None:
    with pytest.raises(SignalException):
        await interrupted(signal.SIGUSR1)
    assert cancelling() == 0
    # asyncio.timeout relies on the count: it must still turn its own
    # cancellation into TimeoutError, and plain awaits must not be cancelled.
    await spin()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):
            await forever()
    assert cancelling() == 0


@needs_uncancel
async def test_inside_timeout_and_taskgroup() -> None:
    children_cancelled = 0

    async def child(started: asyncio.Event) -> None:
        nonlocal children_cancelled
        started.set()
        try:
            await forever()
        except asyncio.CancelledError:
            children_cancelled += 1
            raise

    async def body() -> None:
        async with (
            asyncio.timeout(LIMIT),
            translate_signals((signal.SIGTERM,)),
            asyncio.TaskGroup() as tg,
        ):
            started = [asyncio.Event() for _ in range(3)]
            for event in started:
                tg.create_task(child(event))
            for event in started:
                await event.wait()
            kill_self(signal.SIGTERM)
            await forever()

    with pytest.raises(SignalException) as info:
        await body()
    assert info.value.sigval is signal.SIGTERM
    assert children_cancelled == 3
    assert cancelling() == 0


@needs_uncancel
async def test_signal_after_body_completed() -> None:
    ran: list[bool] = []

    async def body() -> None:
        async with translate_signals((signal.SIGUSR1,)):
            kill_self(signal.SIGUSR1)
            ran.append(True)  # no await: the loop has not dispatched it yet

    with pytest.raises(SignalException) as info:
        await body()
    assert ran == [True]
    assert info.value.sigval is signal.SIGUSR1
    assert info.value.__context__ is None
    assert cancelling() == 0
    await spin()  # the loop reads the wakeup byte: it must not cancel us now
    assert cancelling() == 0


@needs_uncancel
async def test_body_swallowing_the_cancellation_still_raises() -> None:
    swallowed: list[bool] = []

    async def body() -> None:
        async with translate_signals((signal.SIGUSR1,)):
            try:
                kill_self(signal.SIGUSR1)
                await forever()
            except asyncio.CancelledError:
                swallowed.append(True)

    with pytest.raises(SignalException) as info:
        await body()
    assert swallowed == [True]
    assert info.value.sigval is signal.SIGUSR1
    assert cancelling() == 0


@needs_uncancel
async def test_cleanup_error_propagates_unchanged() -> None:
    async def body() -> None:
        async with translate_signals((signal.SIGUSR1,)):
            try:
                kill_self(signal.SIGUSR1)
                await forever()
            except asyncio.CancelledError:
                raise RuntimeError("cleanup failed") from None

    with pytest.raises(RuntimeError, match="cleanup failed") as info:
        await body()
    assert isinstance(info.value.__context__, asyncio.CancelledError)
    assert cancelling() == 0


@needs_uncancel
async def test_later_signals_are_ignored() -> None:
    during_cleanup: list[Any] = []

    async def body() -> None:
        async with translate_signals((signal.SIGUSR1, signal.SIGUSR2)):
            try:
                kill_self(signal.SIGUSR1)
                await forever()
            finally:
                kill_self(signal.SIGUSR2)
                kill_self(signal.SIGUSR1)
                await spin()  # both dispatched now: no second cancellation
                during_cleanup.append(pending_signal())

    with pytest.raises(SignalException) as info:
        await body()
    assert during_cleanup == [signal.SIGUSR1]
    assert info.value.sigval is signal.SIGUSR1
    assert cancelling() == 0
    await spin()
    assert cancelling() == 0


async def test_nested_contexts(usr1_calls: list[int]) -> None:
    handler = signal.getsignal(signal.SIGUSR1)
    inner_errors: list[SignalException] = []
    outer = translate_signals((signal.SIGUSR1, signal.SIGUSR2))
    inner = translate_signals((signal.SIGUSR1,))

    async def body() -> None:
        async with outer:
            try:
                async with inner:
                    kill_self(signal.SIGUSR1)
                    await forever()
            except SignalException as exc:
                inner_errors.append(exc)
            assert outer.received is None
            # The inner context left; the outer one still translates SIGUSR1.
            kill_self(signal.SIGUSR1)
            await forever()

    with pytest.raises(SignalException) as info:
        await body()
    assert [e.sigval for e in inner_errors] == [signal.SIGUSR1]
    assert inner.received is signal.SIGUSR1
    assert info.value.sigval is signal.SIGUSR1
    assert outer.received is signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is handler
    assert usr1_calls == [signal.SIGUSR1, signal.SIGUSR1]  # once per signal
    assert cancelling() == 0


@needs_uncancel
async def test_nested_signal_at_the_very_end_goes_to_the_inner_context() -> None:
    outer = translate_signals((signal.SIGUSR1,))
    inner = translate_signals((signal.SIGUSR1,))

    async def body() -> None:
        async with outer:
            with pytest.raises(SignalException) as info:
                async with inner:
                    kill_self(signal.SIGUSR1)  # no await: the inner exit takes it
            assert info.value.sigval is signal.SIGUSR1
            await spin()  # the queued delivery finds it taken

    await body()
    assert inner.received is signal.SIGUSR1
    assert outer.received is None
    assert cancelling() == 0


async def test_concurrent_tasks_all_get_the_signal() -> None:
    ready = [asyncio.Event(), asyncio.Event()]

    async def guarded(event: asyncio.Event) -> None:
        async with translate_signals((signal.SIGUSR1,)):
            event.set()
            await forever()

    tasks = [asyncio.create_task(guarded(event)) for event in ready]
    for event in ready:
        await event.wait()
    kill_self(signal.SIGUSR1)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert [type(r) for r in results] == [SignalException, SignalException]
    assert all(isinstance(r, SignalException) and r.sigval is signal.SIGUSR1 for r in results)


async def test_context_manager_object() -> None:
    ts = translate_signals([signal.SIGUSR1, signal.SIGUSR1, signal.SIGUSR2])
    assert ts.signals == (signal.SIGUSR1, signal.SIGUSR2)
    assert repr(ts) == "<translate_signals SIGUSR1,SIGUSR2 new>"
    async with ts as entered:
        assert entered is ts
        assert repr(ts) == "<translate_signals SIGUSR1,SIGUSR2 active>"
    assert repr(ts) == "<translate_signals SIGUSR1,SIGUSR2 exited>"
    with pytest.raises(RuntimeError, match="cannot be entered twice"):
        async with ts:
            pass


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (-1, "-1"),
        (signal.NSIG + 5, str(signal.NSIG + 5)),
        (signal.SIGKILL, "SIGKILL"),
        (signal.SIGSTOP, "SIGSTOP"),
        (signal.SIGCHLD, "SIGCHLD"),
    ],
)
def test_invalid_signals(value: int, text: str) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(ValueError, match=text):
        translate_signals((signal.SIGUSR1, value))
    assert signal.getsignal(signal.SIGUSR1) is before


@pytest.mark.parametrize("value", [signal.SIGTERM, ("SIGTERM",), (1.5,), (True,)])
def test_wrong_types(value: Any) -> None:
    with pytest.raises(TypeError, match="signal"):
        translate_signals(value)


def _factories() -> list[Any]:
    factories: list[Any] = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    if uvloop is not None:
        factories.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    return factories


@pytest.mark.parametrize("loop_factory", _factories())
def test_off_main_thread_warns_and_runs_the_body(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    ran: list[bool] = []
    errors: list[BaseException] = []
    before = signal.getsignal(signal.SIGTERM)

    async def body() -> None:
        async with translate_signals() as ts:
            ran.append(True)
            await asyncio.sleep(0)
        assert ts.received is None
        assert pending_signal() is None

    def thread_main() -> None:
        try:
            run_on_new_loop(loop_factory, body())
        except BaseException as exc:
            errors.append(exc)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thread = threading.Thread(target=thread_main)
        thread.start()
        thread.join(LIMIT)
    assert not thread.is_alive()
    assert errors == []
    assert ran == [True]
    assert [w.category for w in caught] == [RuntimeWarning]
    assert "main thread" in str(caught[0].message)
    assert caught[0].filename == __file__  # attributed to the `async with`
    assert signal.getsignal(signal.SIGTERM) == before


def test_signal_exception_pickles() -> None:
    exc = SignalException("Process 1 got signal: 15", signal.SIGTERM)
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is SignalException
    assert str(copy) == "Process 1 got signal: 15"
    assert copy.args == exc.args
    assert copy.sigval is signal.SIGTERM


def test_import_has_no_side_effects() -> None:
    code = (
        "import signal\n"
        "before = {s: signal.getsignal(s) for s in signal.valid_signals()}\n"
        "import aioproc.signals\n"
        "after = {s: signal.getsignal(s) for s in signal.valid_signals()}\n"
        "assert before == after, (before, after)\n"
        "assert signal.set_wakeup_fd(-1) == -1\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
