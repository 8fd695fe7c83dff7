"""aioproc.worker: persistent worker processes (``open_worker``), end to end.

Every test starts real workers.  The functions they run live in
``children/pw_funcs.py`` (standard library only), which the ``pw`` fixture
puts on ``sys.path``: the parent sends them by reference and the worker
imports them through the parent's import path.  A worker that must be in
the middle of a call writes a byte (or its pid) to a FIFO the test reads
before it acts; nothing here synchronises on a sleep.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import re
import signal
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
from helpers import child_pids, pid_gone
from proc_utils import Fifo, still_alive_after

import aioproc
from aioproc import BrokenWorkerError, ForcedKillWarning, WorkerProcess, open_worker
from aioproc.errors import RemoteTraceback

BIG = 100 * 1024 * 1024


def remote_tb(exc: BaseException) -> str:
    cause = exc.__cause__
    assert isinstance(cause, RemoteTraceback), f"__cause__ is {cause!r}"
    return str(cause)


def pid_in(message: str) -> int:
    m = re.search(r"pid (\d+)", message)
    assert m, f"no pid in {message!r}"
    return int(m.group(1))


# ------------------------------------------------------------------- init


async def test_init_runs_in_a_child_of_the_caller_and_ping_answers(pw: ModuleType) -> None:
    async with open_worker(init=pw.pids, name="pw-init") as w:
        assert isinstance(w, WorkerProcess)
        init_pid, init_ppid = await w.call(pw.read_state)
        assert init_pid == w.pid != os.getpid()
        assert init_ppid == os.getpid()
        await w.ping()
        assert await w.call(pw.pids) == (w.pid, os.getpid())
        await w.ping()
        assert repr(w) == f"<WorkerProcess pw-init pid={w.pid} idle>"
        assert w.returncode is None
    assert w.returncode == 0
    assert pid_gone(w.pid)
    assert repr(w) == f"<WorkerProcess pw-init pid={w.pid} exited 0>"


async def test_await_form_and_aclose_is_idempotent(pw: ModuleType) -> None:
    w = await open_worker()
    try:
        assert await w.call(pw.add, 2, 3) == 5
        with pytest.raises(RuntimeError, match="only available inside a persistent worker"):
            aioproc.worker_state()  # in the parent
        assert await w.call(pw.read_state) is None  # no init: the state is None
    finally:
        await w.aclose()
    await w.aclose()
    assert w.returncode == 0 and pid_gone(w.pid)
    with pytest.raises(BrokenWorkerError):  # exited: every later request fails at once
        await w.call(pw.noop)


async def test_init_slower_than_init_timeout_raises_timeout_error(pw: ModuleType) -> None:
    before = child_pids()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"init_timeout=0\.3\b") as info:
        await open_worker(init=pw.slow_init, init_args=(30,), init_timeout=0.3)
    assert time.monotonic() - t0 < 5
    pid = pid_in(str(info.value))
    assert pid_gone(pid)  # killed and reaped
    assert child_pids() == before


async def test_failing_init_raises_its_own_type_with_the_worker_traceback(
    pw: ModuleType,
) -> None:
    before = child_pids()
    with pytest.raises(pw.InitFailed, match="init failed: no disk") as info:
        async with open_worker(init=pw.failing_init, init_args=("no disk",)):
            pytest.fail("the block must not run")  # pragma: no cover
    tb = remote_tb(info.value)
    assert 'raise InitFailed(f"init failed: {reason}")' in tb
    assert "failing_init" in tb and "pw_funcs.py" in tb
    assert child_pids() == before  # the worker is gone and reaped


async def test_worker_dying_during_init_raises_broken_worker_error(pw: ModuleType) -> None:
    before = child_pids()
    with pytest.raises(
        BrokenWorkerError, match=r"worker quits \(pid \d+\) exited with code 7 during init"
    ):
        await open_worker(init=sys.exit, init_args=(7,), name="quits")
    assert child_pids() == before


async def test_cancelled_start_kills_the_half_started_worker(pw: ModuleType, fifo: Fifo) -> None:
    before = child_pids()
    start = asyncio.ensure_future(
        open_worker(init=pw.announce_pid_then_block, init_args=(fifo.path,))
    )
    (line,) = await fifo.lines(1)
    pid = int(line)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(start, 10)
    assert pid_gone(pid)
    assert child_pids() == before


async def test_bad_arguments_raise_builtin_errors() -> None:
    with pytest.raises(ValueError, match="init_timeout must be a number >= 0, got -1"):
        await open_worker(init=print, init_timeout=-1)
    with pytest.raises(TypeError, match="init must be callable, got 42"):
        await open_worker(init=42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="env must map str to str"):
        await open_worker(env={"X": 1})  # type: ignore[dict-item]


async def test_env_reaches_the_worker_not_the_parent(pw: ModuleType) -> None:
    assert "PW_TEST_VAR" not in os.environ
    async with open_worker(env={"PW_TEST_VAR": "hello"}) as w:
        assert await w.call(pw.getenv, "PW_TEST_VAR") == "hello"
    assert "PW_TEST_VAR" not in os.environ


# -------------------------------------------------------- checkpoint writer


async def test_checkpoint_writer_example(pw: ModuleType, tmp_path: Path) -> None:
    """PyTorch's CheckpointProcess: init opens a writer, calls save state dicts with it."""
    rank = 3
    states = {
        step: {"weight": [float(step + i) for i in range(4)], "bias": [step * 0.5, -1.0]}
        for step in range(3)
    }
    async with open_worker(init=pw.open_writer, init_args=(str(tmp_path), rank)) as w:
        served_by = set()
        for step, state in states.items():
            path, pid = await w.call(pw.write_checkpoint, step, state)
            assert path == str(tmp_path / f"checkpoint_{rank}_step{step}.pt")
            served_by.add(pid)
        assert served_by == {w.pid}
        assert w.calls == 3
    for step, state in states.items():
        with open(tmp_path / f"checkpoint_{rank}_step{step}.pt", "rb") as f:
            assert pickle.load(f) == {"step": step, "rank": rank, "state_dict": state}
    journal = (tmp_path / f"journal_{rank}.log").read_text().splitlines()
    assert journal == [f"{step} {w.pid} checkpoint_{rank}_step{step}.pt" for step in states]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"journal_{rank}.log"] + [f"checkpoint_{rank}_step{s}.pt" for s in states]
    )


