"""translate_signals next to the host application's own signal handlers.

A service embedding aioproc may have set handlers of its own, with
``signal.signal`` or with ``loop.add_signal_handler``.  ``translate_signals``
must never destroy them: inside the block the host's handler runs as well as
the translation, and after the block it is exactly what it was.  Every async
test runs on asyncio and uvloop (conftest); the loops' own signal machinery
differs, which is the point of running both.

Signals are sent to this very process with ``os.kill(os.getpid(), ...)``; the
kernel delivers a signal a thread sends itself before ``kill`` returns, so the
Python-level handler has run by the next line.  Only SIGUSR1/SIGUSR2 are
sent in-process, except in the subprocess test, whose child is killed with a
real SIGTERM from outside.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
from helpers import cancelling, forever, kill_self, run_on_new_loop, spin

from aioproc.signals import SignalException, pending_signal, translate_signals

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

LIMIT = 5  # seconds: how long any single wait in these tests may take

USR1 = signal.SIGUSR1
USR2 = signal.SIGUSR2


@pytest.fixture(autouse=True)
def saved_handlers() -> Iterator[None]:
    """Put SIGUSR1/SIGUSR2 back as they were, whatever a test did to them."""
    saved = {sig: signal.getsignal(sig) for sig in (USR1, USR2)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


class LoopHandler:
    """A host handler registered with ``loop.add_signal_handler``."""

    def __init__(self, sig: signal.Signals) -> None:
        self.sig = sig
        self.calls = 0
        self.called = asyncio.Event()
        self.loop = asyncio.get_running_loop()

    def __call__(self) -> None:
        self.calls += 1
        self.called.set()

    async def next_call(self) -> None:
        """Wait for a call the handler has not been waited for yet."""
        await asyncio.wait_for(self.called.wait(), LIMIT)
        self.called.clear()

    def __enter__(self) -> LoopHandler:
        self.loop.add_signal_handler(self.sig, self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.loop.remove_signal_handler(self.sig)


class PythonHandler:
    """A host handler installed with ``signal.signal``."""

    def __init__(self, sig: signal.Signals) -> None:
        self.sig = sig
        self.calls: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.calls.append(signum)

    def __enter__(self) -> PythonHandler:
        self.previous = signal.signal(self.sig, self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        signal.signal(self.sig, self.previous)


# -- the host's loop handler (loop.add_signal_handler) -----------------------


async def test_loop_handler_still_fires_after_the_block() -> None:
    # Finding 10: after one `async with translate_signals()` the host's loop
    # handler was gone and the signal was swallowed from then on.
    with LoopHandler(USR1) as host:
        installed = signal.getsignal(USR1)
        async with translate_signals((USR1,)) as ts:
            await spin()
        assert ts.received is None
        assert signal.getsignal(USR1) is installed
        kill_self(USR1)
        await host.next_call()
        kill_self(USR1)
        await host.next_call()
        assert host.calls == 2
        assert cancelling() == 0


async def test_loop_handler_runs_too_inside_the_block() -> None:
    with LoopHandler(USR1) as host:
        with pytest.raises(SignalException) as info:
            async with translate_signals((USR1,)):
                kill_self(USR1)
                await forever()
        assert info.value.sigval is USR1
        await host.next_call()
        await spin()
        assert host.calls == 1  # once, not once per receiver or per path
        # and after the block, on its own
        kill_self(USR1)
        await host.next_call()
        await spin()
        assert host.calls == 2
        assert cancelling() == 0


async def test_loop_handler_after_a_signal_at_the_very_end() -> None:
    with LoopHandler(USR1) as host:
        with pytest.raises(SignalException):
            async with translate_signals((USR1,)):
                kill_self(USR1)  # no await: the exit takes it
        await host.next_call()
        kill_self(USR1)
        await host.next_call()
        await spin()
        assert host.calls == 2
        assert cancelling() == 0


async def test_loop_handler_with_nested_and_concurrent_contexts() -> None:
    ready = asyncio.Event()

    async def other_task() -> None:
        async with translate_signals((USR1,)):
            ready.set()
            await forever()

    with LoopHandler(USR1) as host:
        other = asyncio.create_task(other_task())
        await ready.wait()
        with pytest.raises(SignalException):
            async with translate_signals((USR1, USR2)):
                async with translate_signals((USR1,)) as inner:
                    await spin()
                assert inner.received is None
                kill_self(USR1)
                await forever()
        with pytest.raises(SignalException):
            await other
        await host.next_call()
        await spin()
        assert host.calls == 1
        kill_self(USR1)
        await host.next_call()
        assert host.calls == 2


@pytest.mark.parametrize("kind", ["loop", "python"])
async def test_every_signal_reaches_the_host_once(kind: str) -> None:
    # Signals before an await, at the very end of the block and after it,
    # over and over: the host's handler sees each one once, the guarded task
    # each one sent inside the block once, and nothing is left pending.
    host: LoopHandler | PythonHandler = LoopHandler(USR1) if kind == "loop" else PythonHandler(USR1)
    sent = translated = 0

    def calls() -> int:
        return host.calls if isinstance(host, LoopHandler) else len(host.calls)

    with host:
        for i in range(100):
            where = ("nowhere", "awaiting", "at the end", "after")[i % 4]
            try:
                async with translate_signals((USR1,)):
                    await asyncio.sleep(0)
                    if where in ("awaiting", "at the end"):
                        kill_self(USR1)
                        sent += 1
                    if where == "awaiting":
                        await forever()
            except SignalException as exc:
                translated += exc.sigval is USR1
            if where == "after":
                kill_self(USR1)
                sent += 1
            if isinstance(host, LoopHandler) and where != "nowhere":
                await host.next_call()
            assert (calls(), cancelling()) == (sent, 0), where
        await spin()
    assert (sent, translated, calls()) == (75, 50, 75)
    assert pending_signal() is None


async def test_loop_handler_added_inside_the_block_is_kept() -> None:
    # The host changes its mind while the block runs: its choice wins.
    loop = asyncio.get_running_loop()
    host = LoopHandler(USR1)
    try:
        async with translate_signals((USR1,)):
            loop.add_signal_handler(USR1, host)
            installed = signal.getsignal(USR1)
        assert signal.getsignal(USR1) is installed
        kill_self(USR1)
        await host.next_call()
        assert host.calls == 1
    finally:
        loop.remove_signal_handler(USR1)


# -- the host's Python-level handler (signal.signal) -------------------------


async def test_python_handler_runs_too_and_is_back() -> None:
    with PythonHandler(USR1) as host:
        with pytest.raises(SignalException) as info:
            async with translate_signals((USR1,)):
                assert signal.getsignal(USR1) is not host
                kill_self(USR1)
                assert host.calls == [USR1]  # called at once, like the host expects
                await forever()
        assert info.value.sigval is USR1
        assert signal.getsignal(USR1) is host
        kill_self(USR1)
        await spin()
        assert host.calls == [USR1, USR1]
        assert cancelling() == 0


async def test_python_handler_set_inside_the_block_is_kept() -> None:
    host = PythonHandler(USR1)
    async with translate_signals((USR1,)):
        signal.signal(USR1, host)
    assert signal.getsignal(USR1) is host
    kill_self(USR1)
    assert host.calls == [USR1]


async def test_host_handler_that_raises_still_gets_the_signal_translated() -> None:
    # The host's handler decides what its signal does; the guarded task still
    # learns of it (the delivery is scheduled before the host's handler runs).
    class HostStop(Exception):
        pass

    def stop(signum: int, frame: FrameType | None) -> None:
        raise HostStop(signum)

    signal.signal(USR1, stop)
    ts = translate_signals((USR1,))
    with pytest.raises(HostStop):
        async with ts:
            kill_self(USR1)
    assert ts.received is USR1
    assert signal.getsignal(USR1) is stop
    assert pending_signal() is None
    await spin()
    assert cancelling() == 0


async def test_default_handlers_are_not_called() -> None:
    # SIG_IGN and SIG_DFL have nothing to call; SIG_DFL would kill us.
    signal.signal(USR1, signal.SIG_IGN)
    signal.signal(USR2, signal.SIG_DFL)
    for sig in (USR1, USR2):
        with pytest.raises(SignalException) as info:
            async with translate_signals((sig,)):
                kill_self(sig)
                await forever()
        assert info.value.sigval is sig
    assert signal.getsignal(USR1) is signal.SIG_IGN
    assert signal.getsignal(USR2) is signal.SIG_DFL


async def test_default_int_handler_is_not_called() -> None:
    # Python's SIGINT default raises KeyboardInterrupt wherever the code is:
    # inside the block the translation takes its place.
    signal.signal(USR1, signal.default_int_handler)
    caught: BaseException | None = None
    try:
        async with translate_signals((USR1,)):
            kill_self(USR1)
            await forever()
    except BaseException as exc:  # a KeyboardInterrupt must fail the test, not the run
        caught = exc
    assert type(caught) is SignalException
    assert signal.getsignal(USR1) is signal.default_int_handler


async def test_c_level_handler_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # signal.getsignal() is None for a handler installed outside Python: it
    # could not be restored, so it is not replaced either.
    real = signal.getsignal

    def getsignal(sig: int) -> Any:
        return None if sig == USR2 else real(sig)

    before = real(USR1)
    monkeypatch.setattr(signal, "getsignal", getsignal)
    with pytest.raises(RuntimeError, match=r"^SIGUSR2 has a handler installed outside Python"):
        async with translate_signals((USR1, USR2)):
            pytest.fail("the body ran")  # pragma: no cover
    monkeypatch.undo()
    assert signal.getsignal(USR1) is before
    assert pending_signal() is None


SA_RESTART = 0x10000000  # Linux


def restarts(sig: int) -> bool:
    """Whether ``sig``'s disposition has SA_RESTART, read with sigaction(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    action = ctypes.create_string_buffer(512)  # larger than struct sigaction
    if libc.sigaction(sig, None, action) != 0:  # pragma: no cover
        raise OSError(ctypes.get_errno(), "sigaction")
    # glibc and musl: the handler pointer, a 128-byte sigset_t, int sa_flags
    offset = ctypes.sizeof(ctypes.c_void_p) + 128
    return bool(int.from_bytes(action.raw[offset : offset + 4], sys.byteorder) & SA_RESTART)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's sigaction")
