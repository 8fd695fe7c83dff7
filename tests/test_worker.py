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
import functools
import importlib.machinery
import os
import pickle
import random
import re
import signal
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import child_pids, pid_gone
from proc_utils import Fifo, still_alive_after

import aioproc
from aioproc import BrokenWorkerError, ForcedKillWarning, WorkerProcess, open_worker
from aioproc._func import pickling
from aioproc._func.boot import Definitions
from aioproc._worker.process import STDERR_TAIL
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


async def test_a_broken_worker_names_the_last_lines_of_its_stderr(pw: ModuleType) -> None:
    """However much a worker wrote to stderr before it died, the error quotes
    exactly its last lines, in order."""
    async with open_worker(name="noisy") as w:
        with pytest.raises(BrokenWorkerError) as info:
            await asyncio.wait_for(w.call(pw.flood_stderr_then_exit, 50_000, 5), 20)
    msg = str(info.value)
    assert msg.startswith(f"worker noisy (pid {w.pid}) exited with code 5 during a call"), msg
    tail = msg.split("; last lines of its stderr:\n", 1)[1].splitlines()
    assert tail == [f"    err {i:05d}" for i in range(50_000 - STDERR_TAIL, 50_000)]


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


async def test_worker_ignoring_terminate_is_killed_after_its_grace_period(
    pw: ModuleType,
) -> None:
    w = await open_worker(name="stubborn", grace_period=0.5)
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
    w = await open_worker(grace_period=0.5)
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


async def test_worker_with_a_live_non_daemon_thread_is_killed_after_its_grace_period(
    pw: ModuleType,
) -> None:
    def start_thread() -> None:
        import threading
        import time

        threading.Thread(target=time.sleep, args=(60,), daemon=False).start()

    w = await open_worker(name="threaded", grace_period=0.5)
    await w.call(start_thread)
    with pytest.warns(ForcedKillWarning, match=rf"threaded \(pid {w.pid}\)"):
        await w.aclose()
    assert pid_gone(w.pid)


# -------------------------------------------------- one vocabulary, old spellings


async def test_aclose_is_idempotent_and_a_second_call_waits_for_the_first(
    pw: ModuleType,
) -> None:
    w = await open_worker(name="twice", grace_period=0.5)
    try:
        pid = await w.call(pw.refuse_to_exit)
        with pytest.warns(ForcedKillWarning, match=rf"twice \(pid {pid}\)"):
            first = asyncio.ensure_future(w.aclose())
            await asyncio.sleep(0)  # the first call has sent the terminate request
            await w.aclose()  # returns only once the first call's stop is over
            assert w.returncode == -signal.SIGKILL and pid_gone(pid)
            await first
    finally:
        await w.aclose()
    await w.aclose()  # and again, long after: nothing left to do
    assert repr(w) == f"<WorkerProcess twice pid={pid} exited -9>"


async def test_cancelling_either_of_two_acloses_at_random_points_leaves_no_worker(
    pw: ModuleType,
) -> None:
    rng = random.Random(41)
    children = child_pids()
    for round_ in range(8):
        w = await open_worker(name=f"racer{round_}", grace_period=0.3)
        pid = await w.call(pw.refuse_to_exit)
        with pytest.warns(ForcedKillWarning, match=rf"racer{round_} \(pid {pid}\)"):
            closes = [asyncio.ensure_future(w.aclose()) for _ in range(2)]
            victim = closes[rng.randrange(2)]
            for _ in range(rng.randrange(6)):
                await asyncio.sleep(0)
            if rng.random() < 0.5:
                await asyncio.sleep(rng.uniform(0, 0.5))  # during the grace period, or after
            victim.cancel()
            (survivor,) = [c for c in closes if c is not victim]
            await asyncio.wait_for(survivor, 10)  # returns only once the worker is gone
            assert w.returncode == -signal.SIGKILL and pid_gone(pid)
            await asyncio.wait({victim})  # cancelled, or done before the cancel came
    assert child_pids() == children


async def test_close_is_torchs_alias_of_aclose(pw: ModuleType) -> None:
    assert WorkerProcess.close is WorkerProcess.aclose
    w = await open_worker()
    try:
        pid = await w.call(os.getpid)
    finally:
        await w.close()
    assert w.returncode == 0 and pid_gone(pid)


async def test_a_polite_worker_is_not_kept_for_its_grace_period(pw: ModuleType) -> None:
    w = await open_worker(grace_period=600)
    pid = w.pid
    t0 = time.monotonic()
    await w.aclose()  # no ForcedKillWarning: the suite turns warnings into errors
    assert time.monotonic() - t0 < 30
    assert w.returncode == 0 and pid_gone(pid)