# ----------------------------------------------------------- call errors


async def test_exception_in_fn_is_reraised_and_the_worker_stays_usable(pw: ModuleType) -> None:
    async with open_worker() as w:
        pid = w.pid
        with pytest.raises(pw.CallFailed, match=r"^bad input 7$") as info:
            await w.call(pw.raise_call_failed, "bad input 7")
        tb = remote_tb(info.value)
        assert "raise CallFailed(message)" in tb
        assert "raise_call_failed" in tb
        assert "CallFailed: bad input 7" in tb
        # same process, still answering
        assert await w.call(pw.getpid) == pid
        await w.ping()
        # a closure travels by value (cloudpickle); its exception type survives
        divisor = 0
        with pytest.raises(ZeroDivisionError) as info2:
            await w.call(lambda: 1 / divisor)
        assert "1 / divisor" in remote_tb(info2.value)
        assert await w.call(lambda x: x * divisor + 1, 5) == 1
        assert w.pid == pid and w.returncode is None


async def test_unpicklable_arguments_and_results(pw: ModuleType) -> None:
    import threading

    async with open_worker() as w:
        with pytest.raises(TypeError, match="cannot be pickled"):
            await w.call(pw.echo, threading.Lock())
        with pytest.raises(TypeError, match="lock"):
            await w.call(pw.make_lock)  # the result cannot travel back
        assert await w.call(pw.add, 1, 1) == 2


async def test_sys_exit_in_fn_breaks_the_worker(pw: ModuleType) -> None:
    async with open_worker(name="quitter") as w:
        with pytest.raises(
            BrokenWorkerError, match=r"worker quitter \(pid \d+\) exited with code 3"
        ):
            await asyncio.wait_for(w.call(sys.exit, 3), 10)
        assert w.returncode == 3
        assert not w.alive
        with pytest.raises(BrokenWorkerError, match="exited with code 3"):
            await w.ping()


async def test_concurrent_calls_are_serialised_and_all_answered(pw: ModuleType) -> None:
    async with open_worker() as w:
        results = await asyncio.gather(*(w.call(pw.add, i, 1) for i in range(50)))
        assert results == [i + 1 for i in range(50)]
        assert w.calls == 50


# -------------------------------------------------------------- SIGKILL