async def test_sa_restart_is_restored() -> None:
    # The loops register with SA_RESTART (fewer EINTRs for C code), Python's
    # signal.signal without it; what was there comes back either way.
    with LoopHandler(USR1):
        assert restarts(USR1)
        async with translate_signals((USR1,)):
            assert restarts(USR1)
        assert restarts(USR1)
    with PythonHandler(USR1):
        assert not restarts(USR1)
        async with translate_signals((USR1,)):
            assert restarts(USR1)
        assert not restarts(USR1)


@pytest.mark.parametrize("base", ["asyncio", "uvloop"])
def test_loop_closed_under_an_unfinished_block(base: str) -> None:
    # A task abandoned inside the block, its loop closed: the next signal
    # goes to the handler that was there before, once, and it is back.
    if base == "uvloop" and uvloop is None:  # pragma: no cover
        pytest.skip("uvloop is not installed")
    entered = []

    async def abandoned() -> None:
        async with translate_signals((USR1,)):
            entered.append(True)
            await asyncio.Event().wait()

    with PythonHandler(USR1) as host:
        loop = asyncio.new_event_loop() if base == "asyncio" else uvloop.new_event_loop()
        coro = abandoned()
        try:
            task = loop.create_task(coro)
            loop.run_until_complete(asyncio.sleep(0))
            assert entered == [True]
            loop.close()  # the task is still pending
            kill_self(USR1)
            assert host.calls == [USR1]
            assert signal.getsignal(USR1) is host
            kill_self(USR1)
            assert host.calls == [USR1, USR1]
        finally:
            loop.close()
            coro.close()  # runs the block's exit: nothing left to undo
        assert not task.done()
        assert signal.getsignal(USR1) is host