async def test_shutdown_timeout_still_works_and_warns(pw: ModuleType) -> None:
    with pytest.warns(DeprecationWarning, match=r"shutdown_timeout=\.\.\.\) is deprecated") as old:
        opening = open_worker(name="old", shutdown_timeout=0.5)
    (warning,) = old
    assert warning.filename == __file__  # it points at the caller's line
    w = await opening
    try:
        pid = await w.call(pw.refuse_to_exit)
        t0 = time.monotonic()
        with pytest.warns(ForcedKillWarning, match=r"within 0.5 s of the terminate request"):
            await w.aclose()
        elapsed = time.monotonic() - t0
    finally:
        await w.aclose()
    assert 0.5 <= elapsed < 5
    assert pid_gone(pid)


def test_two_spellings_of_one_option_are_refused_naming_both() -> None:
    children = child_pids()
    with pytest.raises(TypeError, match=r"got both grace_period=5 and shutdown_timeout=1, "):
        open_worker(grace_period=5, shutdown_timeout=1)
    with pytest.raises(TypeError, match=r"got both initializer=<built-in function print> and "):
        open_worker(print, initializer=print)
    with pytest.raises(TypeError, match=r"got both initargs=\(1,\) and init_args=\(2,\)"):
        open_worker(print, init_args=(2,), initargs=(1,))
    with pytest.raises(TypeError, match=r"open_worker\(\): initializer must be callable, got 7"):
        open_worker(initializer=7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"open_worker\(\): init_args must be a tuple .* got 'ab'"):
        open_worker(print, "ab")
    with pytest.raises(TypeError, match=r"open_worker\(\): name must be a str, got 3"):
        open_worker(name=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"grace_period must be a number of seconds, got '5'"):
        open_worker(grace_period="5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"grace_period must be a number >= 0, got -1"):
        open_worker(grace_period=-1)
    with pytest.raises(TypeError, match=r"takes from 0 to 2 positional arguments but 3"):
        open_worker(print, (), 30)  # type: ignore[misc]
    assert child_pids() == children


async def test_initializer_and_initargs_as_for_pools() -> None:
    async with open_worker(initializer=dict, initargs=([("via", "initializer")],)) as w:
        assert await w.call(aioproc.worker_state) == {"via": "initializer"}
    async with open_worker(dict, ([("via", "position")],)) as w:
        assert await w.call(aioproc.worker_state) == {"via": "position"}
    async with open_worker(init=dict, init_args=([("via", "init")],)) as w:
        assert await w.call(aioproc.worker_state) == {"via": "init"}
    async with open_worker(initializer=dict, init_args=([("via", "mixed")],)) as w:
        assert await w.call(aioproc.worker_state) == {"via": "mixed"}


def test_options_are_keyword_only_in_one_order_with_the_groups_types() -> None:
    import inspect

    group = inspect.signature(aioproc.start_processes).parameters
    for factory in (open_worker, aioproc.open_pool):
        params = inspect.signature(factory).parameters
        positional = [p.name for p in params.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert len(positional) <= 3, positional
        names = list(params)
        assert names.index("limits") < names.index("capacity") < names.index("cpus")
        assert params["cpus"].annotation == group["cpus"].annotation == "CpusArg"
        assert params["grace_period"].default is aioproc.results.DEFAULT_GRACE_PERIOD
        assert params["grace_period"].default == group["grace_period"].default


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


# ------------------------------------------- functions sent by value, once
#
# A script's functions cannot be imported by a worker: they travel by value.
# A persistent worker is sent each one once and then called by id (see
# ``_func.pickling.cached``); these tests pin that every call still sees
# exactly what a fresh copy would.


def script(source: str) -> dict[str, Any]:
    """Run ``source`` as a script's ``__main__`` would: its functions travel by value."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(textwrap.dedent(source), namespace)
    return namespace


def sent_by_id(w: WorkerProcess, fn: Any) -> bool:
    """Whether the next call of ``fn`` on ``w`` names it by id, without a definition."""
    entry = pickling.cached(fn)
    return entry is not None and entry.fid in w._definitions._ids


FUNCS_IN_WORKER = "len(__import__('sys').modules['aioproc._child.boot']._FUNCS)"


async def test_script_function_sees_every_change_made_between_calls() -> None:
    ns = script(
        """
        SCALE = 1
        TABLE = (1, 2)
        def f(x, k=1, *, m=1):
            return [x * SCALE * k * m, TABLE, getattr(f, "tag", None)]
        def scale():
            return SCALE
        def make(n):
            def get():
                return n
            def set_(v):
                nonlocal n
                n = v
            return get, set_
        """
    )
    f, scale = ns["f"], ns["scale"]
    get, set_ = ns["make"](1)
    async with open_worker() as w:
        assert await w.call(f, 3) == [3, (1, 2), None]
        assert sent_by_id(w, f)
        assert await w.call(f, 3) == [3, (1, 2), None]
        assert await w.call(scale) == 1
        ns["SCALE"] = True  # equal to 1, but not the same value
        assert await w.call(scale) is True
        ns["SCALE"] = 2  # a global the function reads
        ns["TABLE"] = (3,)
        assert await w.call(f, 3) == [6, (3,), None]
        f.__defaults__ = (10,)  # rebound defaults
        assert await w.call(f, 3) == [60, (3,), None]
        assert f.__kwdefaults__ is not None
        f.__kwdefaults__["m"] = -1  # keyword defaults changed in place
        assert await w.call(f, 3) == [-60, (3,), None]
        f.tag = "t"
        assert await w.call(f, 3) == [-60, (3,), "t"]
        assert await w.call(get) == 1
        set_(7)  # a closure cell
        assert await w.call(get) == 7
        assert sent_by_id(w, get)


async def test_changes_a_call_makes_in_the_worker_do_not_reach_the_next_call() -> None:
    ns = script(
        """
        COUNT = 0
        def bump():
            global COUNT
            COUNT += 1
            bump.calls = getattr(bump, "calls", 0) + 1
            return [COUNT, bump.calls]
        def counter():
            n = 0
            def inc():
                nonlocal n
                n += 1
                return n
            return inc
        """
    )
    inc = ns["counter"]()
    async with open_worker() as w:
        # as when each call carried its own copy (and as cloudpickle does)
        assert [await w.call(ns["bump"]) for _ in range(3)] == [[1, 1]] * 3
        assert [await w.call(inc) for _ in range(3)] == [1, 1, 1]
        assert sent_by_id(w, inc)


async def test_recursion_partials_lambdas_and_closures() -> None:
    ns = script(
        """
        def fact(n):
            return 1 if n <= 1 else n * fact(n - 1)
        def is_even(n):
            return True if n == 0 else is_odd(n - 1)
        def is_odd(n):
            return False if n == 0 else is_even(n - 1)
        def power(base, exp=2):
            return base ** exp
        """
    )
    fact = ns["fact"]
    offset = 5
    async with open_worker() as w:
        for _ in range(2):  # defined, then by id
            assert await w.call(fact, 6) == 720
            assert await w.call(ns["is_even"], 9) is False
            assert await w.call(functools.partial(ns["power"], exp=3), 2) == 8
            assert await w.call(functools.partial(fact, 4)) == 24
            assert await w.call(lambda x: fact(x) + offset, 3) == 11
            assert await w.call(functools.partial(len), "abc") == 3
        assert sent_by_id(w, fact) and sent_by_id(w, ns["power"])


async def test_functions_with_mutable_state_travel_whole_at_every_call() -> None:
    ns = script(
        """
        ITEMS = [1]
        def total(extra=None):
            return sum(ITEMS) + (extra or 0)
        """
    )
    async with open_worker() as w:
        assert await w.call(ns["total"]) == 1
        ns["ITEMS"].append(2)  # mutated in place: no identity changes
        assert await w.call(ns["total"]) == 3
        assert await w.call(ns["total"], 4) == 7
        assert not sent_by_id(w, ns["total"])


async def test_worker_keeps_a_bounded_number_of_functions() -> None:
    fns = [script(f"def f(x):\n    return x + {i}\n")["f"] for i in range(5)]
    async with open_worker() as w:
        w._definitions = Definitions(limit=2)
        for _ in range(2):
            for i, fn in enumerate(fns):
                assert await w.call(fn, 10) == 10 + i
                assert await w.call(eval, FUNCS_IN_WORKER) <= 2


async def test_a_definition_that_fails_in_the_worker_is_sent_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a module the parent has (in sys.modules) but the worker cannot import yet
    ghost = ModuleType("aioproc_test_ghost")
    ghost.__spec__ = importlib.machinery.ModuleSpec("aioproc_test_ghost", None)
    ghost.VALUE = 5  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "aioproc_test_ghost", ghost)
    ns = script("def read():\n    return aioproc_test_ghost.VALUE\n")
    ns["aioproc_test_ghost"] = ghost
    async with open_worker() as w:
        for _ in range(2):
            with pytest.raises(ModuleNotFoundError, match="aioproc_test_ghost"):
                await w.call(ns["read"])
        (tmp_path / "aioproc_test_ghost.py").write_text("VALUE = 6\n")
        await w.call(exec, f"import sys; sys.path.insert(0, {str(tmp_path)!r})")
        assert await w.call(ns["read"]) == 6  # the worker's own module, as by reference
        assert await w.call(eval, FUNCS_IN_WORKER) == 1