async def test_sigkill_during_a_call_raises_broken_worker_error_within_a_second(
    pw: ModuleType, fifo: Fifo
) -> None:
    async with open_worker(name="victim") as w:
        call = asyncio.ensure_future(w.call(pw.announce_then_block, fifo.path))
        assert await asyncio.wait_for(fifo.reader.readexactly(1), 20) == b"r"
        assert repr(w) == f"<WorkerProcess victim pid={w.pid} busy>"
        os.kill(w.pid, signal.SIGKILL)
        with pytest.raises(BrokenWorkerError) as info:
            await asyncio.wait_for(call, 1.0)
        msg = str(info.value)
        assert f"worker victim (pid {w.pid}) was killed by SIGKILL" in msg
        assert "about to block" in msg
        assert w.returncode == -signal.SIGKILL
        with pytest.raises(BrokenWorkerError, match="SIGKILL"):
            await w.call(pw.noop)


async def test_cancelling_a_call_kills_the_worker(pw: ModuleType, fifo: Fifo) -> None:
    async with open_worker() as w:
        pid = w.pid
        call = asyncio.ensure_future(w.call(pw.announce_then_block, fifo.path))
        await asyncio.wait_for(fifo.reader.readexactly(1), 20)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 5)
        assert await still_alive_after([pid], 5) == set()
        with pytest.raises(BrokenWorkerError, match="SIGKILL"):
            await asyncio.wait_for(w.call(pw.noop), 5)
        assert w.returncode == -signal.SIGKILL


async def test_cancelling_a_queued_call_kills_nobody(pw: ModuleType, fifo: Fifo) -> None:
    async with open_worker() as w:
        running = asyncio.ensure_future(w.call(pw.announce_then_block, fifo.path))
        queued = asyncio.ensure_future(w.call(pw.getpid))
        await asyncio.wait_for(fifo.reader.readexactly(1), 20)
        queued.cancel()  # still waiting for its turn: nothing was sent for it
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert not running.done() and w.alive and w.returncode is None
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(running, 5)


async def test_worker_killed_while_idle_is_not_reported_as_dying_during_a_call(
    pw: ModuleType,
) -> None:
    async with open_worker(name="idle") as w:
        os.kill(w.pid, signal.SIGKILL)
        assert await still_alive_after([w.pid], 5) == set()
        with pytest.raises(BrokenWorkerError, match=r"worker idle \(pid \d+\) was killed") as info:
            await asyncio.wait_for(w.ping(), 5)
        assert "during a call" not in str(info.value)  # it died between requests


# ------------------------------------------------------------- shutdown


async def test_worker_ignoring_terminate_is_killed_after_shutdown_timeout(
    pw: ModuleType,
) -> None:
    w = await open_worker(name="stubborn", shutdown_timeout=0.5)
    try:
        pid = await w.call(pw.refuse_to_exit)
        assert pid == w.pid
        t0 = time.monotonic()
        with pytest.warns(ForcedKillWarning, match=rf"stubborn \(pid {pid}\)"):
            await w.aclose()
        elapsed = time.monotonic() - t0
    finally:
        await w.aclose()
    assert 0.5 <= elapsed < 5
    assert w.returncode == -signal.SIGKILL
    assert pid_gone(pid)


async def test_forced_kill_warning_names_what_was_actually_sent(pw: ModuleType) -> None:
    w = await open_worker(shutdown_timeout=0.5)
    try:
        await w.call(pw.refuse_to_exit)
        with pytest.warns(ForcedKillWarning) as record:
            await w.aclose()
    finally:
        await w.aclose()
    (warning,) = record
    # aclose() sends a terminate request over the channel, never SIGTERM
    assert "SIGTERM" not in str(warning.message)
    assert f"(pid {w.pid})" in str(warning.message)


async def test_worker_with_a_live_non_daemon_thread_is_killed_after_shutdown_timeout(
    pw: ModuleType,
) -> None:
    def start_thread() -> None:
        import threading
        import time

        threading.Thread(target=time.sleep, args=(60,), daemon=False).start()

    w = await open_worker(name="threaded", shutdown_timeout=0.5)
    await w.call(start_thread)
    with pytest.warns(ForcedKillWarning, match=rf"threaded \(pid {w.pid}\)"):
        await w.aclose()
    assert pid_gone(w.pid)


# --------------------------------------------------------------- payloads


async def test_100mb_in_and_out(pw: ModuleType) -> None:
    data = bytes(range(256)) * (BIG // 256)
    async with open_worker() as w:
        n, digest, back = await asyncio.wait_for(w.call(pw.digest_and_reverse, data), 30)
        import hashlib

        assert n == BIG
        assert digest == hashlib.sha256(data).hexdigest()
        assert back == data[::-1]
        del back
        out = await asyncio.wait_for(w.call(pw.make_bytes, BIG, 7), 30)
        assert len(out) == BIG and out[:3] == bytes([7, 8, 9]) and out[-1] == (7 + BIG - 1) % 256
        await w.ping()