# -- loops without add_signal_handler, and asyncio.Runner's SIGINT ------------


def _factories() -> list[Any]:
    factories: list[Any] = [pytest.param(asyncio.SelectorEventLoop, id="asyncio")]
    if uvloop is not None:
        factories.append(pytest.param(uvloop.Loop, id="uvloop"))
    return factories


@pytest.mark.parametrize("base", _factories())
def test_loop_without_add_signal_handler(base: type[asyncio.AbstractEventLoop]) -> None:
    # A loop that cannot register signal handlers still gets them translated
    # in the main thread: translate_signals never asks the loop to.
    class NoSignals(base):  # type: ignore[misc,valid-type]
        def add_signal_handler(self, sig: int, callback: Any, *args: Any) -> None:
            raise NotImplementedError

        def remove_signal_handler(self, sig: int) -> bool:
            raise NotImplementedError

    before = signal.getsignal(USR1)

    async def body() -> None:
        async with translate_signals((USR1,)):
            kill_self(USR1)
            await forever()

    with pytest.raises(SignalException) as info:
        run_on_new_loop(NoSignals, body())
    assert info.value.sigval is USR1
    assert signal.getsignal(USR1) is before


@pytest.mark.parametrize("base", _factories())
def test_loop_in_another_thread_warns(base: type[asyncio.AbstractEventLoop]) -> None:
    # Python runs signal handlers in the main thread only: off it, the body
    # runs with the handlers untouched and a RuntimeWarning says why.
    results: list[Any] = []
    before = signal.getsignal(USR1)

    async def body() -> None:
        with pytest.warns(RuntimeWarning, match="main thread"):
            async with translate_signals((USR1,)) as ts:
                results.append(signal.getsignal(USR1))
        results.append(ts.received)

    def thread_main() -> None:
        try:
            run_on_new_loop(base, body())
        except BaseException as exc:  # reported to the test thread
            results.append(exc)

    thread = threading.Thread(target=thread_main)
    thread.start()
    thread.join(LIMIT)
    assert not thread.is_alive()
    assert results == [before, None]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.Runner is 3.11+")
@pytest.mark.parametrize("base", _factories())
def test_runner_sigint_handler_is_not_called(base: type[asyncio.AbstractEventLoop]) -> None:
    # asyncio.Runner's SIGINT handler is its stand-in for Python's default
    # (it cancels the main task, and raises KeyboardInterrupt the second
    # time): inside the block the translation takes its place, as for
    # default_int_handler, so a second Ctrl-C cannot break the cleanup the
    # first one started.  It is back afterwards.
    seen: list[Any] = []

    async def body() -> None:
        runner_handler = signal.getsignal(signal.SIGINT)
        try:
            async with translate_signals((signal.SIGINT,)):
                try:
                    kill_self(signal.SIGINT)
                    await forever()
                finally:
                    kill_self(signal.SIGINT)  # a second Ctrl-C during cleanup
                    await spin()
        except SignalException as exc:
            seen.append(exc.sigval)
        seen.append(cancelling())
        seen.append(signal.getsignal(signal.SIGINT) is runner_handler)

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with asyncio.Runner(loop_factory=base) as runner:
        try:
            runner.run(body())
        except KeyboardInterrupt:  # the second Ctrl-C went to the Runner
            seen.append("KeyboardInterrupt")
    assert seen == [signal.SIGINT, 0, True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# -- a real service: SIGTERM from outside, after the block ---------------------

SERVICE = """
import asyncio, signal, sys
from aioproc.signals import SignalException, translate_signals

async def main():
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    for job in range(2):
        async with translate_signals():
            await asyncio.sleep(0)
        print("job", job, "done", flush=True)
    print("ready", flush=True)
    await asyncio.wait_for(stop.wait(), 10)
    print("graceful shutdown", flush=True)
    return 3

if sys.argv[1] == "uvloop":
    import uvloop
    sys.exit(uvloop.run(main()))
sys.exit(asyncio.run(main()))
"""


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_service_sigterm_handler_survives_jobs(loop_name: str) -> None:
    if loop_name == "uvloop" and uvloop is None:  # pragma: no cover
        pytest.skip("uvloop is not installed")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVICE, loop_name],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines == ["job 0 done\n", "job 1 done\n", "ready\n"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=LIMIT)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert (proc.returncode, out, err) == (3, "graceful shutdown\n", "")
